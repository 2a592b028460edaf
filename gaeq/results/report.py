"""Verdicts: judge every cell against its baseline (rendering and writing: gaeq.results.render)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

from gaeq.matrix import Cell, Matrix, group_key
from gaeq.results.compare import Tolerance, compare_traces, tolerance_for
from gaeq.results.outcome import CellOutcome
from gaeq.results.snapshots import compare_snapshots, read_snapshots
from gaeq.results.trace import TraceStore, cell_dir

VERDICTS = ("match", "diverge", "error", "skipped")
EXIT_OK, EXIT_VERDICT, EXIT_BAD_INPUT, EXIT_RUN_FAILED = 0, 1, 2, 3


@dataclass(frozen=True, kw_only=True)
class CellReport:
    id: str
    trainer: str
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int | None
    zero_stage: int | None
    offload: str
    dtype: str
    variant: str
    bug: str | None
    expect: str
    verdict: str
    max_abs_loss_diff: float | None
    max_rel_grad_norm_diff: float | None
    max_abs_grad_diff: float | None
    """Over every saved gradient (None: not tracked)."""
    max_abs_param_diff: float | None
    first_divergent_step: int | None
    caught_by: str | None
    """The metric that diverged first: loss, grad_norm or lr."""
    divergence_steps: dict[str, int | None] | None
    """Each metric's first divergent step."""
    reason: str
    seconds: float | None
    samples_per_s: float | None = None
    """Training loop only: samples / summed step time."""
    step_seconds: float | None = None
    """Mean optimizer-step time."""
    peak_mem_bytes: int | None = None
    """Rank 0's peak RSS (CUDA: max allocated) during the cell."""
    comm_bytes_per_step: float | None = None
    """Mean bytes through collectives per optimizer step (rank 0; nccl-tests sizes)."""
    ran: dict | None = None
    """What really ran, read back from the live objects (gaeq.trainers.provenance)."""

    @property
    def as_expected(self) -> bool:
        return self.verdict == "skipped" or self.verdict == self.expect


@dataclass(frozen=True, kw_only=True)
class Report:
    baselines: dict[str, str]
    """group (dtype[@variant]) → baseline cell id."""
    tolerances: dict[str, Tolerance]
    """dtype → the tolerances the cells were judged with."""
    cells: list[CellReport]

    @property
    def ok(self) -> bool:
        return all(c.as_expected for c in self.cells)

    @property
    def summary(self) -> dict[str, int]:
        counts = Counter(c.verdict for c in self.cells)
        return {v: counts.get(v, 0) for v in VERDICTS}

    @property
    def exit_code(self) -> int:
        if any(c.verdict == "error" for c in self.cells):
            return EXIT_RUN_FAILED
        return EXIT_OK if self.ok else EXIT_VERDICT

    def baseline_of(self, cell: CellReport) -> str:
        return self.baselines[group_key(dtype=cell.dtype, variant=cell.variant)]

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "baseline": next(iter(self.baselines.values())),
            "baselines": self.baselines,
            "tolerances": {dtype: asdict(tol) for dtype, tol in self.tolerances.items()},
            "cells": [{k: _finite(v) for k, v in asdict(c).items()} for c in self.cells],
            "summary": self.summary,
        }


def resolve_tolerances(matrix: Matrix, overrides: Mapping[str, float | None] | None = None) -> dict[str, Tolerance]:
    """Per dtype group: the ladder's defaults, then the matrix's `tolerances:`, then `overrides` (all groups)."""
    resolved = {}
    for dtype in sorted({c.dtype for c in matrix.cells}):
        from_yaml = matrix.spec.tolerances.get(dtype)
        tol = tolerance_for(dtype, from_yaml.model_dump() if from_yaml else None)
        resolved[dtype] = replace(tol, **{k: v for k, v in (overrides or {}).items() if v is not None})
    return resolved


