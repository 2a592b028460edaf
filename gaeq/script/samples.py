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
  and the data check says it was not made (gaeq.results.script_checks), rather than guess.

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

IGNORE_INDEX = -100
"""The label ignore index of torch's cross-entropy and of transformers' collators: label padding."""
MASK_NAMES = ("attention_mask",)
"""Inputs that say which positions of a row are the sample's."""
LAYOUT_NAMES = ("position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens")
"""Inputs that say where a packed row's sequences start — which positions attend to which —, with the mask:
layout, read as the sequences they define, never hashed as data."""
TARGET_NAMES = ("labels", "shift_labels")
"""Inputs that are the loss's targets: read as the targets each position is trained to predict (labels a
causal LM's loss shifts, or `shift_labels` a collator shifted already: transformers' models use them as they are)."""
NOT_SAMPLES = ("num_items_in_batch",)
"""Inputs that are not a sample's data (transformers' count of the step's tokens)."""


@dataclass(frozen=True)
class MicroBatch:
    """One forward of the model, as the data check reads it."""

    fingerprints: list[str]
    """One per sample (a row, or a sequence of a packed row): its data and the targets its positions are
    trained to predict, without padding or layout, where gaeq can tell them."""
    keys: list[str]
    """One per sample: its first input alone (the token ids, the image), to tell a sample that is missing
    from one that is there with other values in its other inputs (labels)."""
    names: list[str]
    """The inputs hashed, in order (the first is the key)."""
    length: int | None
    """Positions per row as the model received them (None: no input laid out by position)."""
    exact: bool
    """Padding was removed by a rule that knows it (a mask, a known padding value), or there was none to remove."""
    layout: str = "rows as received"
    """How the samples were laid out: padded (which side, told by what), packed (by which inputs), as received."""
    count: int | None = None
    """Samples the micro-batch holds, where not one per fingerprint: a packed row whose layout inputs disagree
    holds the sequences any of them marks (the script's micro-batch size), trained as the fewer, longer ones
    they all mark (the fingerprints)."""
    rows: int | None = None
    """Rows as received (the inputs' first dimension): a packed dataset's micro-batch size counts its packs."""
    row_keys: list[str] = dataclasses.field(default_factory=list)
    """One per row as received: its samples' fingerprints, joined — the same row in every split that hands the
    model the same rows (what a row's target weights are matched by, gaeq.objective.invariance)."""

    @property
    def samples(self) -> int:
        return len(self.fingerprints) if self.count is None else self.count


