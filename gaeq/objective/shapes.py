"""The shape of one step's target weights (gaeq.objective.weighting reads them, gaeq.script.targets read them): each
row's weights in the update's units, matched to the shapes of docs/pitfalls.md's weighting mistakes and to the
correct styles, each said of the step's rows alone (`Kind.STEP`) or of the split (`Kind.SPLIT`, with its fix) —
to the resolution the weights were read at.

Shapes of the step's rows alone (`Kind.STEP`, the same in every split):
- every target 1/N: the step's target mean; every target alike, × one factor per step (a summed loss: one weight in
  every step);
- one weight per row, inversely to its targets, alike over the step's rows: a mean of per-row means.
Shapes tied to the split (`Kind.SPLIT`), each with its fix:
- one weight per micro-batch (or rank), inversely to its target count: a mean of micro-batch (rank) means;
- per-row means averaged within each micro-batch (or rank) of another number of rows;
- every target alike, the sum × GA, ÷ GA, × or ÷ the world size, a count from one micro-batch or one rank, or a
  step of fewer micro-batches still ÷ GA.
Weights of both signs (a policy gradient's) are `Shape.SIGNED`, of no shape one run tells (`Kind.UNKNOWN`): the
other splits decide (gaeq.objective.invariance names the window a split's normaliser took). Anything else is no shape
gaeq knows (`Kind.UNKNOWN`).
"""

from __future__ import annotations

from dataclasses import dataclass

from gaeq.names import Name

ROUNDING = 8
"""Units in the last place of a rescale's factor that ranks' or steps' factors may differ by and still be one."""


class Shape(Name):
    """What a run's weights are, in report.json's words."""

    MEAN = "mean"
    """Every target weighs 1/N, summing to 1: the step's target mean."""
    SCALED = "scaled"
    """Every target alike, summing to k ≠ 1."""
    SEQUENCE_MEANS = "sequence_means"
    """One weight per row (a sequence or a pack), inversely to its targets, alike over the step's rows."""
    ROW_MEANS_BY_GROUP = "row_means_by_group"
    """Per-row means averaged within each micro-batch (or rank): a row weighs by its group's row count."""
    MICRO_BATCH_MEANS = "micro_batch_means"
    RANK_MEANS = "rank_means"
    RANK_RESCALE = "rank_rescale"
    """The ranks multiplied their gradients by different factors after the last backward: a count from one rank."""
    SIGNED = "signed"
    """Weights of both signs (a policy gradient's −A log π, A an advantage): no shape of one run's rows alone — the
    other splits, or a reference, decide (gaeq.objective.invariance)."""
    UNEVEN = "uneven"
    """Apart in no shape gaeq knows."""
    UNRESOLVED = "unresolved"
    """Read too coarsely to name a shape (a bf16 or fp16 gradient)."""
    UNREAD = "unread"


class Kind(Name):
    """What a shape says of the split."""

    STEP = "step"
    """It depends on the step's rows alone: the same in every split."""
    SPLIT = "split"
    """It depends on the split: a mistake, with its fix."""
    UNKNOWN = "unknown"
    """No shape gaeq knows: another split, or a reference, decides."""
    UNREAD = "unread"


@dataclass(frozen=True)
class Row:
    """One row's targets in a step, in the update's units: ÷ world, × what the script multiplied the gradients by
    after the last backward and before any clip call."""

    key: str | None
    rank: int
    forward: int
    n: int
    total: float
    low: float
    high: float


@dataclass(frozen=True)
class StepWeights:
    step: int
    world: int
    micro_steps: int
    """Micro-batches per rank (its forwards)."""
    rows: tuple[Row, ...]
    resolution: float
    """Each weight's relative resolution: the coarsest of the step's forwards' reads."""
    factor: float
    """What the script multiplied the gradients by after the last backward, before any clip call (1: nothing): a
    rescale, or a clip written by hand."""
    read: str
    """Where: `float32 at the loss's cast`, `float32 gradients at the model's output`, …"""
    smoothing: float | None = None
    """The label smoothing ε the gradients were read with (None: none)."""
    factors: tuple[float, ...] = ()
    """Each rank's `factor` (the weights are rank 0's: what its optimizer receives)."""
    rescale_resolution: float = 0.0
    """How finely the factors were read (relative): half-precision gradients' rounding, where the script rescaled
    them (a model cast to bf16); part of `resolution`."""

    @property
    def n(self) -> int:
        return sum(r.n for r in self.rows)

    @property
    def total(self) -> float:
        return sum(r.total for r in self.rows)


