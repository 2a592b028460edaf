"""The noise floor and the detection limit: what rounding alone does to this problem, and the smallest
error the run would have caught — both measured in this run, on the baseline's own split.

Each group's twins (``Role.FLOOR``) train the baseline's very split, their grad norms summed as users
sum them (float32, against the baseline's float64), every gradient nudged by a unit in the last place
before each step with signs of their own (gaeq.perturb). Nothing but rounding separates a twin from
the baseline, and no accumulation code runs in it: a split under test can never set the tolerance it
is judged by. How far the twins drift depends on the problem: ~1e-7 on a 3 k-parameter MLP, ~1e-3 on a
21 M-parameter one with clipping active. A cell may differ from the baseline by FACTOR times the
floor at that step — the twins' largest distance up to it (rounding differences grow through the
updates, and so does the floor) —, never by less than the dtype's constant tolerance, and never by more
than CEILING times that constant: twins that drift further are not measuring rounding, and the group is
judged by the constants alone.

The detection limit (``Role.SENSITIVITY``: the baseline's split with each batch's rows reweighed 1 ± δ,
the batch's total weight unchanged — the shape of the mistakes users make) is δ × the smallest ratio, over
steps and metrics, of the tolerance to how far that moved the cell — the error that would have used its
whole tolerance, for an effect proportional to δ; and the same, step by step. The effect is the same in
every split, but a split already stands some way from the baseline, and that way may run against the error:
the printed limit is the worst judged split's, its distance added to the tolerance.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gaeq.results.trace import StepRecord

FACTOR = 10.0
"""How many times the twins' distance from the baseline a cell may drift (measured on the scale
ladder, experiments/scale.yaml: correct splits stay within a few times their twins')."""
CEILING = 1000.0
"""The floor widens a constant tolerance by at most this factor: a twin that drifts further is not
measuring rounding (it is rejected, and its group judged by the constants). Set from the ladder's largest
twin and weakest planted control (docs/verdicts.md, the noise floor)."""


SAID_APART = 1.1
"""A split's limit is the printed one where it exceeds the baseline's split's by more than this factor (10 %: a
difference the printed limit, to two digits, shows)."""

ORDER_UNITS = 64.0
"""A batch run again in another order, or with other random draws, may differ from itself by rounding — a
few units in the last place of its arithmetic where sums over rows run in another order —; by more than
this many units (relative to each element's size plus its tensor's typical size) the output depends on
something else: the order of its rows, or the draws (gaeq.rows.OrderCheck measures both)."""


RANDOM_DRAWS = "random draws"
"""How a cause that is the draws begins (a dropout the report names on its own is one)."""


def order_causes(found: Mapping | None) -> list[str]:
    """What a twin's order check (gaeq.rows.OrderCheck's `found`) says moves the model's output besides
    rounding, in words ([]: nothing, or not checked). Random draws first: with them, a reordered batch
    draws other masks for its rows, so its order cannot be told apart."""
    if not found or "not_checked" in found:
        return []
    if (draws := found.get("random_draws") or 0.0) > ORDER_UNITS:
        return [
            f"{RANDOM_DRAWS} (the same rows with other RNG state moved its output by {draws:.3g} units of rounding)"
        ]
    if (order := found.get("row_order") or 0.0) > ORDER_UNITS:
        return [f"the order of its rows (the same batch reversed moved its output by {order:.3g} units of rounding)"]
    return []


