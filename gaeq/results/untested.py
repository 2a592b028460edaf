"""What a run did not test, said beside its verdicts: a clip that never acted in any step of any cell, steps
its reference trained at lr 0. A verdict stands on what ran; these lines say where it cannot speak (and the
noise floor's line says where the twins did not move: gaeq.results.lines)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from gaeq.matrix import Matrix, Role
from gaeq.results.outcome import CellOutcome
from gaeq.results.trace import TraceStore


def untested(matrix: Matrix, outcomes: Mapping[str, CellOutcome], traces: TraceStore) -> list[str]:
    """One line per group and thing its run did not test."""
    lines = []
    for group, base_id in matrix.baselines.items():
        cells = [c for c in matrix.cells if c.group == group and c.role in (Role.CELL, Role.BASELINE)]
        ran = [(c, outcomes[c.id]) for c in cells if getattr(outcomes.get(c.id), "status", None) == "done"]
        if said := _clip_never_acted(group, ran, traces):
            lines.append(said)
        if said := _at_lr_zero(group, base_id, traces):
            lines.append(said)
    return lines


def _clip_never_acted(group: str, ran: list, traces: TraceStore) -> str | None:
    """Where every cell clips (its `ran` says at what) and no step of any of them had a grad norm above it."""
    norms, clips = [], set()
    for cell, outcome in ran:
        clip = (outcome.ran or {}).get("gradient_clipping")
        trace = traces.usable(cell.id)
        if not clip or trace is None:
            return None  # a cell that does not clip, or is not read: the clip may have acted there
        clips.add(float(clip))
        norms += [r.grad_norm for r in trace if math.isfinite(r.grad_norm)]
    if not norms or len(clips) != 1 or max(norms) > min(clips):
        return None
    clip = min(clips)
    return (
        f"Clipping {group}: gradient_clipping {clip:g} never acted — grad norms {min(norms):.2g} to {max(norms):.2g} "
        "in every step of every cell: this run did not test the clip"
    )


def _at_lr_zero(group: str, base_id: str, traces: TraceStore) -> str | None:
    trace = traces.usable(base_id)
    zero = [r.step for r in trace or () if r.lr == 0]
    if not zero:
        return None
    shown = ", ".join(map(str, zero[:6])) + ("…" if len(zero) > 6 else "")
    return (
        f"Schedule {group}: the reference trains at lr 0 at step{'s' if len(zero) > 1 else ''} {shown}: no weight "
        "moves there — those steps test the loss and the grad norm, not an update"
    )