BRIEF = {
    Shape.MEAN: "the step's target mean",
    Shape.SCALED: "every target alike, × a factor",
    Shape.SEQUENCE_MEANS: "a mean of per-row means",
    Shape.ROW_MEANS_BY_GROUP: "per-row means averaged by micro-batch or rank",
    Shape.MICRO_BATCH_MEANS: "a mean of micro-batch means",
    Shape.RANK_MEANS: "a mean of rank means",
    Shape.RANK_RESCALE: "a rescale that differs by rank",
    Shape.SIGNED: "signed weights (a policy gradient's)",
    Shape.UNEVEN: "no shape gaeq knows",
    Shape.UNRESOLVED: "not read finely enough",
    Shape.UNREAD: "not read",
}
FIXES = {
    Shape.MICRO_BATCH_MEANS: "divide each micro-batch's summed loss by the step's target count, not by its own",
    Shape.RANK_MEANS: "count the step's targets over every rank (an all-reduce) before dividing",
    Shape.ROW_MEANS_BY_GROUP: "sum each micro-batch's row means and divide by the step's row count over every rank, "
    "not each micro-batch's mean ÷ GA",
    Shape.SCALED: "divide the step's summed loss by the step's target count once (÷ GA where each micro-batch's "
    "mean is summed)",
    Shape.SEQUENCE_MEANS: "divide the step's summed row means by the step's row count over every rank, once",
    Shape.RANK_RESCALE: "count what the gradients are divided by over every rank (an all-reduce of the count) before "
    "rescaling them",
}
COUNT_FIX = "count the step's targets over all its micro-batches and ranks before dividing"


@dataclass(frozen=True)
class Found:
    """A step's shape in words, said of the step or of the split, with its fix."""

    shape: Shape
    kind: Kind
    words: str
    fix: str | None = None
    weight: float | None = None
    """Every target's weight, where they are alike."""


def alike(values: list[float], tol: float) -> bool:
    """Every value of one sign, within `tol` of each other (relatively)."""
    low, high = min(values), max(values)
    return low * high > 0 and max(high / low, low / high) - 1 <= tol


def classify(s: StepWeights, grad_accum: int | None) -> Found:
    tol = s.resolution
    if (apart := _rank_rescale(s)) is not None:
        return apart
    if alike([r.low for r in s.rows] + [r.high for r in s.rows], tol):
        return _scaled(s, s.rows[0].high, grad_accum)
    ranks, forwards = _grouped(s.rows, lambda r: r.rank), _grouped(s.rows, lambda r: (r.rank, r.forward))
    for shape, groups in ((Shape.RANK_MEANS, ranks), (Shape.MICRO_BATCH_MEANS, forwards)):
        if len(groups) > 1 and any(len(g) > 1 for g in groups.values()) and _group_means(groups, tol):
            return _group_shape(shape, s, groups, one_each=len(ranks) == len(forwards))
    if all(alike([r.low, r.high], tol) for r in s.rows) and len(s.rows) > 1:
        if alike([r.high * r.n for r in s.rows], tol * 4):
            return _row_means(s, grad_accum)
        for key in (lambda r: r.rank, lambda r: (r.rank, r.forward)):
            groups = _grouped(s.rows, key)
            if len(groups) > 1 and all(alike([r.high * r.n for r in g], tol * 4) for g in groups.values()):
                return _row_means_by_group(s, groups)
    low, high = min(r.low for r in s.rows), max(r.high for r in s.rows)
    if low < 0 < high:
        rows = sum(alike([r.low, r.high], tol) for r in s.rows if r.low * r.high > 0)
        within = (
            "one weight per row"
            if rows == len(s.rows)
            else f"one weight per row in {rows} of {len(s.rows)} rows, "
            "the others varying along the row (a term beside the advantage's, as a KL's per-token coefficient)"
        )
        return Found(
            Shape.SIGNED,
            Kind.UNKNOWN,
            f"targets weigh from {low:.3g} to {high:.3g} at step {s.step}, of both signs (a policy gradient's "
            f"advantages), {within}: one run's weights do not tell its normaliser — the other splits decide, row by "
            "row",
        )
    return Found(
        Shape.UNEVEN,
        Kind.UNKNOWN,
        f"targets weigh from {low:.3g} to {high:.3g} at step {s.step}, in no shape gaeq knows (not alike, nor by "
        "micro-batch, rank or row)",
    )


def _rank_rescale(s: StepWeights) -> Found | None:
    """The ranks multiplied their gradients by different factors after the last backward (a step's count taken on
    each rank from its own micro-batches): each rank's optimizer receives another update — tied to the split."""
    factors, tol = s.factors, max(ROUNDING * 2.0**-23, 2 * s.rescale_resolution)  # (bf16 gradients: ±0.8 % each)
    if len(factors) < 2 or max(factors) - min(factors) <= tol * max(map(abs, factors)):
        return None
    said = ", ".join(f"rank {r} {times(f)}" for r, f in enumerate(factors))
    return Found(
        Shape.RANK_RESCALE,
        Kind.SPLIT,
        f"the ranks multiplied their gradients by different factors after the last backward at step {s.step} "
        f"({said}): each rank's optimizer received another update — a count taken on each rank from its own "
        "micro-batches",
        FIXES[Shape.RANK_RESCALE],
    )


