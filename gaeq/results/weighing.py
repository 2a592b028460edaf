"""Each script cell's weighting (gaeq.script.objective), read from its probe, beside its comparison: said against
its reference's where the two differ; and, where a group has no reference (`baseline: none`), the cell's verdict.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from gaeq.results.compare import Verdict
from gaeq.results.trace import cell_dir
from gaeq.script.contract import TARGETS_FILE
from gaeq.script.objective import Shape, Weighting, weighting
from gaeq.script.verdict import read_probe

ALONE = (
    "judged by its targets' weights alone (no reference: a check of the objective's weighting, not of the "
    "optimizer, the data or the schedule)"
)


def weighting_of(run_dir: Path, cell_id: str) -> Weighting | None:
    """What a cell's targets' weights say: a script's, from its probe; a cell of gaeq's own trainers, from its ranks'
    files (gaeq.script.targets.reading) — unread where any rank could not read them. None where neither was left."""
    folder = cell_dir(run_dir, cell_id)
    probe = read_probe(folder)
    if probe is not None:
        return weighting(probe.get("steps") or [], unread=probe.get("targets_unread"))
    ranks = []
    for rank in itertools.count():
        try:
            ranks.append(json.loads((folder / TARGETS_FILE.format(rank=rank)).read_text()))
        except (OSError, ValueError):
            break
    if not ranks:
        return None
    if unread := next((r["unread"] for r in ranks if r.get("unread")), None):
        return weighting([], unread=unread)
    steps = [
        {"step": i, "world_size": len(ranks), "targets": list(forwards)}
        for i, forwards in enumerate(zip(*(r["steps"] for r in ranks)))
    ]
    return weighting(steps)


def beside(own: Weighting, reference: Weighting | None) -> Weighting:
    """The cell's weighting, said against its reference's where their shapes differ (a reference that weighs its
    targets unequally on purpose sets what its splits are held to)."""
    if own.shape == Shape.UNREAD and reference is not None:
        return Weighting(shape=own.shape, line=f"{own.line} — the comparison with the reference judges it")
    if reference is None or reference.shape == Shape.UNREAD or own.shape == reference.shape:
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
    if own is None or own.shape == Shape.UNREAD:
        why = own.line.removeprefix("not read: ") if own is not None else "its probe wrote nothing"
        return (
            Verdict.ERROR,
            f"no reference, and its targets' weights were not read ({why}): nothing judges it — "
            "give it a reference (`--baseline`, `baseline:`)",
        )
    return (Verdict.MATCH if own.is_mean else Verdict.DIVERGE), f"{ALONE}: {own.line}"
