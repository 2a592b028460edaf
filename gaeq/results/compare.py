"""Step-by-step comparison of a cell's trace with its baseline, under a per-dtype tolerance ladder.

Two runs of the same optimisation differ only by float summation order (micro-batches summed in
another order, gradients reduced across ranks in another order). The fp32 ladder is set just above
what that produces on the default matrix (measured: max |Δloss| 7.5e-8 over 50 steps) and far
below what a real accumulation bug produces (≥ 1e-3 on the loss, or a grad norm off by a factor).
Those constants are floors: a larger model rounds more, and the noise floor measured in the run
(gaeq.results.floor) widens the loss and grad norm tolerances to what rounding does to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from gaeq.matrix.schema import METRICS
from gaeq.names import Name
from gaeq.results.floor import Allowed, NoiseFloor, envelope, nanmax, rel_diff
from gaeq.results.snapshots import KINDS as TENSOR_KINDS
from gaeq.results.snapshots import TensorComparison
from gaeq.results.trace import StepRecord


class Verdict(Name):
    """What a cell's comparison with its baseline says (a `str`: report.json keeps the words)."""

    MATCH = "match"
    DIVERGE = "diverge"
    ERROR = "error"
    """It did not run to the end, or its results cannot be read: nothing to compare."""
    SKIPPED = "skipped"
    """It cannot run here (its reason says why)."""
    UNJUDGED = "unjudged"
    """It ran to the end, but nothing could judge it: no reference, and its targets' weights were not read or no
    other split decides (its reason says which, and what would judge it)."""


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    loss_atol: float
    """|Δloss| allowed at every step, plus loss_rtol × |baseline loss|."""
    loss_rtol: float
    grad_norm_rtol: float
    """|Δ grad norm| / baseline grad norm allowed at every step."""
    tensor_atol: float
    tensor_rtol: float
    """A parameter or gradient tensor diverges when max|Δ| > tensor_atol + tensor_rtol · max|baseline|."""
    lr_rtol: float = 1e-12
    """The schedule is a pure function of the optimizer step: the lr must agree to rounding."""

    def loss_tol(self, base: float) -> float:
        return self.loss_atol + self.loss_rtol * abs(base)


DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    # Each set above what float summation order produced on this lab's runs and far below what an
    # accumulation bug produces: the measurements and the controls are docs/verdicts.md's table.
    "fp32": Tolerance(loss_atol=1e-6, loss_rtol=1e-6, grad_norm_rtol=1e-5, tensor_atol=1e-8, tensor_rtol=1e-5),
    # Autocast bf16 forward (fp32 weights): the micro-batch size changes which matmuls round to bf16.
    "bf16": Tolerance(loss_atol=1e-3, loss_rtol=1e-3, grad_norm_rtol=2e-2, tensor_atol=1e-5, tensor_rtol=1e-1),
    # DeepSpeed bf16 (bf16 weights, fp32 master weights and accumulation) against a GA-1 ds_bf16 baseline.
    "ds_bf16": Tolerance(loss_atol=1e-3, loss_rtol=1e-3, grad_norm_rtol=2e-2, tensor_atol=1e-5, tensor_rtol=1e-1),
    # Autocast fp16 forward (GradScaler on the torch side), measured with emulated fp16 kernels.
    "fp16": Tolerance(loss_atol=3e-4, loss_rtol=3e-4, grad_norm_rtol=5e-3, tensor_atol=1e-6, tensor_rtol=1e-2),
    # DeepSpeed fp16 (fp16 weights and accumulation, fp32 master weights, dynamic loss scale)
    # against a GA-1 ds_fp16 baseline.
    "ds_fp16": Tolerance(loss_atol=3e-4, loss_rtol=3e-4, grad_norm_rtol=5e-3, tensor_atol=1e-6, tensor_rtol=1e-2),
}


def tolerance_for(dtype: str, overrides: Mapping[str, float | None] | None = None) -> Tolerance:
    tol = DEFAULT_TOLERANCES[dtype]
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    return replace(tol, **given) if given else tol


