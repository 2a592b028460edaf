"""Whether two runs gave their targets the same weights, step by step: what a split changes, if anything.

The same rows are matched by key in each step (gaeq.script.samples: a row's samples, whatever rank or micro-batch
held it). Each row's target count and its weights' sum, least and largest, as shares of the step's weights, are
compared within the sum of the two reads' resolutions: the weights' shape. So is the step's total, the weights'
scale — where neither run changed its gradients in place after the last backward: a rescale written by hand
(Megatron-LM's ÷ the step's tokens) and a clip written by hand look alike there, and a clip's factor carries the
drift of the norm it divides by, which the numbers judge. Rows one run holds and the other does not (packed or
laid out another way) are not compared."""

from __future__ import annotations

from dataclasses import dataclass

from gaeq.objective.shapes import FIXES, ROUNDING, Shape, StepWeights, alike
from gaeq.objective.shapes import times as times_words
from gaeq.objective.weighting import Weighting


@dataclass(frozen=True)
class Difference:
    """Where two runs' weights part: the first step beyond their resolutions, by how much, and in what."""

    step: int
    by: float
    """The largest relative difference at that step: of a row's share of the weights, or of their total."""
    tol: float
    scale: bool = False
    """The total differs, the shares agree: every target × another factor."""
    window: str | None = None
    """What the first run's weights are the second's times, where that names a window: a factor per micro-batch or
    per rank (a normaliser counted over it), or one factor for the step (÷ GA once more)."""
    fix: str | None = None

    def words(self) -> str:
        what = "in their total (every target × another factor)" if self.scale else "of a weight"
        said = f"by {self.by:.1e} {what} at step {self.step} (the two read to ±{self.tol:.0e} of a weight)"
        return said + (f": {self.window} — {self.fix}" if self.window else "")


def compare(a: Weighting, b: Weighting) -> Difference | str | None:
    """The first step where `a`'s and `b`'s weights differ (None: the same in every step both read); a str: why
    they cannot be compared."""
    if not a.steps or not b.steps:  # (weights read coarsely are compared within their resolution)
        return "the weights of one of them were not read"
    theirs = {s.step: s for s in b.steps}
    compared = 0
    for mine in a.steps:
        other = theirs.get(mine.step)
        if other is None:
            continue
        tol = mine.resolution + other.resolution + 2 * ROUNDING * 2.0**-23
        rows_a, rows_b = _by_key(mine), _by_key(other)
        common = [k for k in rows_a.keys() & rows_b.keys() if rows_a[k][0] == rows_b[k][0]]  # (other targets: data)
        if not common:
            continue
        compared += len(common)
        size_a, size_b = (sum(abs(rows[k][1]) for k in common) for rows in (rows_a, rows_b))
        shares = max(_apart(x / size_a, y / size_b) for k in common for x, y in zip(rows_a[k][1:], rows_b[k][1:]))
        if shares > tol:
            return Difference(step=mine.step, by=shares, tol=tol, **_window(mine, rows_a, rows_b, common, tol))
        untouched = abs(mine.factor - 1) <= tol and abs(other.factor - 1) <= tol
        if untouched and (apart := _apart(size_a, size_b)) > tol:
            return Difference(
                step=mine.step, by=apart, tol=tol, scale=True, **_window(mine, rows_a, rows_b, common, tol)
            )
    return None if compared else "no row is in both (rows packed or laid out otherwise)"


def _window(mine: StepWeights, rows_a: dict, rows_b: dict, common: list, tol: float) -> dict:
    """Each common row's weight in `mine` over its weight in the other run: one ratio for the step, one per
    micro-batch or one per rank of `mine` names the window its normaliser was counted over, with the fix —
    of any weights, a policy gradient's signed ones too."""
    ratio = {k: rows_a[k][1] / rows_b[k][1] for k in common if rows_b[k][1] != 0 and rows_a[k][1] != 0}
    if not ratio:
        return {}
    place = {r.key: (r.rank, r.forward) for r in mine.rows if r.key in ratio}
    if alike(list(ratio.values()), 2 * tol):
        times = next(iter(ratio.values()))
        ga = mine.micro_steps
        if ga > 1 and abs(times * ga - 1) <= 2 * tol:
            return {"window": f"every target ÷ GA ({ga}) once more", "fix": FIXES[Shape.SCALED]}
        return {"window": f"every target {times_words(times)}", "fix": FIXES[Shape.SCALED]}
    for by, shape, key in (("rank", Shape.RANK_MEANS, lambda k: place[k][0]), ("micro-batch",
                           Shape.MICRO_BATCH_MEANS, lambda k: place[k])):  # fmt: skip
        groups: dict = {}
        for k, value in ratio.items():
            groups.setdefault(key(k), []).append(value)
        if len(groups) > 1 and all(alike(g, 2 * tol) for g in groups.values()):
            low, high = min(min(g) for g in groups.values()), max(max(g) for g in groups.values())
            return {
                "window": f"one factor per {by} ({times_words(low)} to {times_words(high)}): its normaliser counted "
                f"over each {by}",
                "fix": FIXES[shape],
            }
    return {}


def _by_key(s: StepWeights) -> dict[str, list[float]]:
    """Each keyed row's count, summed, least and largest weight (a sample twice in a step: summed)."""
    rows: dict[str, list[float]] = {}
    for r in s.rows:
        if r.key is None:
            continue
        n, total, low, high = rows.get(r.key, (0, 0.0, r.low, r.high))
        rows[r.key] = [n + r.n, total + r.total, min(low, r.low), max(high, r.high)]
    return rows


def _apart(x: float, y: float) -> float:
    size = max(abs(x), abs(y))
    return 0.0 if size == 0 else abs(x - y) / size
