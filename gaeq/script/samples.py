"""What identifies a sample in a script's model inputs, whatever the split.

A sample is fingerprinted from the rows the model being trained receives (never its outputs, never
what a loss module receives), with the padding its micro-batch gave it removed — so the same
sample has the same fingerprint whether it was padded to 17 positions in one split or to 23 in
another, on the left or on the right:

- **an attention mask** among the inputs (``attention_mask``, by keyword or by the position the
  model's ``forward`` gives it): every tensor laid out by position is read at the mask's non-zero
  positions only — exact, left or right padding alike;
- else **padding values known from the collation**: the ``padding_value`` of every
  ``pad_sequence`` call the script made (hooked), the ``pad_id`` the script told gaeq
  (``gaeq.probe(pad_id=…)``), and the label ignore index (-100) — every 2-D integer tensor is read
  without the run of those values at either end (a function of the sample alone, whatever the
  amount of padding on either side);
- else the rows are hashed as they are, and the micro-batch is marked **not exact**: when the
  inputs' length then varies between micro-batches, a difference in fingerprints may be padding,
  and the data check says it was not made (gaeq.script.verdict), rather than guess.

Inputs without positions (images, features, per-sample values) are hashed row by row as they are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import gaeq.rows as rows

IGNORE_INDEX = -100
"""The label ignore index of torch's cross-entropy and of transformers' collators: label padding."""
MASK_NAMES = ("attention_mask",)
"""Inputs that say which positions of a row are the sample's."""
NOT_SAMPLES = ("num_items_in_batch",)
"""Inputs that are not a sample's data (transformers' count of the step's tokens)."""


@dataclass(frozen=True)
class MicroBatch:
    """One forward of the model, as the data check reads it."""

    fingerprints: list[str]
    """One per row, padding removed where gaeq can tell it."""
    keys: list[str]
    """One per row: its first input alone (the token ids, the image), to tell a sample that is missing
    from one that is there with other values in its other inputs (labels, masks)."""
    names: list[str]
    """The inputs hashed, in order (the first is the key)."""
    length: int | None
    """Positions per row as the model received them (None: no input laid out by position)."""
    exact: bool
    """Padding was removed by a rule that knows it (a mask, a known padding value), or there was none to remove."""