def times(factor: float) -> str:
    """A factor in words: `÷ 213` where it is one over a whole number, else `× 0.3`."""
    over = 1 / factor if factor else 0.0
    return f"÷ {round(over)}" if abs(factor) < 1 and abs(over - round(over)) <= 1e-6 * abs(over) else f"× {factor:.4g}"


def _grouped(rows, key) -> dict:
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return groups


def _group_means(groups: dict, tol: float) -> bool:
    """Every group's targets alike, each group's weight inversely to its target count (and not all alike)."""
    weights = []
    for rows in groups.values():
        if not alike([r.low for r in rows] + [r.high for r in rows], tol):
            return False
        weights.append((rows[0].high, sum(r.n for r in rows)))
    return not alike([w for w, _ in weights], tol) and alike([w * n for w, n in weights], tol * 4)


def _group_shape(shape: Shape, s: StepWeights, groups: dict, *, one_each: bool) -> Found:
    weights = [rows[0].high for rows in groups.values()]
    counts = [sum(r.n for r in rows) for rows in groups.values()]
    summed = abs(s.total - 1) > s.resolution
    low, high = min(weights), max(weights)
    if shape == Shape.RANK_MEANS:
        words = (
            f"targets weigh by rank, 1/(world · n_r) ({low:.3g} to {high:.3g} at step {s.step}, ranks of {min(counts)} "
            f"to {max(counts)} targets): a mean of rank means"
        )
        if one_each:  # GA 1: each rank's micro-batch its own, the two mistakes the same weights
            words += " (each rank one micro-batch: a mean of micro-batch means too)"
            return Found(shape, Kind.SPLIT, words, COUNT_FIX)
    elif not summed:
        words = (
            f"targets weigh 1/(GA · n_k) by micro-batch k ({low:.3g} to {high:.3g} at step {s.step}, micro-batches of "
            f"{min(counts)} to {max(counts)} targets): a mean of micro-batch means"
        )
    else:
        words = (
            f"targets weigh 1/n_k by micro-batch k ({low:.3g} to {high:.3g} at step {s.step}, micro-batches of "
            f"{min(counts)} to {max(counts)} targets, summing to {s.total:.4g}, not 1): each micro-batch's own mean, "
            "summed — not ÷ GA"
        )
    return Found(shape, Kind.SPLIT, words, FIXES[shape])


def _row_means(s: StepWeights, grad_accum: int | None) -> Found:
    """Each row alike, inversely to its targets, over the step's rows: a per-sequence objective — × GA and the
    like where its rows' weights sum to a quantity of the split."""
    counts = [r.n for r in s.rows]
    each = s.total / len(s.rows)
    if (tied := _tied_sum(s, s.total, grad_accum)) is not None:
        words, fix = tied[0], FIXES[Shape.SEQUENCE_MEANS]
        return Found(
            Shape.SEQUENCE_MEANS,
            Kind.SPLIT,
            f"each row weighs alike, its targets inversely to its count (rows of {min(counts)} to {max(counts)} "
            f"targets), but the rows sum to {s.total:.4g} at step {s.step}, not 1: per-row means{words}",
            fix,
        )
    times = "" if abs(s.total - 1) <= s.resolution else f" × {s.total:.4g}"
    return Found(
        Shape.SEQUENCE_MEANS,
        Kind.STEP,
        f"each row weighs alike ({each:.3g}), its targets inversely to its count (rows of {min(counts)} to "
        f"{max(counts)} targets): a mean of per-row means over the step's rows{times} — a per-sequence objective",
    )


def _row_means_by_group(s: StepWeights, groups: dict) -> Found:
    rows = [len(g) for g in groups.values()]
    by, many = ("micro-batch", "micro-batches") if len(groups) > len({r.rank for r in s.rows}) else ("rank", "ranks")
    weights = [g[0].high * g[0].n for g in groups.values()]
    return Found(
        Shape.ROW_MEANS_BY_GROUP,
        Kind.SPLIT,
        f"each row's targets weigh inversely to its count, but a row weighs by its {by} ({min(weights):.3g} to "
        f"{max(weights):.3g} at step {s.step}, {many} of {min(rows)} to {max(rows)} rows): per-row means averaged "
        f"within each {by} — a {by} of fewer rows weighs each more",
        FIXES[Shape.ROW_MEANS_BY_GROUP],
    )