@dataclass(frozen=True, kw_only=True)
class NoiseFloor:
    """The twins' largest distance from the baseline, as a running maximum over steps."""

    twins: tuple[str, ...]
    steps: tuple[int, ...]
    loss: tuple[float, ...]
    """max |Δloss| over the twins, up to each step."""
    grad_norm: tuple[float, ...]
    """max |Δ grad norm| / baseline grad norm over the twins, up to each step."""
    per_twin: tuple[float, ...] = ()
    """Each twin's largest |Δloss|: twins that disagree by far say rounding comes in rare large steps here."""
    causes: tuple[str, ...] = ()
    """What besides rounding moves the twins, as their order check saw it (gaeq.rows.OrderCheck): the
    order of the model's rows, random draws. Empty: rounding alone; else the floor sets no tolerance."""

    @classmethod
    def measure(cls, base: Sequence[StepRecord], twins: Mapping[str, Sequence[StepRecord]]) -> NoiseFloor:
        """Raises ValueError when a twin's trace does not cover the baseline's steps."""
        loss, grad, per_twin = [0.0] * len(base), [0.0] * len(base), []
        for twin, other in twins.items():
            if [r.step for r in other] != [r.step for r in base]:
                raise ValueError(f"the noise-floor twin {twin} has {len(other)} steps, the baseline {len(base)}")
            for i, (b, o) in enumerate(zip(base, other)):
                loss[i] = nanmax(loss[i], abs(o.loss - b.loss))
                if not (b.skipped or o.skipped):
                    grad[i] = nanmax(grad[i], rel_diff(o.grad_norm, b.grad_norm))
            per_twin.append(max((abs(o.loss - b.loss) for b, o in zip(base, other)), default=0.0))
        return cls(
            per_twin=tuple(per_twin),
            twins=tuple(twins),
            steps=tuple(r.step for r in base),
            loss=tuple(itertools.accumulate(loss, nanmax)),
            grad_norm=tuple(itertools.accumulate(grad, nanmax)),
        )

    def at(self, step: int) -> tuple[float, float]:
        """(loss, grad norm) floor at `step`: the last measured one at or before it."""
        i = max((i for i, s in enumerate(self.steps) if s <= step), default=0)
        return self.loss[i], self.grad_norm[i]

    def beyond_rounding(self, base: Sequence[StepRecord], tol) -> str | None:
        """Why this drift is not rounding — beyond CEILING × the constant tolerance at some step (the
        problem changes from run to run: dropout drawn from an unseeded RNG, say) — or None."""
        for record, loss, grad in zip(base, self.loss, self.grad_norm):
            if loss > CEILING * tol.loss_tol(record.loss) or grad > CEILING * tol.grad_norm_rtol:
                return (
                    f"its twins {', '.join(self.twins)} drifted beyond what rounding explains by step {record.step} "
                    f"(|Δloss| {loss:.1e}, rel Δ‖g‖ {grad:.1e}): judged by the constants alone"
                )
        return None

    def not_rounding(self) -> str | None:
        """Why this floor is not rounding's, where the twins' order check saw another cause (None: it saw
        none). Such a floor sets no tolerance: a drift of that cause is what a split may really change."""
        if not self.causes:
            return None
        return (
            f"its twins {', '.join(self.twins)} drifted max |Δloss| {self.loss[-1]:.1e}, rel Δ‖g‖ "
            f"{self.grad_norm[-1]:.1e}, and not by rounding: the model's output depends on "
            f"{' and on '.join(self.causes)} — a floor of that would hide what a split changes: judged by the "
            "constants alone"
        )

    def disagreement(self, tol, base: Sequence[StepRecord]) -> str | None:
        """A warning when the twins disagree by more than FACTOR where it matters (their largest drift above
        the constant): rounding that comes in rare large steps — a bf16 or fp16 stage, as torch's Muon's
        Newton–Schulz — which a few twins may miss at some step; more twins make the floor sure."""
        constant = min((tol.loss_tol(r.loss) for r in base), default=0.0)
        low, high = min(self.per_twin, default=0.0), max(self.per_twin, default=0.0)
        if len(self.per_twin) < 2 or high <= constant or high <= FACTOR * low:
            return None
        return (
            f"its twins disagree (max |Δloss| {low:.1e} to {high:.1e}): rounding here comes in rare large steps "
            f"(a bf16 or fp16 stage?) — raise floor_twins (now {len(self.twins)}) for a floor that hangs on no luck"
        )

    def summary(self) -> dict:
        return {
            "twins": list(self.twins),
            "per_twin_max_abs_loss_diff": list(self.per_twin),
            "max_abs_loss_diff": self.loss[-1] if self.loss else 0.0,
            "max_rel_grad_norm_diff": self.grad_norm[-1] if self.grad_norm else 0.0,
            "factor": FACTOR,
            "ceiling": CEILING,
            "causes": list(self.causes),
        }


