"""Each script cell's weighting (gaeq.script.objective), read from its probe, beside its comparison: said against
its reference's where the two differ; and, where a group has no reference (`baseline: none`), the cell's verdict.
"""

from __future__ import annotations

from pathlib import Path

from gaeq.results.compare import Verdict
from gaeq.results.trace import cell_dir
from gaeq.script.objective import Weighting, weighting
from gaeq.script.verdict import read_probe

ALONE = (
    "judged by its targets' weights alone (no reference: a check of the objective's weighting, not of the "
    "optimizer, the data or the schedule)"
)


def weighting_of(run_dir: Path, cell_id: str) -> Weighting | None:
    """What a script cell's probe read of its targets' weights; None where it left no probe."""
    probe = read_probe(cell_dir(run_dir, cell_id))
    if probe is None:
        return None
    return weighting(probe.get("steps") or [], unread=probe.get("targets_unread"))


def beside(own: Weighting, reference: Weighting | None) -> Weighting:
    """The cell's weighting, said against its reference's where their shapes differ (a reference that weighs its
    targets unequally on purpose sets what its splits are held to)."""
    if reference is None or "unread" in (own.shape, reference.shape) or own.shape == reference.shape:
        return own
    return Weighting(
        shape=own.shape,
        line=f"{own.line} — where the reference's weights read: {reference.line}",
        step=own.step,
        fix=own.fix,
    )


def judged_alone(own: Weighting | None) -> tuple[Verdict, str]:
    """A split with no reference: `match` where its targets weigh 1/N and sum to 1 in every step read, `diverge`
    with the shape its weights have otherwise, `error` where none could be read."""
    if own is None or own.shape == "unread":
        why = own.line.removeprefix("not read: ") if own is not None else "its probe wrote nothing"
        return (
            Verdict.ERROR,
            f"no reference, and its targets' weights were not read ({why}): nothing judges it — "
            "give it a reference (`--baseline`, `baseline:`)",
        )
    return (Verdict.MATCH if own.is_mean else Verdict.DIVERGE), f"{ALONE}: {own.line}"
