"""One judged cell: :class:`CellReport` (the cell, how its run ended, its comparison with the
baseline, its cost) and what report.json and the tables read from it, each by its own name."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from gaeq.matrix import Cell, Role
from gaeq.matrix.cell import Expectation
from gaeq.problem.stages import bubble_theory
from gaeq.results.compare import Comparison, Verdict
from gaeq.results.outcome import CellOutcome

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Cost:
    """What a cell cost, derived from its trace (never stored twice)."""

    samples_per_s: float | None = None
    """Training loop only: samples / summed step time (a compiled cell's compiling left out: its `ran`)."""
    step_seconds: float | None = None
    """Mean optimizer-step time (likewise)."""
    peak_mem_bytes: int | None = None
    """Rank 0's peak RSS (CUDA: max allocated) during the cell."""
    comm_bytes_per_step: float | None = None
    """Mean bytes through collectives per optimizer step (rank 0; nccl-tests sizes)."""
    model_state_bytes: int | None = None
    """Parameters + gradients + optimizer state rank 0 holds while accumulating (None: not measured)."""
    p2p_bytes_per_step: float | None = None
    """Pipelines: mean bytes rank 0 (the first stage) sent to and received from its neighbours per step."""
    a2a_bytes_per_step: float | None = None
    """Sequence parallelism: of comm_bytes_per_step, the mean bytes rank 0 put through all-to-alls."""
    bubble: float | None = None
    """Pipelines: the mean share of a step's schedule a rank spent not computing (steps after the
    first, which also sets the schedule up)."""

    @classmethod
    def of(cls, trace, *, compiling: float = 0.0) -> Cost:
        """From the trace; `compiling`: seconds of it torch.compile spent compiling (reported apart)."""
        if not trace:
            return cls()
        seconds = sum(r.seconds for r in trace) - compiling
        # cumulative counts (an epoch's short last step holds fewer); the first step's own: exact from step 0
        samples = trace[-1].samples - trace[0].samples + trace[0].samples // (trace[0].step + 1)
        return cls(
            samples_per_s=samples / seconds if seconds > 0 else None,
            step_seconds=seconds / len(trace),
            peak_mem_bytes=_unless_unmeasured(max, [r.peak_mem_bytes for r in trace]),
            comm_bytes_per_step=_unless_unmeasured(lambda v: sum(v) / len(v), [r.comm_bytes for r in trace]),
            model_state_bytes=max(r.model_state_bytes for r in trace) or None,
            p2p_bytes_per_step=sum(r.p2p_bytes for r in trace) / len(trace) or None,
            a2a_bytes_per_step=sum(r.a2a_bytes for r in trace) / len(trace) or None,
            bubble=statistics.fmean(bubbles)
            if (bubbles := [r.bubble for r in trace[1:] if r.bubble is not None])
            else None,
        )


def _unless_unmeasured(reduce, values: list):
    """`reduce(values)`, or None when a step did not measure it (never a 0 that was not measured)."""
    return None if any(v is None for v in values) else reduce(values)


class Part(Generic[T]):
    """A :class:`CellReport` field read from one of its parts — ``cell``, ``comparison`` or
    ``cost`` — under the same name; None where that part is missing (a cell that did not run has
    no comparison)."""

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, report: None, owner: type) -> Part[T]: ...
    @overload
    def __get__(self, report: CellReport, owner: type) -> T | None: ...
    def __get__(self, report, owner=None):
        if report is None:
            return self
        holder = getattr(report, self.part)
        return None if holder is None else getattr(holder, self.name)