@dataclass(frozen=True, kw_only=True)
class Comparison:
    verdict: Verdict
    """MATCH or DIVERGE."""
    max_abs_loss_diff: float
    max_rel_grad_norm_diff: float
    max_abs_grad_diff: float | None
    """Over every saved gradient tensor and step (None: gradients not tracked)."""
    max_abs_param_diff: float | None
    first_divergent_step: int | None
    caught_by: str | None
    """The metric that diverged first (METRICS order on a tie)."""
    divergence_steps: dict[str, int | None]
    """Each compared metric's first divergent step (None: it never diverged)."""
    reason: str
    margin: float = 0.0
    """The largest share of its tolerance a loss or grad norm difference used (≥ 1: diverged)."""
    not_checked: dict[str, str] = field(default_factory=dict)
    """Checks that were not made, and why (a script's data when its padding cannot be told from data)."""


@dataclass(frozen=True, kw_only=True)
class StepDiff:
    step: int
    abs_loss: float
    """|loss − baseline loss|"""
    rel_grad_norm: float
    """|grad norm − baseline grad norm| / baseline grad norm"""


def step_diffs(base: Sequence[StepRecord], other: Sequence[StepRecord]) -> list[StepDiff]:
    """Differences at each of `other`'s steps. Raises ValueError for a step the baseline lacks."""
    by_step = {r.step: r for r in base}
    missing = [r.step for r in other if r.step not in by_step]
    if missing:
        raise ValueError(f"steps {missing[:3]} are not in the baseline's trace")
    return [
        StepDiff(step=o.step, abs_loss=abs(o.loss - b.loss), rel_grad_norm=rel_diff(o.grad_norm, b.grad_norm))
        for o, b in ((o, by_step[o.step]) for o in other)
    ]


def compare_traces(
    base: Sequence[StepRecord],
    other: Sequence[StepRecord],
    tol: Tolerance,
    *,
    tracked: Sequence[str] = ("loss", "grad_norm"),
    tensors: TensorComparison | None = None,
    first_step: int = 0,
    floor: NoiseFloor | None = None,
    checks: Mapping[str, tuple[int, str] | None] | None = None,
    not_checked: Mapping[str, str] | None = None,
    notes: Mapping[str, str] | None = None,
    remarks: Sequence[str] = (),
) -> Comparison:
    """Compare step by step from `first_step` (a resumed cell's first step) on — and, given
    `tensors`, parameter by parameter; the verdict names the first divergence. The loss and grad
    norm tolerances at each step are the constants of `tol`, widened by the `floor` measured in the
    run (:func:`tolerances_at`). `checks`: what else was compared and its first divergence, if any
    (a script's data, init and events); `not_checked`: what was not compared, and why (said in the
    reason); `notes`: metric → what explains it, added to the reason when it is the metric caught.
    Raises ValueError if `other` does not cover exactly the baseline's steps from `first_step`."""
    base = [r for r in base if r.step >= first_step]
    if [r.step for r in other] != [r.step for r in base]:
        raise ValueError(f"trace has {len(other)} steps, the baseline has {len(base)} from step {first_step}")
    max_loss, max_grad, margin, first = _scan_steps(base, other, tol, tracked=tracked, floor=floor)
    for kind, divergence in (tensors.first if tensors else {}).items():
        first[kind] = (divergence.step, divergence.describe())
    first |= {k: v for k, v in (checks or {}).items() if v is not None}  # a script's data, init, events
    compared = [m for m in METRICS if m in tracked or m in ("lr", "skipped") or m in (checks or {})]
    caught_by = min(first, key=lambda m: (first[m][0], METRICS.index(m))) if first else None
    reason = "" if caught_by is None else first[caught_by][1] + (notes or {}).get(caught_by, "")
    if caught_by in (*TENSOR_KINDS, *(checks or {})) and "loss" in tracked and "loss" not in first:
        reason += " (the loss still matches)"
    unchecked = "; ".join(f"{metric} not checked: {why}" for metric, why in (not_checked or {}).items())
    reason = " — ".join(part for part in (reason, unchecked, *remarks) if part)
    return Comparison(
        verdict=Verdict.MATCH if caught_by is None else Verdict.DIVERGE,
        max_abs_loss_diff=max_loss,
        max_rel_grad_norm_diff=max_grad,
        max_abs_grad_diff=tensors.max_abs["grads"] if tensors and "grads" in tracked else None,
        max_abs_param_diff=tensors.max_abs["params"] if tensors and "params" in tracked else None,
        first_divergent_step=None if caught_by is None else first[caught_by][0],
        caught_by=caught_by,
        divergence_steps={m: first[m][0] if m in first else None for m in compared},
        reason=reason,
        margin=margin,
        not_checked=dict(not_checked or {}),
    )


