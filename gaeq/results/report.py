"""Verdicts: judge every cell against its baseline (rendering and writing: gaeq.results.render)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import metadata
from pathlib import Path

from gaeq.files import atomic_write
from gaeq.matrix import Cell, Matrix, Role, group_key
from gaeq.registry import TRAINERS
from gaeq.results.compare import Comparison, Tolerance, Verdict, compare_traces, tolerance_for
from gaeq.results.floor import NoiseFloor
from gaeq.results.outcome import CellOutcome
from gaeq.results.snapshots import compare_snapshots, read_snapshots
from gaeq.results.trace import TraceStore, cell_dir

VERDICTS = tuple(Verdict)
EXIT_OK, EXIT_VERDICT, EXIT_BAD_INPUT, EXIT_RUN_FAILED = 0, 1, 2, 3


@dataclass(frozen=True, kw_only=True)
class Cost:
    """What a cell cost, derived from its trace (never stored twice)."""

    samples_per_s: float | None = None
    """Training loop only: samples / summed step time."""
    step_seconds: float | None = None
    """Mean optimizer-step time."""
    peak_mem_bytes: int | None = None
    """Rank 0's peak RSS (CUDA: max allocated) during the cell."""
    comm_bytes_per_step: float | None = None
    """Mean bytes through collectives per optimizer step (rank 0; nccl-tests sizes)."""
    model_state_bytes: int | None = None
    """Parameters + gradients + optimizer state rank 0 holds while accumulating (None: not measured)."""

    @classmethod
    def of(cls, trace) -> Cost:
        if not trace:
            return cls()
        seconds = sum(r.seconds for r in trace)
        samples = len(trace) * (trace[0].samples // (trace[0].step + 1))
        return cls(
            samples_per_s=samples / seconds if seconds > 0 else None,
            step_seconds=seconds / len(trace),
            peak_mem_bytes=max(r.peak_mem_bytes for r in trace),
            comm_bytes_per_step=sum(r.comm_bytes for r in trace) / len(trace),
            model_state_bytes=max(r.model_state_bytes for r in trace) or None,
        )


_FROM_CELL = (
    "id",
    "trainer",
    "world_size",
    "tensor_parallel",
    "micro_batch_size",
    "grad_accum_steps",
    "zero_stage",
    "offload",
    "dtype",
    "variant",
    "bug",
    "expect",
)
_FROM_COMPARISON = (
    "max_abs_loss_diff", "max_rel_grad_norm_diff", "max_abs_grad_diff", "max_abs_param_diff",
    "first_divergent_step", "caught_by", "divergence_steps", "margin",
)  # fmt: skip
_FROM_COST = tuple(f.name for f in fields(Cost))
JSON_FIELDS = (*_FROM_CELL, "role", "verdict", *_FROM_COMPARISON, "reason", "seconds", *_FROM_COST, "ran")
"""A cell's entry in report.json, in this order."""


@dataclass(frozen=True, kw_only=True)
class CellReport:
    """A judged cell: the cell, how its run ended, its comparison with the baseline, its cost.

    Read it by field name — ``report.world_size``, ``report.max_abs_loss_diff``,
    ``report.samples_per_s`` — whichever part holds it (None where that part is missing: a cell
    that did not run has no comparison); :meth:`to_json` flattens it for report.json."""

    cell: Cell
    verdict: Verdict
    reason: str
    comparison: Comparison | None = None
    outcome: CellOutcome | None = None
    cost: Cost = Cost()

    @property
    def id(self) -> str:
        return self.cell.id

    @property
    def role(self) -> str:
        return self.cell.role.value

    @property
    def grad_accum_steps(self) -> int | None:
        return self.cell.grad_accum_steps if self.cell.divisible else None

    @property
    def seconds(self) -> float | None:
        return self.outcome.seconds if self.outcome else None

    @property
    def ran(self) -> dict | None:
        """What really ran, read back from the live objects (gaeq.trainers.provenance)."""
        return self.outcome.ran if self.outcome else None

    def __getattr__(self, name: str):
        if name in _FROM_CELL:
            return getattr(self.cell, name)
        if name in _FROM_COMPARISON:
            return getattr(self.comparison, name) if self.comparison is not None else None
        if name in _FROM_COST:
            return getattr(self.cost, name)
        raise AttributeError(name)

    @property
    def as_expected(self) -> bool:
        """The verdict the cell expects; a noise-floor twin is gaeq's instrument, not a claim: whatever
        it shows is reported (an error still fails the run)."""
        return (
            self.verdict == Verdict.SKIPPED
            or self.verdict == self.expect
            or (self.cell.role == Role.FLOOR and self.verdict != Verdict.ERROR)
        )

    def to_json(self) -> dict:
        return {name: _finite(getattr(self, name)) for name in JSON_FIELDS}


@dataclass(frozen=True, kw_only=True)
class Report:
    baselines: dict[str, str]
    """group (dtype[@variant]) → baseline cell id."""
    tolerances: dict[str, Tolerance]
    """dtype → the tolerances the cells were judged with."""
    cells: list[CellReport]
    floors: dict[str, NoiseFloor] = field(default_factory=dict)
    """group → the noise floor its cells were judged with (gaeq.results.floor); a group without one
    was judged with the constants alone."""
    floor_notes: dict[str, str] = field(default_factory=dict)
    """group → why its twin set no floor (it failed, or drifted beyond rounding)."""
    versions: dict[str, str] = field(default_factory=dict)
    """The libraries a verdict certifies (installed versions of LIBRARIES), in the report's header."""

    @property
    def ok(self) -> bool:
        return all(c.as_expected for c in self.cells)

    @property
    def summary(self) -> dict[str, int]:
        counts = Counter(c.verdict for c in self.cells)
        return {v: counts.get(v, 0) for v in VERDICTS}

    @property
    def exit_code(self) -> int:
        if any(c.verdict == Verdict.ERROR for c in self.cells):
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
            "noise_floors": {group: floor.summary() for group, floor in self.floors.items()},
            "noise_floor_notes": self.floor_notes,
            "cells": [c.to_json() for c in self.cells],
            "summary": self.summary,
            "versions": self.versions,
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
    *,
    versions: Mapping[str, str] | None = None,
) -> Report:
    """Compare every cell's trace with the baseline of its dtype group."""
    tolerances = dict(tolerances or resolve_tolerances(matrix))
    floors, notes = measure_floors(matrix, outcomes, traces, tolerances)
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
            floor=floors.get(cell.group),
        )
        cells.append(
            CellReport(
                cell=cell,
                verdict=verdict,
                reason=reason,
                comparison=comparison,
                outcome=outcomes.get(cell.id),
                cost=Cost.of(traces.usable(cell.id) if verdict in (Verdict.MATCH, Verdict.DIVERGE) else None),
            )
        )
    return Report(
        baselines=dict(matrix.baselines), tolerances=tolerances, cells=cells, floors=floors, floor_notes=notes,
        versions=dict(versions or installed_versions()),
    )  # fmt: skip