def _scaled(s: StepWeights, weight: float, grad_accum: int | None) -> Found:
    """Every target alike: the step's mean, a summed loss, × a quantity of the split, or × a factor per step."""
    tol = s.resolution
    if abs(s.total - 1) <= tol:
        return Found(Shape.MEAN, Kind.STEP, "", weight=weight)
    if abs(weight - 1) <= tol:
        return Found(Shape.SCALED, Kind.STEP, "", weight=weight)
    if (tied := _tied_sum(s, s.total, grad_accum)) is not None or (tied := _tied_count(s, weight)) is not None:
        words, fix = tied
        return Found(
            Shape.SCALED,
            Kind.SPLIT,
            f"every target weighs alike but they sum to {s.total:.4g} at step {s.step}, not 1: the loss{words}",
            fix,
            weight,
        )
    return Found(Shape.SCALED, Kind.STEP, "", weight=weight)


def _tied_sum(s: StepWeights, total: float, grad_accum: int | None) -> tuple[str, str] | None:
    """Where a step's weights sum to a quantity of the split (× GA, ÷ world, …): its words (each quantity that fits,
    where several do) and fix."""
    ga, world, m = grad_accum or s.micro_steps, s.world, s.micro_steps
    candidates = []
    if ga > 1:
        candidates += [(ga, f"× GA ({ga})"), (1 / ga, f"÷ GA ({ga}) twice")]
    if world > 1:
        candidates += [(world, f"× world ({world})"), (1 / world, f"÷ world ({world}): the ranks' gradients averaged "
                       "once more")]  # fmt: skip
    if ga > 1 and world > 1:
        both = ga * world
        candidates += [(both, f"× GA × world ({both})"), (1 / both, f"÷ GA ÷ world ({both})")]
    if m != ga:
        candidates += [(m / ga, f"a step of {m} micro-batches still ÷ GA ({ga})")]
    fits = [words for value, words in candidates if abs(total - value) <= s.resolution * value]
    return (f" × {total:.4g} — {', or '.join(fits)}", FIXES[Shape.SCALED]) if fits else None


def _tied_count(s: StepWeights, weight: float) -> tuple[str, str] | None:
    """Where every target weighs 1 ÷ a count the step did not have: GA × one micro-step's targets (over the ranks, or
    on one rank × world), or world × one rank's."""
    tol, ga, world = s.resolution, s.micro_steps, s.world
    micro_steps: dict[int, int] = {}
    for r in s.rows:
        micro_steps[r.forward] = micro_steps.get(r.forward, 0) + r.n
    per_forward = _grouped(s.rows, lambda r: (r.rank, r.forward))
    per_rank = _grouped(s.rows, lambda r: r.rank)
    found = [(ga * n, f"micro-step {k}'s targets × GA ({ga})") for k, n in micro_steps.items() if ga > 1]
    found += [(ga * world * sum(r.n for r in g), f"rank {r}'s micro-batch {k}'s targets × GA × world")
              for (r, k), g in per_forward.items() if ga * world > 1]  # fmt: skip
    found += [(world * sum(r.n for r in g), f"rank {r}'s targets × world") for r, g in per_rank.items() if world > 1]
    for count, what in found:
        if abs(weight * count - 1) <= tol:
            return f" × {s.total:.4g}: every target ÷ {count}, {what} — a count from one part of the step", COUNT_FIX
    return None


def of_the_steps(read: list[StepWeights], said: list[Found]) -> Found:
    """Every step's shape of the step's rows: said once, for the run."""
    shapes = {f.shape for f in said}
    first = read[0]
    if shapes == {Shape.MEAN}:
        words = f"every target weighs 1/N (N = {first.n} at step {first.step}): the step's target mean"
        return Found(Shape.MEAN, Kind.STEP, f"{words}, in every step read")
    if Shape.SEQUENCE_MEANS in shapes:
        return next(f for f in said if f.shape == Shape.SEQUENCE_MEANS)
    weights = [f.weight for f in said]
    ones = all(w is not None and abs(w - 1) <= first.resolution for w in weights)
    if ones or (len(read) > 1 and None not in weights and alike(weights, max(s.resolution for s in read))):
        summed = "a summed loss" if ones else f"a summed loss × {weights[0]:.4g}"
        return Found(
            Shape.SCALED,
            Kind.STEP,
            f"every target weighs {weights[0]:.4g} in every step read: {summed} — its size is the learning rate's",
        )
    sums = [s.total for s in read]
    if len(read) == 1:
        summing = f"{sums[0]:.4g} at step {first.step}"
    else:
        summing = f"{min(sums):.4g} to {max(sums):.4g} over {len(read)} steps"
    return Found(
        Shape.SCALED,
        Kind.STEP,
        f"every target weighs alike, summing to {summing}: the step's target mean × a factor per step (the same in "
        "every split where it is the step's rows' alone)",
    )
