"""What the weights every target got (gaeq.script.targets) say a script optimises, step by step — in words, and
matched against the weighting mistakes of the pitfall catalogue (docs/pitfalls.md), with their fix.

A target's weight in the update is its rank's weight ÷ the world size (DDP, FSDP and DeepSpeed average the
ranks' gradients, as the probe's objective assumes). A step whose targets all weigh 1/N and sum to 1 takes the
step's target mean. Otherwise the shape is named where the weights show it:

- one weight per micro-batch, each inversely to its target count: a mean of micro-batch means;
- one weight per rank, each inversely to the rank's count: a mean of rank means;
- one weight per row (a sequence, or a pack), each inversely to its targets: a mean of per-row means;
- every target alike, summing to k ≠ 1: the loss × k (× GA where k is GA);
- otherwise: how far apart, and that no known shape fits.

A shape is matched to `tol`: `UNITS` units in the last place of the gradient's dtype, summed over the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from gaeq.names import Name


class Shape(Name):
    """What a run's weights are, in report.json's words."""

    MEAN = "mean"
    """Every target weighs 1/N, summing to 1: the step's target mean."""
    MICRO_BATCH_MEANS = "micro_batch_means"
    RANK_MEANS = "rank_means"
    SEQUENCE_MEANS = "sequence_means"
    """One weight per row (a sequence or a pack), inversely to its targets."""
    SCALED = "scaled"
    """Every target alike, summing to k ≠ 1."""
    UNEVEN = "uneven"
    """Apart in no shape gaeq knows."""
    UNREAD = "unread"


UNITS = 64
"""Units in the last place of the gradients' dtype that weights may differ by and still be the same weight."""


@dataclass(frozen=True, kw_only=True)
class Weighting:
    """What a run's weights say, over its steps."""

    shape: Shape
    line: str
    """In words, with the numbers: what `Weights:` prints."""
    step: int | None = None
    """The first step where it is not the step's target mean (None: every step is, or nothing was read)."""
    fix: str | None = None

    @property
    def is_mean(self) -> bool:
        return self.shape == Shape.MEAN

    def summary(self) -> dict:
        return {"shape": self.shape, "line": self.line, "step": self.step, "fix": self.fix}


FIXES = {
    Shape.MICRO_BATCH_MEANS: "divide each micro-batch's summed loss by the step's target count (`num_items_in_batch`), "
    "not by its own",
    Shape.RANK_MEANS: "count the step's targets over every rank (an all-reduce; the Trainer's "
    "`average_tokens_across_devices`) before dividing",
    Shape.SCALED: "divide the step's summed loss by the step's target count once (÷ GA where each micro-batch's "
    "mean is summed)",
}


def weighting(steps: list[dict], *, unread: str | None = None) -> Weighting:
    """The weighting of a probe's steps (each with its ranks' `targets`), the first step that is not a mean
    deciding; `unread`: why no weight could be read."""
    read = [s for s in steps if any(row[0] for ranks in s.get("targets") or [] for f in ranks for row in f["rows"])]
    if not read:
        return Weighting(shape=Shape.UNREAD, line=f"not read: {unread or 'the probe read no target weights'}")
    stats = [_stats(s) for s in read]
    for s, st in zip(read, stats):
        found = _step(s, st)
        if not found.is_mean:
            return found
    spread = max(st["spread"] for st in stats)
    return Weighting(
        shape=Shape.MEAN,
        line=f"every target weighs 1/N{f' ± {spread:.0e}' if spread else ''} (N = {stats[0]['n']} at step "
        f"{read[0]['step']}): the step's target mean, in every step read",
    )


def _stats(step: dict) -> dict:
    world = step["world_size"]
    forwards = [(r, k, f) for r, ranks in enumerate(step["targets"]) for k, f in enumerate(ranks)]
    rows = [(r, k, row) for r, k, f in forwards for row in f["rows"] if row[0]]
    n = sum(row[0] for _, _, row in rows)
    total = sum(row[1] for _, _, row in rows) / world
    low = min(row[2] for _, _, row in rows) / world
    high = max(row[3] for _, _, row in rows) / world
    eps = max(f.get("eps", 2.0**-23) for _, _, f in forwards)
    return {"n": n, "sum": total, "low": low, "high": high, "spread": high / low - 1, "tol": UNITS * eps,
            "forwards": forwards, "rows": rows, "world": world}  # fmt: skip


