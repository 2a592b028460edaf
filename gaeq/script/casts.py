"""Where a loss takes a model's half-precision logits cast to float32 — `logits.float()`, or autocast's cast
inside `F.cross_entropy` — found in the autograd graph a backward is about to run: the cast's gradient is the
loss's own, in float32, before it is rounded back to the logits' dtype (gaeq.script.targets reads it there).

A cast counts where it takes the logits themselves, or a reshape of them (`view`, `reshape`, `flatten`,
`contiguous`): its gradient then holds the logits' entries in their order. Nothing else is walked through."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch

CAST = "ToCopyBackward0"
RESHAPES = frozenset(
    {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "CloneBackward0"}
)
"""Backward nodes of ops that keep a tensor's entries in their order (a view, a reshape, a contiguous copy)."""
MOST_NODES = 4096
"""Nodes walked from a loss at most: the loss's own ops come first; a loss that also reaches far into the model
(an auxiliary loss) is not walked to its end."""


def node_of(t: torch.Tensor) -> tuple | None:
    """What identifies `t` among a backward node's inputs: its node and which of that node's outputs it is."""
    return None if t.grad_fn is None else (t.grad_fn, t.output_nr)


def casts_of(roots, wanted: dict[tuple, Hashable]) -> list[tuple[torch.autograd.graph.Node, Hashable]]:
    """Every cast node that takes one of the `wanted` tensors (`node_of` → what it stands for) or a reshape of it,
    in the graph from `roots` (the tensors a backward starts from)."""
    roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or ())
    queue = deque(t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None)
    seen: set = set()
    found = []
    while queue and len(seen) < MOST_NODES:
        node = queue.popleft()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == CAST and (of := _reshaped_from(node, wanted)) is not None:
            found.append((node, of))
            continue
        queue.extend(nxt for nxt, _ in node.next_functions if nxt is not None and (nxt, _) not in wanted)
    return found


def _reshaped_from(cast, wanted: dict[tuple, Hashable]) -> Hashable | None:
    """What the cast's input stands for, where it is a wanted tensor or a chain of reshapes of one."""
    edge = cast.next_functions[0] if cast.next_functions else (None, 0)
    for _ in range(8):
        if edge in wanted:
            return wanted[edge]
        node = edge[0]
        if node is None or node.name() not in RESHAPES or not node.next_functions:
            return None
        edge = node.next_functions[0]
    return None