class SampleIdentity:
    """Fingerprints of the samples a model receives (:meth:`read`), and what is known of their padding.

    A sample's fingerprint holds its data at its own positions and, for the loss's targets (``labels``), what
    each of its positions is trained to predict: labels that copy the input ids wherever they count are a
    causal LM's, whose loss shifts them (transformers' models do) — position t predicts the label at t + 1,
    so a sample's first label is never its target, and its last position's target is whatever follows it in
    the row (padding's -100, a packed neighbour's first label, nothing at the row's end). The same samples
    padded left or right, or packed with each sequence's first label ignored (DataCollatorWithFlattening),
    then have the same fingerprints; a packed row whose neighbour's first token is a target has not."""

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
        inputs = [(name, t.detach().cpu()) for name, t in named if t.shape[0] == rows]
        mask = next(
            (t for name, t in inputs if _leaf(name) in MASK_NAMES and t.ndim == 2 and not t.is_floating_point()), None
        )
        length = _sequence_length(inputs, mask)
        laid_out = [length is not None and t.ndim >= 2 and t.shape[1] == length for _, t in inputs]
        positional = [x for x, p in zip(inputs, laid_out) if p and _leaf(x[0]) not in (*MASK_NAMES, *LAYOUT_NAMES)]
        by_row = [x for x, p in zip(inputs, laid_out) if not p and _leaf(x[0]) not in (*MASK_NAMES, *LAYOUT_NAMES)]
        starts = _sequence_starts(named, length) if length is not None and mask is None else None
        target = [_leaf(n) in TARGET_NAMES and not t.is_floating_point() for n, t in positional]  # (float: data)
        data = [x for x, is_target in zip(positional, target) if not is_target]
        targets = [x for x, is_target in zip(positional, target) if is_target]
        count = None
        if not positional:
            spans, exact, layout = [[None] for _ in range(rows)], True, "rows as received"
        elif mask is not None:
            keep = mask != 0
            spans, exact = [[keep[r].nonzero().flatten()] for r in range(rows)], True
            layout = _padding(keep, "attention_mask")
        elif starts is not None:
            (spans, layout, count), exact = _packed(starts, rows, length), True
        else:
            spans, exact, layout = self._stripped(data, targets, rows, length)
        ids = next((t for _, t in data if t.ndim == 2 and not t.is_floating_point()), None)
        shifts = [ids is not None and _copies(t, ids, spans) for _, t in targets]
        fingerprints, keys, row_keys = [], [], []
        for r, row_spans in enumerate(spans):
            start = len(fingerprints)
            for at in row_spans:
                pieces = [t[r] if at is None else t[r][at] for _, t in data]
                pieces += [_targets(t[r], at, shift=shift) for (_, t), shift in zip(targets, shifts)]
                if len(row_spans) == 1:  # (a packed row's per-row inputs are no one sequence's)
                    pieces += [t[r] for _, t in by_row]
                fingerprints.append(_hash(pieces))
                keys.append(_hash(pieces[:1]))
            row_keys.append("+".join(fingerprints[start:]))
        names = [n for n, _ in data]
        names += [f"{n} (targets{', shifted' if shift else ''})" for (n, _), shift in zip(targets, shifts)]
        names += [n for n, _ in by_row]
        count = None if count == len(fingerprints) else count
        laid = {"length": length, "exact": exact, "layout": layout, "count": count, "rows": rows}
        return MicroBatch(fingerprints, keys, names, **laid, row_keys=row_keys)

    def _stripped(self, data, targets, rows: int, length: int):
        """Spans of rows without a mask or packing: each row's positions without the run of known padding
        values at either end of its ids (the labels' -100 where the labels are all there is); the whole row,
        not exact, where gaeq knows no padding value."""
        ints = [t for _, t in data if t.ndim == 2 and not t.is_floating_point()]
        if ints and self.pad_values:
            reference, pads, said = ints[0], self.pad_values, "padding values removed"
        elif not ints and targets:
            reference, pads, said = targets[0][1], {IGNORE_INDEX}, "label padding removed"
        else:  # padding gaeq cannot tell from data: the data check then says so, where lengths vary
            return [[torch.arange(length)] for _ in range(rows)], False, "rows as received"
        return [[_kept(reference[r], pads)] for r in range(rows)], True, said

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