def measure_floors(
    matrix: Matrix, outcomes: Mapping[str, CellOutcome], traces: TraceStore, tolerances: Mapping[str, Tolerance]
) -> tuple[dict[str, NoiseFloor], dict[str, str]]:
    """Each group's noise floor (its twin's distance from its baseline, where both finished and the
    drift is rounding's); and, for a group whose twin sets none, why."""
    floors, notes = {}, {}
    cells = {c.id: c for c in matrix.cells}
    for group, twin in matrix.floors.items():
        base = matrix.baselines[group]
        if cells[twin].skip_reason:  # the group is skipped with it (fp16 on a CPU without it, ...)
            continue
        if not all(outcomes.get(i) is not None and outcomes[i].status == "done" for i in (base, twin)):
            notes[group] = f"its twin {twin} or its baseline did not finish: judged by the constants alone"
            continue
        try:
            floor = NoiseFloor.measure(twin, traces.get(base), traces.get(twin))
        except (OSError, ValueError, TypeError) as exc:
            notes[group] = f"its twin's trace cannot be read ({exc}): judged by the constants alone"
            continue
        if (why := floor.beyond_rounding(traces.get(base), tolerances[cells[twin].dtype])) is not None:
            notes[group] = why
        else:
            floors[group] = floor
    return floors, notes


LIBRARIES = ("torch", "deepspeed", *dict.fromkeys(s.package for s in TRAINERS.values() if s.package))
"""What trains the cells — torch, DeepSpeed and the trainers' libraries: a verdict holds for these versions."""


VERSIONS_FILE = "versions.json"
"""Written into the run directory when it is created: re-judging it later names what trained it."""


def run_versions(run_dir: Path) -> dict[str, str]:
    """The versions the run directory recorded when it was created (else those installed now)."""
    try:
        return json.loads((run_dir / VERSIONS_FILE).read_text())
    except (OSError, ValueError):
        return installed_versions()


def record_versions(run_dir: Path) -> None:
    if not (run_dir / VERSIONS_FILE).exists():
        atomic_write(run_dir / VERSIONS_FILE, json.dumps(installed_versions()) + "\n")


def installed_versions() -> dict[str, str]:
    """Versions of LIBRARIES installed here (the ranks run this interpreter's), without importing them."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _judge_cell(
    cell: Cell,
    *,
    base_id: str,
    outcomes,
    traces: TraceStore,
    tolerance: Tolerance,
    tracked: tuple[str, ...],
    floor: NoiseFloor | None,
):
    if cell.skip_reason:
        return Verdict.SKIPPED, cell.skip_reason, None
    outcome = outcomes.get(cell.id)
    if outcome is None:
        return Verdict.ERROR, "did not run", None
    if outcome.status != "done":
        return Verdict.ERROR, outcome.reason, None
    base_outcome = outcomes.get(base_id)
    if base_outcome is None or base_outcome.status != "done":
        return Verdict.ERROR, f"baseline {base_id} did not finish: nothing to compare with", None
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
            traces.get(base_id),
            traces.get(cell.id),
            tolerance,
            tracked=tracked,
            tensors=tensors,
            first_step=cell.first_step,
            floor=floor,
        )
    except (OSError, ValueError, TypeError) as exc:
        return Verdict.ERROR, f"unreadable or incomplete results: {exc}", None
    reason = "baseline" if cell.id == base_id else comparison.reason
    if comparison.verdict == Verdict.DIVERGE:
        reason += _dropout_note((outcome.ran or {}).get("dropout"))
    return comparison.verdict, reason, comparison


def _dropout_note(dropout: Mapping[str, float] | None) -> str:
    """Why a transformers model with dropout diverges: its config's masks come from torch's global
    RNG, which the split changes (gaeq keeps a config's dropouts as given)."""
    if not dropout:
        return ""
    knobs = ", ".join(f"{key}={p:g}" for key, p in dropout.items())
    return (
        f" — the model's config has dropout ({knobs}): torch's global RNG draws its masks, so they depend on "
        "the split; set them to 0 in model.config to compare accumulation"
    )


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value
