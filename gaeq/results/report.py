"""Verdicts: judge every cell against its baseline (rendering and writing: gaeq.results.render)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path

import gaeq.results.notes as why
from gaeq.files import atomic_write
from gaeq.matrix import Cell, Matrix, Role, group_key
from gaeq.registry import TRAINERS
from gaeq.results.cell_report import CellReport, Cost, unmet_expectation
from gaeq.results.compare import Tolerance, Verdict, compare_traces, tolerance_for, tolerances_at
from gaeq.results.floor import DetectionLimit, NoiseFloor, order_causes
from gaeq.results.outcome import CellOutcome
from gaeq.results.reference import float32_that_does_not_fit, in_words, what_fits
from gaeq.results.script_checks import as_handed, read_probe, script_checks
from gaeq.results.snapshots import compare_snapshots, read_snapshots
from gaeq.results.trace import TraceStore, cell_dir
from gaeq.results.untested import untested
from gaeq.results.weighing import beside, beside_divergence, judge_alone, peers_of, reference_note, weighting_of
from gaeq.results.weighing import check as weights_check

VERDICTS = tuple(Verdict)
EXIT_OK, EXIT_VERDICT, EXIT_BAD_INPUT, EXIT_RUN_FAILED, EXIT_UNJUDGED = 0, 1, 2, 3, 4


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
    """group → why its twins set no floor (one failed, or they drifted beyond rounding) — or, beside a floor,
    what makes it unsure (twins that disagree by far)."""
    detection_limits: dict[str, DetectionLimit] = field(default_factory=dict)
    """group → the smallest error of the planted kind its run would have caught (gaeq.results.floor)."""
    versions: dict[str, str] = field(default_factory=dict)
    """The libraries a verdict certifies (installed versions of LIBRARIES), in the report's header."""
    references: dict[str, str] = field(default_factory=dict)
    """group → what its verdicts are relative to, in words: `world 2 × micro 8, GA 1` (gaeq.results.reference)."""
    reference_notes: dict[str, str] = field(default_factory=dict)
    """group → how `baseline: auto` chose its reference, or — where it ran out of memory — what would fit."""
    fits: dict[str, tuple[int, int]] = field(default_factory=dict)
    """group → (world, micro) of the reference at GA 1 that fits, where its own ran out of memory."""
    untested: list[str] = field(default_factory=list)
    """What the run did not test, in lines (gaeq.results.untested): a clip that never acted, steps at lr 0."""
    instruments_off: dict[str, str] = field(default_factory=dict)
    """instrument (noise floor, detection limit) → what the verdicts cannot claim without it (the matrix turned it
    off: `noise_floor: false`, `detection_limit: false`, `gaeq check --instruments`)."""

    @property
    def ok(self) -> bool:
        return all(c.as_expected for c in self.cells)

    @property
    def summary(self) -> dict[str, int]:
        """Verdicts of the splits judged: neither a baseline (the reference, not a claim) nor an instrument
        (noise-floor twins, the detection limit's cell)."""
        counts = Counter(c.verdict for c in self.cells if c.cell.role is Role.CELL)
        return {v: counts.get(v, 0) for v in VERDICTS}

    @property
    def baselines_not_matching(self) -> dict[str, str]:
        """Baselines that did not run as their own reference (an error, or a diverge against themselves)."""
        return {c.id: c.verdict for c in self.cells if c.cell.role is Role.BASELINE and c.verdict != Verdict.MATCH}

    @property
    def unjudged(self) -> bool:
        """Every cell as expected but some that ran and nothing could judge (`Verdict.UNJUDGED`)."""
        return {c.verdict for c in self.cells if not c.as_expected} == {Verdict.UNJUDGED}

    @property
    def exit_code(self) -> int:
        if any(c.verdict == Verdict.ERROR for c in self.cells):
            return EXIT_RUN_FAILED
        if self.unjudged:
            return EXIT_UNJUDGED
        return EXIT_OK if self.ok else EXIT_VERDICT

    @property
    def relative_to(self) -> str:
        """What the verdicts are relative to, once per distinct reference: `world 2 × micro 8, GA 1`."""
        return "; ".join(dict.fromkeys(self.references.values()))

    def baseline_of(self, cell: CellReport) -> str | None:
        """The cell's reference; None for a group that has none (`baseline: none`)."""
        return self.baselines.get(group_key(dtype=cell.dtype, variant=cell.variant))

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "baseline": next(iter(self.baselines.values()), None),
            "baselines": self.baselines,
            "tolerances": {dtype: asdict(tol) for dtype, tol in self.tolerances.items()},
            "noise_floors": {group: floor.summary() for group, floor in self.floors.items()},
            "noise_floor_notes": self.floor_notes,
            "detection_limits": {group: limit.summary() for group, limit in self.detection_limits.items()},
            "cells": [c.to_json() for c in self.cells],
            "summary": self.summary,
            "versions": self.versions,
            "references": self.references,
            "reference_notes": self.reference_notes,
            "fits": self.fits,
            "instruments_off": self.instruments_off,
            "untested": self.untested,
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
    """Compare every cell's trace with the baseline of its dtype group; a divergence that is not the
    one its cell expects says why in its reason."""
    tolerances = dict(tolerances or resolve_tolerances(matrix))
    floors, notes, causes = measure_floors(matrix, outcomes, traces, tolerances)
    cells = []
    weights = {c.id: weighting_of(traces.run_dir, c) for c in matrix.cells if c.role in (Role.CELL, Role.BASELINE)}
    for cell in matrix.cells:
        base_id, own = matrix.baselines.get(cell.group), weights.get(cell.id)
        if base_id is None:  # no reference (`baseline: none`): its weights judge it, beside its peers'
            peers = [(c, weights.get(c.id)) for c in peers_of(matrix, cell) if _done(outcomes, c.id)]
            verdict, reason, comparison = judge_alone(cell, outcomes.get(cell.id), own, peers)
        else:
            verdict, reason, comparison = _judge_cell(
                cell, base_id=base_id, outcomes=outcomes, traces=traces, tolerance=tolerances[cell.dtype],
                tracked=tuple(matrix.spec.track), floor=floors.get(cell.group),
                twins=matrix.floors.get(cell.group, ()), causes=causes.get(cell.group, ()),
                weights=(own, weights.get(base_id)) if cell.role is Role.CELL else None,
            )  # fmt: skip
        if (unmet := unmet_expectation(cell.expectation, comparison)) is not None:
            reason += f" — {unmet}"
        ran = getattr(outcomes.get(cell.id), "ran", None) or {}
        cells.append(
            CellReport(
                cell=cell,
                verdict=verdict,
                reason=reason,
                comparison=comparison,
                outcome=outcomes.get(cell.id),
                weights=None if own is None else beside(own, weights.get(base_id)).summary(),
                cost=Cost.of(
                    traces.usable(cell.id) if verdict in (Verdict.MATCH, Verdict.DIVERGE) else None,
                    compiling=ran.get("compile_seconds", 0.0),  # a compiled cell's: reported apart, in its `ran`
                ),
            )
        )
    cells = float32_that_does_not_fit(cells)
    matched = {c.cell.id for c in cells if c.cell.role == Role.CELL and c.verdict == Verdict.MATCH}
    limits = measure_detection_limits(matrix, outcomes, traces, tolerances, floors, splits=matched)
    return Report(
        baselines=dict(matrix.baselines), tolerances=tolerances, cells=cells, floors=floors, floor_notes=notes,
        detection_limits=limits, versions=dict(versions or installed_versions()),
        instruments_off=instruments_off(matrix), untested=untested(matrix, outcomes, traces),
        **references(matrix, outcomes, weights),
    )  # fmt: skip