@dataclass(frozen=True, kw_only=True)
class CellReport:
    """A judged cell: the cell, how its run ended, its comparison with the baseline, its cost.
    Read it by field name, whichever part holds it; :meth:`to_json` flattens it for report.json."""

    cell: Cell
    verdict: Verdict
    reason: str
    comparison: Comparison | None = None
    outcome: CellOutcome | None = None
    cost: Cost = Cost()
    weights: dict | None = None
    """A script cell's targets' weights in words (gaeq.objective.weighting.Weighting.summary): `line`, `shape`, …"""

    # The cell: what it is.
    id = Part[str]("cell")
    trainer = Part[str]("cell")
    world_size = Part[int]("cell")
    tensor_parallel = Part[int]("cell")
    pipeline_parallel = Part[int]("cell")
    pipeline_schedule = Part[str]("cell")
    hsdp_replicas = Part[int]("cell")
    sequence_parallel = Part[int]("cell")
    micro_batch_size = Part[int]("cell")
    zero_stage = Part[int]("cell")
    offload = Part[str]("cell")
    dtype = Part[str]("cell")
    variant = Part[str]("cell")
    bug = Part[str]("cell")
    expect = Part[Verdict]("cell")
    expectation = Part[Expectation]("cell")

    @property
    def expect_detail(self) -> dict | None:
        """What the cell expects beyond its verdict (caught_by, step, holds); None: the verdict alone."""
        return self.cell.expectation.detail

    @property
    def grad_accum_steps(self) -> int | None:
        """None where the batch does not divide (the cell is bad input, not a split)."""
        return self.cell.grad_accum_steps if self.cell.divisible else None

    @property
    def role(self) -> str:
        return self.cell.role.value

    @property
    def weight_error(self) -> float | None:
        """The error of known size planted in the cell (half of each micro-batch's gradient × (1 + this))."""
        return self.cell.perturbation.weight if self.cell.perturbation is not None else None

    # Its comparison with the baseline (gaeq.results.compare.Comparison).
    max_abs_loss_diff = Part[float]("comparison")
    max_rel_grad_norm_diff = Part[float]("comparison")
    max_abs_grad_diff = Part[float]("comparison")
    max_abs_param_diff = Part[float]("comparison")
    first_divergent_step = Part[int]("comparison")
    caught_by = Part[str]("comparison")
    divergence_steps = Part[dict]("comparison")
    not_checked = Part[dict]("comparison")
    margin = Part[float]("comparison")

    # How its run ended.
    @property
    def seconds(self) -> float | None:
        return self.outcome.seconds if self.outcome else None

    @property
    def ran(self) -> dict | None:
        """What really ran, read back from the live objects (gaeq.trainers.provenance)."""
        return self.outcome.ran if self.outcome else None

    # What it cost (Cost).
    samples_per_s = Part[float]("cost")
    step_seconds = Part[float]("cost")
    peak_mem_bytes = Part[int]("cost")
    comm_bytes_per_step = Part[float]("cost")
    model_state_bytes = Part[int]("cost")
    p2p_bytes_per_step = Part[float]("cost")
    a2a_bytes_per_step = Part[float]("cost")
    bubble = Part[float]("cost")

    @property
    def bubble_theory(self) -> float | None:
        """The schedule's bubble in theory (gaeq.problem.stages.bubble_theory); None without stages."""
        if self.cell.pipeline_parallel == 1 or not self.cell.divisible:
            return None
        return bubble_theory(
            self.cell.pipeline_schedule,
            pipeline_parallel=self.cell.pipeline_parallel,
            micro_batches=self.cell.grad_accum_steps,
        )

    @property
    def unmet(self) -> str | None:
        """Why its divergence is not the one it expects (:func:`unmet_expectation`); None: nothing beyond
        the verdict."""
        return unmet_expectation(self.cell.expectation, self.comparison)

    @property
    def as_expected(self) -> bool:
        """The verdict the cell expects, caught as it expects; a noise-floor twin or the detection limit's
        cell is gaeq's instrument, not a claim: whatever it shows is reported (an error still fails the run)."""
        return (
            self.verdict == Verdict.SKIPPED
            or (self.verdict == self.expect and self.unmet is None)
            or (self.cell.role in INSTRUMENTS and self.verdict != Verdict.ERROR)
        )

    def to_json(self) -> dict[str, Any]:
        return {name: _finite(getattr(self, name)) for name in JSON_FIELDS}


INSTRUMENTS = (Role.FLOOR, Role.SENSITIVITY)
"""Roles of the cells that measure a run rather than claim something of it."""


def unmet_expectation(expectation: Expectation, comparison: Comparison | None) -> str | None:
    """Why a divergence is not the one `expectation` names — another metric or another step caught
    it, a metric that must hold diverged, or a metric it names was not compared — in one line, e.g.
    `expected to be caught by grad_norm at step 0, and loss to hold: loss diverged at step 3`. None
    where it is, or where there is no divergence to judge (the verdict says the rest)."""
    if expectation.verdict != Verdict.DIVERGE or comparison is None or comparison.verdict != Verdict.DIVERGE:
        return None
    steps, metric, step = comparison.divergence_steps, expectation.caught_by, expectation.step
    missed = [f"{m} was not compared" for m in (*([metric] if metric else []), *expectation.holds) if m not in steps]
    if metric in steps and comparison.caught_by != metric:
        its = "never diverged" if steps[metric] is None else f"diverged at step {steps[metric]}"
        missed.append(
            f"it was caught by {comparison.caught_by} at step {comparison.first_divergent_step} ({metric} {its})"
        )
    elif step is not None and (metric is None or metric in steps):
        first = comparison.first_divergent_step if metric is None else steps[metric]
        if first != step:
            missed.append(f"{metric or 'it'} first diverged at step {first}")
    missed += [f"{m} diverged at step {steps[m]}" for m in expectation.holds if steps.get(m) is not None]
    if not missed:
        return None
    if metric is not None:
        said = [f"to be caught by {metric}" + ("" if step is None else f" at step {step}")]
    else:
        said = [] if step is None else [f"to first diverge at step {step}"]
    said += [f"{' and '.join(expectation.holds)} to hold"] if expectation.holds else []
    return f"expected {', and '.join(said)}: {'; '.join(missed)}"


JSON_FIELDS = (
    *("id", "trainer", "world_size", "tensor_parallel", "pipeline_parallel", "pipeline_schedule", "hsdp_replicas"),
    "sequence_parallel",
    *("micro_batch_size", "grad_accum_steps"),
    "zero_stage",
    *("offload", "dtype", "variant", "bug", "weight_error", "expect", "expect_detail", "role"),
    *("verdict", "as_expected"),
    *("max_abs_loss_diff", "max_rel_grad_norm_diff", "max_abs_grad_diff", "max_abs_param_diff"),
    *("first_divergent_step", "caught_by", "divergence_steps", "not_checked", "margin", "reason", "seconds"),
    *("samples_per_s", "step_seconds", "peak_mem_bytes", "comm_bytes_per_step", "model_state_bytes"),
    *("p2p_bytes_per_step", "bubble", "bubble_theory", "a2a_bytes_per_step", "ran", "weights"),
)
"""A cell's entry in report.json, in this order."""


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value