def _sequence_starts(named: list[tuple[str, torch.Tensor]], length: int) -> dict[str, list[set[int]]] | None:
    """Where each layout input says a row's sequences start (position_ids restarting at 0, seq_idx changing,
    cu_seq_lens' offsets), per row: None where no input packs sequences (no restart inside a row, no
    single row counting from 0 — TRL's padding_free packs a micro-batch into one row)."""
    found: dict[str, list[set[int]]] = {}
    for name, t in named:
        leaf = _leaf(name)
        if leaf not in LAYOUT_NAMES or t.is_floating_point():
            continue
        t = t.detach().cpu()
        if leaf == "position_ids" and t.ndim == 2 and t.shape[1] == length:
            found[leaf] = [set((row == 0).nonzero().flatten().tolist()) | {0} for row in t]
        elif leaf == "seq_idx" and t.ndim == 2 and t.shape[1] == length:
            found[leaf] = [{0} | {i for i in range(1, length) if row[i] != row[i - 1]} for row in t]
        elif leaf.startswith("cu_seq") and t.ndim == 1:  # offsets into the rows laid end to end
            offsets = t.tolist()
            rows = max(1, offsets[-1] // length) if offsets else 1
            found[leaf] = [{o - r * length for o in offsets[:-1] if r * length <= o < (r + 1) * length} | {0}
                           for r in range(rows)]  # fmt: skip
    positions = _named_tensor(named, "position_ids")
    counting = (
        positions is not None
        and positions.shape[0] == 1
        and bool((positions.cpu() == torch.arange(positions.shape[-1])).all())
    )
    if not found or (not counting and all(len(s) == 1 for starts in found.values() for s in starts)):
        return None
    return found


def _named_tensor(named: list[tuple[str, torch.Tensor]], leaf: str) -> torch.Tensor | None:
    return next((t for name, t in named if _leaf(name) == leaf), None)


def _packed(starts: dict[str, list[set[int]]], rows: int, length: int) -> tuple[list, str, int]:
    """Each packed row's sequences: a sequence starts where every layout input says one does (where they
    disagree, a model reading one of them attends across the other's boundary: the sequences it trains on
    are the longer ones) — the layout, with what disagreed, and the samples any of them marks (the
    micro-batch's size, as its collator made it)."""
    spans, count = [], 0
    for r in range(rows):
        marked = [s[r] for s in starts.values() if r < len(s)]
        bounds = [*sorted(set.intersection(*marked)), length]
        spans.append([torch.arange(a, b) for a, b in zip(bounds, bounds[1:])])
        count += len(set.union(*marked))
    counts = {name: sum(len(s) for s in per_row) for name, per_row in starts.items()}
    if set(counts.values()) == {rows}:  # one sequence a row (a micro-batch of one): nothing was packed
        return spans, "rows as received", count
    layout = f"packed by {', '.join(starts)}"
    if len(set(counts.values())) > 1:
        layout += " (they disagree: " + ", ".join(f"{n} starts {c}" for n, c in counts.items()) + " sequences)"
    return spans, layout, count


def _padding(keep: torch.Tensor, by: str) -> str:
    """Which side a mask padded its rows on: 'padded right (attention_mask)', left, both, or none."""
    sides = []
    if bool((~keep[:, 0] & keep.any(dim=1)).any()):
        sides.append("left")
    if bool((~keep[:, -1] & keep.any(dim=1)).any()):
        sides.append("right")
    return f"padded {' and '.join(sides)} ({by})" if sides else f"no padding ({by})"


def _kept(row: torch.Tensor, pads: set[float]) -> torch.Tensor:
    """The positions of `row` between the runs of padding values at either end."""
    padding = torch.zeros_like(row, dtype=torch.bool)
    for value in pads:
        padding |= row == value
    kept = (~padding).nonzero().flatten()
    return kept if kept.numel() == 0 else torch.arange(int(kept[0]), int(kept[-1]) + 1)


def _copies(labels: torch.Tensor, ids: torch.Tensor, spans: list) -> bool:
    """Whether `labels` copy `ids` at every position of the samples where they count (not IGNORE_INDEX): a
    causal LM's labels, which its loss shifts."""
    if labels.shape != ids.shape:
        return False
    for r, row_spans in enumerate(spans):
        for at in row_spans:
            got, want = (labels[r], ids[r]) if at is None else (labels[r][at], ids[r][at])
            counted = got != IGNORE_INDEX
            if not bool((got[counted] == want[counted]).all()):
                return False
    return True


def _targets(labels: torch.Tensor, at: torch.Tensor | None, *, shift: bool) -> torch.Tensor:
    """What the sample's positions `at` of a row are trained to predict: the labels there, or (`shift`) at the
    next position of the row — IGNORE_INDEX past its end."""
    if at is None:
        at = torch.arange(labels.shape[0])
    if not shift:
        return labels[at]
    following = torch.cat([labels, labels.new_full((1,), IGNORE_INDEX)])
    return following[at + 1]


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