@dataclass(frozen=True, kw_only=True)
class DetectionLimit:
    """The smallest error of the planted kind — rows reweighed 1 ± δ, the batch's total weight unchanged
    (gaeq.perturb.row_weights) — the run would have caught: per step, `delta` × the smallest ratio of the
    step's tolerance to the planted error's effect there; `limit`, the smallest over steps (an error made
    at every step is caught at the step where it shows most: `metric` at `step`)."""

    cell: str
    """The cell that carried the planted error."""
    delta: float
    """The error planted: the step's even rows × (1 + delta), its odd rows × (1 − delta) (zero-sum)."""
    limit: float
    metric: str
    step: int
    effect: float
    """How far the planted error moved `metric` at `step` (|Δloss|, or rel Δ‖g‖)."""
    allowed: float
    """The tolerance at that step."""
    above_rounding: bool
    """Whether the effect stood at least 10 × above the noise floor there (otherwise the limit is a bound
    from below: rounding made part of what was measured)."""
    per_step: tuple[float, ...] = ()
    """The limit at each step, for the error made at every step up to it (inf: it moved nothing there)."""
    steps: tuple[int, ...] = ()
    split: str | None = None
    """The judged split the limit is that of, where it is a split's (the worst): the planted error's effect
    must also outgrow that split's own distance from the baseline, which may run the other way."""
    at_baseline: float | None = None
    """The limit on the baseline's split alone, where a split's is larger."""

    @classmethod
    def measure(
        cls,
        cell: str,
        *,
        delta: float,
        base: Sequence[StepRecord],
        planted: Sequence[StepRecord],
        tolerances: Callable[[StepRecord], tuple[Allowed, Allowed]],
        floor: NoiseFloor | None,
        splits: Mapping[str, Sequence[StepRecord]] | None = None,
    ) -> DetectionLimit | None:
        """None when the planted error moved nothing (a problem whose metrics ignore the batch's weights).
        `splits`: the judged splits' traces — the limit is then the worst split's, where the effect of δ,
        the same in every split, must exceed the tolerance plus that split's own distance from the baseline
        (a triangle bound: that distance may cancel part of the effect)."""
        if [r.step for r in planted] != [r.step for r in base]:
            raise ValueError(f"the detection-limit cell {cell} has {len(planted)} steps, the baseline {len(base)}")
        found = _scan(delta, base, planted, None, tolerances, floor)
        if found is None:
            return None
        at_baseline, worst, split = found, found, None
        scanned = {
            name: there
            for name, trace in sorted((splits or {}).items())  # in id order: the same split named in every run
            if [r.step for r in trace] == [r.step for r in base]
            and (there := _scan(delta, base, planted, trace, tolerances, floor)) is not None
        }
        if scanned:  # the largest limit of any split, named where it is more than SAID_APART above the baseline's
            name = max(scanned, key=lambda n: scanned[n][0]["limit"])
            if scanned[name][0]["limit"] > found[0]["limit"] * SAID_APART:
                worst, split = scanned[name], name
        best, per_step = worst
        return cls(
            cell=cell, delta=delta, per_step=tuple(per_step), steps=tuple(r.step for r in base), split=split,
            at_baseline=at_baseline[0]["limit"] if split else None, **best,
        )  # fmt: skip

    @property
    def first_caught(self) -> int | None:
        """The first step where the planted δ itself was caught (the table's `caught` for its cell)."""
        return next((s for s, v in zip(self.steps, self.per_step) if v <= self.delta), None)

    @property
    def weakest(self) -> tuple[int, float] | None:
        """(step, limit) of the step where the error shows least — where a mistake made up to that step
        must be largest to be caught there — among steps it moved at all."""
        finite = [(s, v) for s, v in zip(self.steps, self.per_step) if math.isfinite(v)]
        return max(finite, key=lambda sv: sv[1]) if finite else None

    def describe(self) -> str:
        bound = "" if self.above_rounding else " at least (the effect was within 10 × the noise floor)"
        weakest = self.weakest
        if self.limit >= 1:  # a row weighed 1 − δ ≤ 0: no reweighing of that size is a mistake anyone makes
            return (
                f"detects no reweighing of rows 1 ± δ with δ < 1 — measured on {self.cell}: δ = {self.delta:g} moved "
                f"{self.metric} at step {self.step} by {self.effect:.1e}, tol {self.allowed:.1e}: only errors that "
                "change the loss by more than that are caught"
            )
        per_step = (
            (
                f"; the smallest δ one step alone catches ranges from {self.limit:.1e} to {weakest[1]:.1e} (step "
                f"{weakest[0]})"
                if weakest[1] < 1
                else f"; at step {weakest[0]} alone, no δ below 1 is caught"
            )
            if weakest is not None and weakest[1] > 1.5 * self.limit
            else ""
        )
        split = (
            f" — in {self.split}, the worst split: the error must outgrow its own distance from the baseline "
            f"(on the baseline's split alone, δ ≥ {self.at_baseline:.1e})"
            if self.split
            else ""
        )
        first = self.first_caught
        caught = (
            f" (the step that shows it most; first caught at step {first})" if first not in (None, self.step) else ""
        )
        return (
            f"detects rows reweighed 1 ± δ (the batch's total weight unchanged) for δ ≥ {self.limit:.1e}{bound}{split}"
            f" — measured on {self.cell}: δ = {self.delta:g} moved {self.metric} at step {self.step}{caught} by "
            f"{self.effect:.1e}, {'tol + its distance' if self.split else 'tol'} {self.allowed:.1e}{per_step}"
        )

    def summary(self) -> dict:
        return dataclasses.asdict(self) | {
            "per_step": [v if math.isfinite(v) else None for v in self.per_step],
            "weakest": list(self.weakest) if self.weakest else None,
        }


