"""Each script cell's weighting (gaeq.objective.weighting), read from its probe, and what it says of the verdict:

- with a reference, a check beside the numbers (the `weights` metric): a split whose own weights are tied to its
  split, or that differ from the reference's (gaeq.objective.invariance), diverges — even where the numbers agree
  within their tolerances, and the reason says both; the reference's own weights are judged too (`reference_note`);
- with none (`baseline: none`), the verdict (`judged_alone`): each split's weights beside those of the other splits
  of the same script and arguments — the same in every split, or the same as the split that holds the whole batch
  in one micro-batch, match; one split alone matches where its shape is of the step's rows alone.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

from gaeq.contract import TARGETS_FILE
from gaeq.matrix import Cell, Matrix, Role
from gaeq.objective.invariance import Difference, compare
from gaeq.objective.shapes import BRIEF, Kind, Shape
from gaeq.objective.weighting import Weighting, weighting
from gaeq.results.compare import Verdict
from gaeq.results.script_checks import read_probe
from gaeq.results.trace import cell_dir

ALONE = (
    "judged by its targets' weights alone (no reference: a check of the objective's weighting, not of the "
    "optimizer, the data or the schedule)"
)


def weighting_of(run_dir: Path, cell: Cell) -> Weighting | None:
    """What a cell's targets' weights say: a script's, from its probe; a cell of gaeq's own trainers, from its ranks'
    files (gaeq.script.targets.reading) — unread where any rank could not read them. None where neither was left."""
    folder = cell_dir(run_dir, cell.id)
    ga = cell.grad_accum_steps if cell.divisible else None
    probe = read_probe(folder)
    if probe is not None:
        return weighting(probe.get("steps") or [], unread=probe.get("targets_unread"), grad_accum=ga)
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
    return weighting(steps, grad_accum=ga)


def beside(own: Weighting, reference: Weighting | None) -> Weighting:
    """The cell's weighting, said against its reference's where their shapes differ (a reference that weighs its
    targets unequally on purpose sets what its splits are held to)."""
    if own.shape in (Shape.UNREAD, Shape.UNRESOLVED) and reference is not None:
        return replace(own, line=f"{own.line} — the comparison with the reference judges")
    if reference is None or reference.kind == Kind.UNREAD or own.shape == reference.shape:
        return own
    return replace(own, line=f"{own.line} — the reference's: {reference.brief}")


def check(own: Weighting | None, reference: Weighting | None) -> dict:
    """The `weights` metric of a split compared with its reference: ``{"weights": (step, why) | None}`` where it was
    checked — its own weights tied to its split, or apart from the reference's, else None —; ``{}`` where its weights
    were not read (its `Weights:` line says why), or no row of its is the reference's (packed otherwise: the data
    check says so)."""
    if own is None or own.kind == Kind.UNREAD:
        return {}
    shares = reference is not None and reference.kind == Kind.SPLIT
    if own.kind == Kind.SPLIT:
        also = f" — the reference's too ({reference.brief}): it shares the mistake" if shares else ""
        return {"weights": (own.step or 0, f"its targets' weights are tied to its split: {own.line}{also}")}
    if reference is None or reference.kind == Kind.UNREAD:
        return {}
    found = compare(own, reference)
    if isinstance(found, str):  # rows laid out otherwise than the reference's: the data check says how
        return {}
    if found is None:
        return {"weights": None}
    return {
        "weights": (
            found.step,
            f"its targets' weights differ from the reference's {found.words()}: {own.line} — the reference's: "
            f"{reference.brief}",
        )
    }


def beside_divergence(own: Weighting | None, reference: Weighting | None) -> str:
    """What a split's weights say of a divergence the numbers caught, in the reason's words: their shape and its fix
    where they are tied to the split, where they part from the reference's; that the difference is not in the
    weighting where they are the reference's; nothing where they were not read."""
    if own is None or own.kind == Kind.UNREAD:
        return ""
    if own.kind == Kind.SPLIT:
        fix = f" — {own.fix}" if own.fix else ""
        return f" — its targets' weights are tied to its split: {BRIEF[own.shape]}{_at(own.step)}{fix}"
    if reference is None or reference.kind == Kind.UNREAD:
        return ""
    found = compare(own, reference)
    if found is None:
        return " — its targets' weights are the reference's, step by step: the difference is not in the weighting"
    if isinstance(found, Difference):
        return f" — its targets' weights ({own.brief}) differ from the reference's {found.words()}"
    return ""


def _at(step: int | None) -> str:
    return "" if step is None else f" (from step {step})"