def references(matrix: Matrix, outcomes: Mapping[str, CellOutcome], weights: Mapping | None = None) -> dict[str, dict]:
    """Each group's reference in words; how `baseline: auto` chose it; where it ran out of memory, what fits; where
    its own targets' weights are tied to its split, that."""
    words, notes, fits = {}, {}, {}
    for group, base_id in matrix.baselines.items():
        words[group] = in_words(matrix.baseline_cell(group))
        if (chosen := matrix.references.get(group)) is not None:
            notes[group] = f"baseline auto: {chosen.why}"
        if (fit := what_fits(matrix, outcomes, group)) is not None:
            notes[group], fits[group] = fit
        if (tied := reference_note((weights or {}).get(base_id))) is not None:
            notes[group] = f"{notes[group]} — {tied}" if group in notes else tied
    for group in matrix.unreferenced:
        words[group] = "no reference (each split judged by its targets' weights alone)"
    return {"references": words, "reference_notes": notes, "fits": {g: f for g, f in fits.items() if f}}


def instruments_off(matrix: Matrix) -> dict[str, str]:
    """What the verdicts cannot claim, for each instrument the matrix turned off."""
    off = {}
    if not matrix.spec.noise_floor:
        off["noise floor"] = "not measured (noise_floor: false): the tolerances are the dtype's constants"
    if not matrix.spec.detection_limit:
        off["detection limit"] = "not measured (detection_limit: false): no smallest caught error is stated"
    return off