def _step(step: dict, st: dict) -> Weighting:
    """The step's weighting, from its `_stats`."""
    at, tol = step["step"], st["tol"]
    if st["spread"] <= tol:
        if abs(st["sum"] - 1) <= tol:
            return Weighting(shape=Shape.MEAN, line="", step=None)
        ga = max((len(ranks) for ranks in step["targets"]), default=1)
        times = f" — × GA ({ga})" if abs(st["sum"] - ga) <= tol * ga else ""
        times = f" — ÷ GA ({ga}) twice" if ga > 1 and abs(st["sum"] * ga - 1) <= tol else times
        both = ga * st["world"]
        times = f" — × GA × world ({both})" if st["world"] > 1 and abs(st["sum"] - both) <= tol * both else times
        fix = FIXES[Shape.SCALED]
        return Weighting(
            shape=Shape.SCALED,
            line=f"every target weighs alike but they sum to {st['sum']:.4g} at step {at}, not 1: the loss × "
            f"{st['sum']:.4g}{times} — {fix}",
            step=at,
            fix=fix,
        )
    for shape, groups in (
        (Shape.RANK_MEANS, _groups(st, lambda r, k, i: r)),
        (Shape.MICRO_BATCH_MEANS, _groups(st, lambda r, k, i: (r, k))),
        (Shape.SEQUENCE_MEANS, _groups(st, lambda r, k, i: (r, k, i))),
    ):
        if (said := _each_alike(groups, tol)) is not None:
            weights, counts = said
            if len(set(weights)) > 1 and _alike([w * c for w, c in zip(weights, counts)], tol):
                return _named(shape, st, weights, counts, at)
    return Weighting(
        shape=Shape.UNEVEN,
        line=f"targets weigh from {st['low']:.3g} to {st['high']:.3g} at step {at} (× {st['high'] / st['low']:.3g}), "
        "in no shape gaeq knows (not by micro-batch, rank or sequence)",
        step=at,
    )


def _groups(st: dict, key) -> dict:
    groups: dict = {}
    for r, k, f in st["forwards"]:
        for i, row in enumerate(f["rows"]):
            if row[0]:
                groups.setdefault(key(r, k, i), []).append(row)
    return groups


def _each_alike(groups: dict, tol: float) -> tuple[list[float], list[int]] | None:
    """Where every group's targets share one weight: (each group's weight, its target count)."""
    weights, counts = [], []
    for rows in groups.values():
        low, high = min(r[2] for r in rows), max(r[3] for r in rows)
        if high / low - 1 > tol:
            return None
        weights.append(high)
        counts.append(sum(r[0] for r in rows))
    return weights, counts


def _alike(values: list[float], tol: float) -> bool:
    return max(values) / min(values) - 1 <= tol * 4


def _named(shape: Shape, st: dict, weights: list[float], counts: list[int], step: int) -> Weighting:
    world = st["world"]
    low, high = min(weights) / world, max(weights) / world
    summed = f", summing to {st['sum']:.4g}, not 1" if abs(st["sum"] - 1) > st["tol"] else ""
    what = {
        Shape.MICRO_BATCH_MEANS: f"targets weigh 1/(GA · n_k) by micro-batch k ({low:.3g} to {high:.3g} at step "
        f"{step}, micro-batches of {min(counts)} to {max(counts)} targets): a mean of micro-batch means"
        if not summed
        else f"targets weigh 1/n_k by micro-batch k ({low:.3g} to {high:.3g} at step {step}, micro-batches of "
        f"{min(counts)} to {max(counts)} targets{summed}): each micro-batch's own mean, summed — not ÷ GA",
        Shape.RANK_MEANS: f"targets weigh by rank, 1/(world · n_r) ({low:.3g} to {high:.3g} at step {step}, ranks of "
        f"{min(counts)} to {max(counts)} targets): a mean of rank means",
        Shape.SEQUENCE_MEANS: f"targets weigh by row, inversely to its targets ({low:.3g} to {high:.3g} at step "
        f"{step}, rows of {min(counts)} to {max(counts)} targets): a mean of per-row means — every sequence (or "
        "pack) weighs alike (on purpose, if the reference weighs so too)",
    }[shape]
    fix = FIXES.get(shape)
    return Weighting(shape=shape, line=what + (f" — {fix}" if fix else ""), step=step, fix=fix)