class SampleIdentity:
    """Fingerprints of the rows a model receives (:meth:`read`), and what is known of their padding."""

    def __init__(self) -> None:
        self.pad_values: set[float] = set()
        """Padding values the script's collation used (pad_sequence) or named (gaeq.probe(pad_id=…))."""
        self._names: dict[type, tuple[str, ...] | None] = {}

    def read(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> MicroBatch | None:
        """The micro-batch `module` (the model being trained) received, or None if it had no tensor input."""
        named = [
            (name, t)
            for name, t in flatten([*self._positional(module, args), *kwargs.items()])
            if t.ndim > 0 and _leaf(name) not in NOT_SAMPLES
        ]
        if not named:
            return None
        rows = named[0][1].shape[0]
        inputs = [(name, t.detach()) for name, t in named if t.shape[0] == rows]
        mask = next(
            (t for name, t in inputs if _leaf(name) in MASK_NAMES and t.ndim == 2 and not t.is_floating_point()), None
        )
        length = _sequence_length(inputs, mask)
        laid_out = [length is not None and t.ndim >= 2 and t.shape[1] == length for _, t in inputs]
        positional = [x for x, p in zip(inputs, laid_out) if p]
        by_row = [x for x, p in zip(inputs, laid_out) if not p]
        if mask is None and (packed := _packed(positional)) is not None:
            return packed
        exact = True
        if mask is not None:
            keep = mask.cpu() != 0
            cut = [_rows_at(t.cpu(), keep) for _, t in positional]
        else:
            cut = []
            for name, t in positional:
                pads = self.pad_values | {IGNORE_INDEX} if self.pad_values or "label" in name else set()
                if pads and t.ndim == 2:
                    cut.append([_strip(row, pads) for row in t.cpu()])
                else:
                    cut.append(list(t.cpu()))
                    exact = False
        whole = [list(t.cpu()) for _, t in by_row]
        read = [*cut, *whole]
        fingerprints = [_hash(per_row[i] for per_row in read) for i in range(rows)]
        keys = [_hash([read[0][i]]) for i in range(rows)]
        names = [name for name, _ in (*positional, *by_row)]
        return MicroBatch(fingerprints=fingerprints, keys=keys, names=names, length=length, exact=exact)

    def _positional(self, module: torch.nn.Module, args: tuple) -> list[tuple[str, Any]]:
        """Positional inputs named as the innermost wrapped module's forward names them (DDP's,
        DeepSpeed's engine's and a compiled module's forward take ``*args``)."""
        inner = module
        while isinstance(getattr(inner, "module", None), torch.nn.Module) or hasattr(inner, "_orig_mod"):
            inner = getattr(inner, "module", None) or inner._orig_mod
        kind = type(inner)
        if kind not in self._names:
            try:
                params = list(inspect.signature(inner.forward).parameters.values())
            except (TypeError, ValueError):
                params = []
            named = []
            for p in params:
                if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    break
                named.append(p.name)
            self._names[kind] = tuple(named)
        names = self._names[kind] or ()
        return [(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)]


def flatten(named: list[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of the inputs, wherever the batch holds them — in lists and tuples (Lightning hands its
    module the batch as a list: ``([x, y], batch_idx)``), mappings (a dict, transformers' ``BatchEncoding``)
    and dataclasses — each named by its path (``batch.input_ids``, ``arg0[1]``), in order."""
    found: list[tuple[str, torch.Tensor]] = []
    for name, value in named:
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, Mapping):
            found += flatten([(f"{name}.{key}" if name else str(key), v) for key, v in value.items()])
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += flatten([(f"{name}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)])
        elif isinstance(value, (list, tuple)):
            found += flatten([(f"{name}[{i}]", v) for i, v in enumerate(value)])
    return found


def _packed(positional: list[tuple[str, torch.Tensor]]) -> MicroBatch | None:
    """Rows that pack sequences end to end, told by their `position_ids` (no attention mask, on purpose: TRL's
    padding_free, a packing collator) — restarting at 0 inside a row, or counting a batch's single row from 0
    (one sequence packed alone: a single row needs no padding) — read as their sequences: each one a sample,
    exactly delimited by the script's own positions, the same whichever sequences share its row. None where
    positions say neither."""
    positions = next((t for name, t in positional if _leaf(name) == "position_ids" and t.ndim == 2), None)
    if positions is None or positions.is_floating_point():
        return None
    positions = positions.cpu()
    counting = positions.shape[0] == 1 and bool((positions == torch.arange(positions.shape[1])).all())
    if not counting and not bool((positions[:, 1:] == 0).any()):
        return None
    others = [(name, t.cpu()) for name, t in positional if _leaf(name) != "position_ids"]
    fingerprints, keys = [], []
    for row, starts in enumerate(positions == 0):
        bounds = [*starts.nonzero().flatten().tolist(), positions.shape[1]]
        for start, stop in zip(bounds, bounds[1:]):
            pieces = [t[row, start:stop] for _, t in others]
            fingerprints.append(_hash(pieces))
            keys.append(_hash(pieces[:1]))
    names = [name for name, _ in others]
    return MicroBatch(fingerprints=fingerprints, keys=keys, names=names, length=positions.shape[1], exact=True)


def _leaf(name: str) -> str:
    """An input's own name, without the path to it (`batch.attention_mask` → `attention_mask`)."""
    return name.rsplit(".", 1)[-1]


def _hash(rows) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for row in rows:
        digest.update(row.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _sequence_length(inputs: list[tuple[str, torch.Tensor]], mask: torch.Tensor | None) -> int | None:
    """Positions per row: the mask's, else the first 2-D integer input's (token ids), else None."""
    if mask is not None:
        return mask.shape[1]
    ids = next((t for _, t in inputs if t.ndim == 2 and not t.is_floating_point() and t.dtype != torch.bool), None)
    return None if ids is None else ids.shape[1]


def _rows_at(t: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
    """Each row of `t` at its kept positions (dimension 1)."""
    return [t[i][keep[i]] for i in range(t.shape[0])]


def _strip(row: torch.Tensor, pads: set[float]) -> torch.Tensor:
    """`row` without the run of padding values at either end."""
    padding = torch.zeros_like(row, dtype=torch.bool)
    for value in pads:
        padding |= row == value
    kept = (~padding).nonzero()
    if kept.numel() == 0:
        return row[:0]
    return row[int(kept[0]) : int(kept[-1]) + 1]


wraps = rows.wraps
"""Whether a module is one a training call goes through to reach the model (gaeq.rows.CALL_WRAPPERS)."""


def trainable(module: torch.nn.Module) -> bool:
    """Whether `module` has a parameter that trains (a loss or a metric has none; a frozen teacher's do not)."""
    return any(p.requires_grad for p in module.parameters())