def judge(
    matrix: Matrix,
    outcomes: Mapping[str, CellOutcome],
    traces: TraceStore,
    tolerances: Mapping[str, Tolerance] | None = None,
) -> Report:
    """Compare every cell's trace with the baseline of its dtype group."""
    tolerances = dict(tolerances or resolve_tolerances(matrix))
    cells = []
    for cell in matrix.cells:
        base_id = matrix.baselines[cell.group]
        verdict, reason, comparison = _judge_cell(
            cell,
            base_id=base_id,
            outcomes=outcomes,
            traces=traces,
            tolerance=tolerances[cell.dtype],
            tracked=tuple(matrix.spec.track),
        )
        outcome = outcomes.get(cell.id)
        cells.append(
            CellReport(
                id=cell.id,
                trainer=cell.trainer,
                world_size=cell.world_size,
                micro_batch_size=cell.micro_batch_size,
                grad_accum_steps=cell.grad_accum_steps if cell.divisible else None,
                zero_stage=cell.zero_stage,
                offload=cell.offload,
                dtype=cell.dtype,
                variant=cell.variant,
                bug=cell.bug,
                expect=cell.expect,
                verdict=verdict,
                max_abs_loss_diff=comparison.max_abs_loss_diff if comparison else None,
                max_rel_grad_norm_diff=comparison.max_rel_grad_norm_diff if comparison else None,
                max_abs_grad_diff=comparison.max_abs_grad_diff if comparison else None,
                max_abs_param_diff=comparison.max_abs_param_diff if comparison else None,
                first_divergent_step=comparison.first_divergent_step if comparison else None,
                caught_by=comparison.caught_by if comparison else None,
                divergence_steps=comparison.divergence_steps if comparison else None,
                reason=reason,
                seconds=outcome.seconds if outcome else None,
                ran=outcome.ran if outcome else None,
                **_cost(traces.usable(cell.id) if verdict in ("match", "diverge") else None),
            )
        )
    return Report(baselines=dict(matrix.baselines), tolerances=tolerances, cells=cells)


def _judge_cell(cell: Cell, *, base_id: str, outcomes, traces: TraceStore, tolerance: Tolerance, tracked: tuple[str, ...]):
    if cell.skip_reason:
        return "skipped", cell.skip_reason, None
    outcome = outcomes.get(cell.id)
    if outcome is None:
        return "error", "did not run", None
    if outcome.status != "done":
        return "error", outcome.reason, None
    base_outcome = outcomes.get(base_id)
    if base_outcome is None or base_outcome.status != "done":
        return "error", f"baseline {base_id} did not finish: nothing to compare with", None
    try:
        tensors = None
        if cell.snapshots:
            tensors = compare_snapshots(
                read_snapshots(cell_dir(traces.run_dir, base_id)),
                read_snapshots(cell_dir(traces.run_dir, cell.id)),
                atol=tolerance.tensor_atol,
                rtol=tolerance.tensor_rtol,
                first_step=cell.first_step,
            )
        comparison = compare_traces(
            traces.get(base_id), traces.get(cell.id), tolerance, tracked=tracked, tensors=tensors, first_step=cell.first_step
        )
    except (OSError, ValueError, TypeError) as exc:
        return "error", f"unreadable or incomplete results: {exc}", None
    reason = "baseline" if cell.id == base_id else comparison.reason
    return comparison.verdict, reason, comparison


def _cost(trace) -> dict:
    """What the cell cost, from its trace (derived, never stored twice)."""
    if not trace:
        return {}
    seconds = sum(r.seconds for r in trace)
    samples = len(trace) * (trace[0].samples // (trace[0].step + 1))
    return {
        "samples_per_s": samples / seconds if seconds > 0 else None,
        "step_seconds": seconds / len(trace),
        "peak_mem_bytes": max(r.peak_mem_bytes for r in trace),
        "comm_bytes_per_step": sum(r.comm_bytes for r in trace) / len(trace),
    }


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value