def _scan(delta, base, planted, split, tolerances, floor) -> tuple[dict, list[float]] | None:
    """The smallest δ caught over steps and metrics, and per step: the planted error's effect (planted − base)
    against the tolerance — plus, for a `split`, that split's own distance from the baseline and its losses'
    resolution in place of the planted cell's."""
    best, per_step = None, []
    for i, (b, p) in enumerate(zip(base, planted)):
        o = p if split is None else split[i]
        loss_tol, grad_tol = tolerances(b)
        loss_floor, grad_floor = floor.at(b.step) if floor is not None else (0.0, 0.0)
        # a loss recorded in bf16/fp16 is known to its resolution, which a split's comparison adds to its
        # tolerance (compare.compare_traces): the limit allows it too — the judged run's
        loss_apart = 0.0 if split is None else abs(o.loss - b.loss)
        effects = [("loss", abs(p.loss - b.loss), loss_tol.value + b.loss_resolution + o.loss_resolution + loss_apart,
                    loss_floor)]  # fmt: skip
        if not (b.skipped or p.skipped or o.skipped):
            grad_apart = 0.0 if split is None else rel_diff(o.grad_norm, b.grad_norm)
            effects.append(("grad_norm", rel_diff(p.grad_norm, b.grad_norm), grad_tol.value + grad_apart, grad_floor))
        here = math.inf
        for metric, effect, allowed, noise in effects:
            if not effect > 0 or math.isnan(effect) or math.isnan(allowed):
                continue
            limit = delta * allowed / effect
            here = min(here, limit)
            if best is None or limit < best["limit"]:
                best = dict(
                    limit=limit, metric=metric, step=b.step, effect=effect, allowed=allowed,
                    above_rounding=effect >= 10 * noise,
                )  # fmt: skip
        per_step.append(here)
    return None if best is None else (best, per_step)


@dataclass(frozen=True, kw_only=True)
class Allowed:
    """The tolerance at one step, and whether the noise floor set it (rather than the constant)."""

    value: float
    by_floor: bool
    resolution: float = 0.0
    """Of `value`: the recorded losses' own resolution (values handed to backward in bf16 or fp16)."""

    def describe(self) -> str:
        said = [f"{FACTOR:g} × the noise floor"] if self.by_floor else []
        said += [f"with {self.resolution:.1e} of the losses' own bf16/fp16 resolution"] if self.resolution else []
        return f"tol {self.value:.1e}" + (f" ({', '.join(said)})" if said else "")


def envelope(constant: float, floor: float | None) -> Allowed:
    """max(constant, FACTOR × floor), capped at CEILING × constant; the constant without a floor."""
    if floor is None or math.isnan(floor):
        return Allowed(value=constant, by_floor=False)
    widened = min(FACTOR * floor, CEILING * constant)
    return Allowed(value=widened, by_floor=True) if widened > constant else Allowed(value=constant, by_floor=False)


def rel_diff(value: float, base: float) -> float:
    """|value − base| / |base| (nan if either is)."""
    if math.isnan(value) or math.isnan(base):
        return math.nan
    return abs(value - base) / max(abs(base), 1e-30)


def nanmax(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