def _scan_steps(
    base: Sequence[StepRecord], other: Sequence[StepRecord], tol: Tolerance, *, tracked, floor
) -> tuple[float, float, float, dict[str, tuple[int, str]]]:
    """Step by step: the largest |Δloss| and rel Δ‖g‖, the largest share of its tolerance either used, and
    each metric's first divergence (step, reason) — the loss within its recorded resolution, a step both
    skipped (fp16 overflow) without a grad norm to compare."""
    max_loss = max_grad = margin = 0.0
    first: dict[str, tuple[int, str]] = {}
    for b, o, d in zip(base, other, step_diffs(base, other)):
        loss_tol, grad_tol = tolerances_at(tol, b, floor)
        if b.loss_resolution or o.loss_resolution:  # losses recorded in bf16/fp16: each known to its resolution
            loss_tol = Allowed(
                value=loss_tol.value + b.loss_resolution + o.loss_resolution,
                by_floor=loss_tol.by_floor,
                resolution=b.loss_resolution + o.loss_resolution,
            )
        if b.skipped != o.skipped and "skipped" not in first:
            who = "the cell" if o.skipped else "the baseline"
            first["skipped"] = (d.step, f"{who} skipped the update of step {d.step} (fp16 overflow), the other did not")
        both_skipped = b.skipped and o.skipped  # an overflowed step has no grad norm to compare
        max_loss = nanmax(max_loss, d.abs_loss)
        max_grad = max_grad if both_skipped else nanmax(max_grad, d.rel_grad_norm)
        d_lr = rel_diff(o.lr, b.lr) if b.lr else abs(o.lr)
        grad_judged = "grad_norm" in tracked and not both_skipped
        if "loss" in tracked:
            margin = nanmax(margin, _share(d.abs_loss, loss_tol.value))
        if grad_judged:
            margin = nanmax(margin, _share(d.rel_grad_norm, grad_tol.value))
        if "loss" in tracked and "loss" not in first and not d.abs_loss <= loss_tol.value:
            first["loss"] = (d.step, f"loss diverged at step {d.step}: |Δ| {d.abs_loss:.2e} > {loss_tol.describe()}")
        if grad_judged and "grad_norm" not in first and not d.rel_grad_norm <= grad_tol.value:
            first["grad_norm"] = (
                d.step,
                f"grad norm diverged at step {d.step}: rel {d.rel_grad_norm:.2e} > {grad_tol.describe()}"
                f" ({o.grad_norm:.4g} vs {b.grad_norm:.4g})",
            )
        if "lr" not in first and not d_lr <= tol.lr_rtol:
            first["lr"] = (d.step, f"lr diverged at step {d.step}: {o.lr:.4g} vs {b.lr:.4g}")
    return max_loss, max_grad, margin, first


def tolerances_at(tol: Tolerance, base: StepRecord, floor: NoiseFloor | None):
    """(loss, grad norm) tolerance at the baseline's step `base` (gaeq.results.floor.Allowed)."""
    loss_floor, grad_floor = floor.at(base.step) if floor is not None else (None, None)
    return envelope(tol.loss_tol(base.loss), loss_floor), envelope(tol.grad_norm_rtol, grad_floor)


def _share(diff: float, allowed: float) -> float:
    """diff / allowed; a zero tolerance (`gaeq report --atol 0 --rtol 0`) allows only zero."""
    if allowed > 0:
        return diff / allowed
    if math.isnan(diff):
        return diff
    return math.inf if diff > 0 else 0.0