def measure_floors(
    matrix: Matrix, outcomes: Mapping[str, CellOutcome], traces: TraceStore, tolerances: Mapping[str, Tolerance]
) -> tuple[dict[str, NoiseFloor], dict[str, str], dict[str, tuple[str, ...]]]:
    """Each group's noise floor (its twins' distance from its baseline, where all finished and the
    drift is rounding's); for a group whose twins set none, why; and what besides rounding moved the
    twins of a group whose order check saw it (its diverging splits name it)."""
    floors, notes, causes = {}, {}, {}
    cells = {c.id: c for c in matrix.cells}
    for group, twins in matrix.floors.items():
        base = matrix.baselines[group]
        if any(cells[t].skip_reason for t in twins):  # the group is skipped with them (fp16 on a CPU without it)
            continue
        if not all(_done(outcomes, i) for i in (base, *twins)):
            notes[group] = f"its twins {', '.join(twins)} or its baseline did not finish: judged by the constants alone"
            continue
        try:
            floor = NoiseFloor.measure(traces.get(base), {t: traces.get(t) for t in twins})
        except (OSError, ValueError, TypeError) as exc:
            notes[group] = f"its twins' traces cannot be read ({exc}): judged by the constants alone"
            continue
        checks = [(outcomes[t].ran or {}).get("order_check") for t in twins]
        floor = replace(floor, causes=tuple(dict.fromkeys(c for found in checks for c in order_causes(found))))
        unchecked = [f"{t}: {c['not_checked']}" for t, c in zip(twins, checks) if c and "not_checked" in c]
        tol = tolerances[cells[base].dtype]
        if (why := floor.not_rounding() or floor.beyond_rounding(traces.get(base), tol)) is not None:
            notes[group] = why
            causes[group] = floor.causes
        else:
            floors[group] = floor
            warnings = [floor.disagreement(tol, traces.get(base))]
            warnings += [f"its twins' order check could not run the model again ({'; '.join(unchecked)}): its "
                         "floor is taken as rounding's unchecked"] if unchecked else []  # fmt: skip
            if said := [w for w in warnings if w]:
                notes[group] = "; ".join(said)
    return floors, notes, causes


def measure_detection_limits(
    matrix: Matrix,
    outcomes: Mapping[str, CellOutcome],
    traces: TraceStore,
    tolerances: Mapping[str, Tolerance],
    floors: Mapping[str, NoiseFloor],
    *,
    splits: Collection[str] = (),
) -> dict[str, DetectionLimit]:
    """Each group's detection limit, where its planted cell and its baseline finished: the worst of those of
    its `splits` (the cells that matched) — each must see the planted error beyond its own distance."""
    limits = {}
    cells = {c.id: c for c in matrix.cells}
    for group, planted in matrix.sensitivities.items():
        base = matrix.baselines[group]
        if cells[planted].skip_reason or not all(_done(outcomes, i) for i in (base, planted)):
            continue
        tol, floor = tolerances[cells[base].dtype], floors.get(group)
        judged = [i for i in splits if cells[i].group == group and i != base and cells[i].first_step == 0]
        try:
            limit = DetectionLimit.measure(
                planted,
                delta=cells[planted].perturbation.weight,
                base=traces.get(base),
                planted=traces.get(planted),
                tolerances=lambda record: tolerances_at(tol, record, floor),
                floor=floor,
                splits={i: traces.get(i) for i in judged},
            )
        except (OSError, ValueError, TypeError):
            continue
        if limit is not None:
            limits[group] = limit
    return limits