def reference_note(reference: Weighting | None) -> str | None:
    """What the Reference line says of a reference whose own weights are tied to its split."""
    if reference is None or reference.kind != Kind.SPLIT:
        return None
    return (
        f"its own targets' weights are tied to its split: {BRIEF[reference.shape]} (its `Weights:` line) — a split "
        "that agrees with it is judged by its own weights too"
    )


def peers_of(matrix: Matrix, cell: Cell) -> list[Cell]:
    """The other splits of a cell's group that run the same script arguments (its `args:`): the same program."""
    return [
        c
        for c in matrix.cells
        if c.group == cell.group and c.role is Role.CELL and c.id != cell.id and c.script_args == cell.script_args
    ]


def judge_alone(cell: Cell, outcome, own: Weighting | None, peers: list) -> tuple[Verdict, str, None]:
    """A split of a group with no reference (`baseline: none`), as judged: skipped, an error where it did not run,
    else by its weights beside its peers' (:func:`judged_alone`)."""
    if cell.skip_reason:
        return Verdict.SKIPPED, cell.skip_reason, None
    if outcome is None or outcome.status != "done":
        return Verdict.ERROR, "did not run" if outcome is None else outcome.reason, None
    return (*judged_alone(cell, own, peers), None)


def judged_alone(cell: Cell, own: Weighting | None, peers: list[tuple[Cell, Weighting | None]]) -> tuple[Verdict, str]:
    """A split with no reference, beside the other splits of its script and arguments (`peers`): `diverge` where its
    weights are tied to its split or differ from theirs; `match` where they are the same, or — alone — of the step's
    rows alone; `unjudged` where nothing could be read or decide. Weights read coarsely (a loss in bf16) are compared
    within their resolution, which the reason gives: the size of a mistake that would not be seen."""
    if not _readable(own):
        why = own.line.removeprefix("not read: ") if own is not None else "its probe wrote nothing"
        return Verdict.UNJUDGED, (
            f"no reference, and its targets' weights were not read ({why}): nothing judges it — give it a reference "
            "(`--baseline`, `baseline:`)"
        )
    if own.kind == Kind.SPLIT:
        return Verdict.DIVERGE, f"{ALONE}: {own.line}"
    judged = [(peer, weights) for peer, weights in peers if _readable(weights)]
    found = {peer.id: compare(own, weights) for peer, weights in judged if weights.kind != Kind.SPLIT}
    same = [i for i, d in found.items() if d is None]
    differ = {i: d for i, d in found.items() if isinstance(d, Difference)}
    if not differ and same:
        return Verdict.MATCH, (
            f"{ALONE}: the same weights as {_ids(same)}, step by step{_within(own, judged)}: {own.line}"
        )
    if differ:
        whole = [c for c, w in [(cell, own), *judged] if _whole_batch(c) and w.kind != Kind.SPLIT]
        if whole and (whole[0].id == cell.id or whole[0].id in same):
            held = (
                "it holds the whole batch in one micro-batch"
                if whole[0].id == cell.id
                else f"the same weights as {_ids([whole[0].id])} (the whole batch in one micro-batch)"
            )
            return Verdict.MATCH, f"{ALONE}: {held}; {_ids(differ)} differ: {own.line}"
        by = whole[0].id if whole and whole[0].id in differ else next(iter(differ))
        theirs = next(w for c, w in judged if c.id == by)
        return Verdict.DIVERGE, (
            f"{ALONE}: its weights differ from {by}'s {differ[by].words()} — the split changes the optimisation: "
            f"{own.line} — {by}'s: {theirs.brief}"
        )
    if own.kind == Kind.STEP:
        return Verdict.MATCH, f"{ALONE}: {own.line}"
    return Verdict.UNJUDGED, (
        f"no reference, and no other split to set its weights beside: {own.line} — a second split decides "
        "(`--split`), or a reference (`--baseline auto`)"
    )


def _readable(weights: Weighting | None) -> bool:
    """Read: finely, or coarsely with each step kept (compared within its resolution)."""
    return weights is not None and (
        weights.kind != Kind.UNREAD or (weights.shape == Shape.UNRESOLVED and weights.steps)
    )


def _within(own: Weighting, judged: list) -> str:
    """Where any of the weights compared were read coarsely: the size of a weighting mistake that would not show
    (the two reads' resolutions summed, as gaeq.objective.invariance compares them)."""
    coarse = [w.resolution or 0.0 for w in [own, *(w for _, w in judged)] if w.shape == Shape.UNRESOLVED]
    if not coarse:
        return ""
    return f" within ±{2 * max(coarse):.0%} of a weight (read coarsely: a mistake that moves a weight less is not seen)"


def _whole_batch(cell: Cell) -> bool:
    return cell.divisible and cell.data_parallel == 1 and cell.grad_accum_steps == 1


def _ids(ids) -> str:
    return ", ".join(ids)