def _done(outcomes: Mapping[str, CellOutcome], cell_id: str) -> bool:
    return outcomes.get(cell_id) is not None and outcomes[cell_id].status == "done"


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
    twins: tuple[str, ...] = (),
    causes: tuple[str, ...] = (),
    weights: tuple | None = None,
):
    """`weights`: a split's targets' weights and its reference's (results.weighing), checked beside the numbers."""
    if cell.skip_reason:
        return Verdict.SKIPPED, cell.skip_reason, None
    outcome = outcomes.get(cell.id)
    if outcome is None:
        return Verdict.ERROR, "did not run", None
    if outcome.status != "done":
        return Verdict.ERROR, outcome.reason, None
    base_outcome = outcomes.get(base_id)
    if base_outcome is not None and base_outcome.out_of_memory:
        return Verdict.ERROR, f"the reference {base_id} ran out of memory: nothing to compare with", None
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
        checks = None
        if TRAINERS[cell.trainer].script:  # what the probe saw in the user's script, before the numbers
            base_probe, probe = (read_probe(cell_dir(traces.run_dir, i)) for i in (base_id, cell.id))
            # the update sketch is judged within the envelope the twins' drift sets, as the trace is
            twin_probes = [p for t in twins if (p := read_probe(cell_dir(traces.run_dir, t)))]
            if base_probe and probe:
                rtol, lr_rtol = tolerance.tensor_rtol, tolerance.lr_rtol
                checks = script_checks(base_probe, probe, split=cell, twins=twin_probes, rtol=rtol, lr_rtol=lr_rtol)
        if checks is not None and "grad_norm" in checks.not_checked:  # read at other points of the step
            tracked = tuple(m for m in tracked if m != "grad_norm")
        first = dict(checks.first) if checks else None
        if checks is not None and weights is not None:  # the split's targets' weights, beside the numbers
            first |= weights_check(*weights)
        handed = checks is not None and checks.loss_as_handed  # a change in place that may be a clip: no rescale
        comparison = compare_traces(
            as_handed(traces.get(base_id), base_probe) if handed else traces.get(base_id),
            as_handed(traces.get(cell.id), probe) if handed else traces.get(cell.id),
            tolerance,
            tracked=tracked,
            tensors=tensors,
            first_step=cell.first_step,
            floor=floor,
            checks=first,
            not_checked=checks.not_checked if checks else None,
            notes=checks.notes if checks else None,
            remarks=checks.remarks if checks else (),
        )
    except (OSError, ValueError, TypeError) as exc:
        return Verdict.ERROR, f"unreadable or incomplete results: {exc}", None
    reason = "baseline" if cell.id == base_id else comparison.reason
    if comparison.verdict == Verdict.DIVERGE and comparison.caught_by != "weights" and weights:
        reason += beside_divergence(*weights)  # the weights' shape and its fix, or not in the weighting
    if comparison.verdict == Verdict.DIVERGE:
        reason += why.dropout_note((outcome.ran or {}).get("dropout"), script=TRAINERS[cell.trainer].script)
        reason += why.order_note(causes, (outcome.ran or {}).get("dropout"))
        reason += why.short_step_note(traces.get(cell.id), comparison.first_divergent_step, cell.train_batch_size)
        reason += why.muon_norm_note(outcome.ran or {}, comparison)
        reason += why.trainer_sp_note(outcome.ran or {}, comparison, traces.get(base_id), traces.get(cell.id))
        reason += why.loss_scaler_note(outcome.ran or {}, comparison, traces.get(base_id), traces.get(cell.id))
    return comparison.verdict, reason, comparison
