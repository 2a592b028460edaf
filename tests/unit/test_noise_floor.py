"""The noise floor (gaeq.results.floor): nudged twins of each baseline's own split, the envelope they
set, and the false alarm it removes at the sizes people train — with the controls that must still be
caught. The detection limit and the perturbations themselves: tests/unit/test_detection_limit.py."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from typer.testing import CliRunner

from gaeq.cli import app
from gaeq.matrix import Perturbation, Role, load_matrix
from gaeq.matrix.cell import SPLIT_AXES
from gaeq.results.compare import DEFAULT_TOLERANCES, compare_traces
from gaeq.results.floor import CEILING, FACTOR, NoiseFloor
from gaeq.results.report import judge
from gaeq.results.trace import StepRecord, TraceStore
from tests.conftest import REPO
from tests.helpers import run_in_process, small_spec

FP32 = DEFAULT_TOLERANCES["fp32"]
# the planted scheduler_every_micro_step control steps the schedule before the optimizer: torch says so
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")


def trace(losses, norms=None):
    norms = norms or [1.0] * len(losses)
    return [
        StepRecord(step=i, loss=loss, grad_norm=g, lr=1e-3, samples=8 * (i + 1), seconds=0.0)
        for i, (loss, g) in enumerate(zip(losses, norms))
    ]


def test_every_group_gets_nudged_twins_of_its_baselines_own_split_and_a_detection_limit_cell(write_matrix):
    spec = small_spec(
        axes={"trainer": ["torch", "deepspeed"], "world_size": [1], "micro_batch_size": [4], "dtype": ["fp32", "bf16"]}
    )
    matrix = load_matrix(write_matrix(spec))
    # the baseline's very split (no accumulation code runs in it), nudged with two sets of signs
    assert matrix.floors == {
        "fp32": ("torch-w1-mb16-ga1-floor0", "torch-w1-mb16-ga1-floor1"),
        "bf16": ("torch-w1-mb16-ga1-bf16-floor0", "torch-w1-mb16-ga1-bf16-floor1"),
    }
    assert matrix.sensitivities == {
        "fp32": "torch-w1-mb16-ga1-weight1e-02",
        "bf16": "torch-w1-mb16-ga1-bf16-weight1e-01",  # (mixed precision: δ 0.1)
    }
    cells = {c.id: c for c in matrix.cells}
    baseline = cells["torch-w1-mb16-ga1"]
    for twin_id, seed in (("torch-w1-mb16-ga1-floor0", 0), ("torch-w1-mb16-ga1-floor1", 1)):
        twin = cells[twin_id]
        assert (twin.role, twin.perturbation) == (Role.FLOOR, Perturbation(twin_seed=seed))
        assert {a: getattr(twin, a) for a in SPLIT_AXES} == {a: getattr(baseline, a) for a in SPLIT_AXES}
    planted = cells["torch-w1-mb16-ga1-weight1e-02"]
    assert (planted.role, planted.perturbation.weight, planted.grad_accum_steps) == (Role.SENSITIVITY, 1e-2, 1)
    assert [c.role for c in matrix.cells].count(Role.CELL) == 4  # torch mb4 and deepspeed mb4, in each dtype
    # gaeq validate says what each instrument measures
    shown = CliRunner().invoke(app, ["validate", str(write_matrix(spec, "shown.yaml"))], env={"COLUMNS": "250"})
    assert shown.exit_code == 0 and shown.output.count("measures the noise floor") == 4, shown.output
    assert shown.output.count("measures the detection limit") == 2

    assert len(load_matrix(write_matrix(spec | {"floor_twins": 3}, "three.yaml")).floors["fp32"]) == 3
    off = load_matrix(write_matrix(spec | {"noise_floor": False, "detection_limit": False}, "off.yaml"))
    assert (off.floors, off.sensitivities, [c.role for c in off.cells].count(Role.CELL)) == ({}, {}, 4)
    # a baseline of one sample per micro-batch has twins too: a nudge needs no other summation order
    single = small_spec(axes={"trainer": ["torch"], "world_size": [1, 2], "micro_batch_size": [1]})
    single["problem"]["train_batch_size"] = 2
    single["baseline"] = {"trainer": "torch", "world_size": 2, "micro_batch_size": 1}
    assert load_matrix(write_matrix(single, "single.yaml")).floors == {
        "fp32": ("torch-w2-mb1-ga1-floor0", "torch-w2-mb1-ga1-floor1")
    }


@pytest.mark.parametrize("experiment", sorted(p.name for p in (REPO / "experiments").glob("*.yaml")))
def test_no_judged_cell_is_its_own_floor_in_any_experiment(experiment):
    """Every floor of every shipped experiment is measured by twins that are the baseline's own split,
    nudged — never by a cell the run judges, nor by any split that runs the accumulation code."""
    matrix = load_matrix(REPO / "experiments" / experiment)
    cells = {c.id: c for c in matrix.cells}
    judged_ids = {c.id for c in matrix.cells if c.role == Role.CELL}
    for group, twins in matrix.floors.items():
        baseline = cells[matrix.baselines[group]]
        for twin in (cells[t] for t in twins):
            assert twin.id not in judged_ids and twin.role == Role.FLOOR and twin.perturbation.twin_seed is not None
            assert {a: getattr(twin, a) for a in SPLIT_AXES} == {a: getattr(baseline, a) for a in SPLIT_AXES}
    runnable = {c.group for c in matrix.cells if c.role == Role.CELL and not c.skip_reason} - set(matrix.unreferenced)
    assert set(matrix.floors) == (runnable if matrix.spec.noise_floor else set())  # (no reference, no twins)


def test_a_baselines_split_among_the_axes_is_the_baseline():
    """The role takes no part in what a cell is: the axes' copy of the baseline's split is it."""
    matrix = load_matrix("experiments/ga.yaml")
    assert sum(c.id == matrix.baselines["fp32"] for c in matrix.cells) == 1


def test_the_envelope_is_the_twins_drift_times_the_factor_never_below_the_constants_nor_above_the_ceiling():
    base = trace([1.0, 0.9, 0.8, 0.7])
    twin = trace([1.0, 0.9 + 1e-6, 0.8 + 2e-6, 0.7 + 1e-6])  # drifts 2e-6 at most, by step 2
    floor = NoiseFloor.measure(base, {"twin": twin})
    assert floor.loss == (0.0, pytest.approx(1e-6), pytest.approx(2e-6), pytest.approx(2e-6))  # running max
    other = trace([1.0, 0.9 - 3e-6, 0.8, 0.7])  # a second twin: the floor is the larger at each step
    both = NoiseFloor.measure(base, {"twin": twin, "other": other})
    assert both.loss == (0.0, pytest.approx(3e-6), pytest.approx(3e-6), pytest.approx(3e-6))

    near = trace([1.0, 0.9, 0.8 + 1.5e-5, 0.7 + 1.5e-5])  # 1.5e-5: above the constant (~2.8e-6), within 10 × 2e-6
    assert compare_traces(base, near, FP32).verdict == "diverge"  # what the constants alone say
    judged = compare_traces(base, near, FP32, floor=floor)
    assert judged.verdict == "match" and 0.5 < judged.margin < 1
    too_far = trace([1.0, 0.9, 0.8 + 3e-5, 0.7])
    assert compare_traces(base, too_far, FP32, floor=floor).reason == (
        f"loss diverged at step 2: |Δ| 3.00e-05 > tol 2.0e-05 ({FACTOR:g} × the noise floor)"
    )
    # Before the twin drifted (step 1: 1e-6 × 10 = 1e-5) a cell is held to that.
    early = trace([1.0, 0.9 + 1.2e-5, 0.8, 0.7])
    assert compare_traces(base, early, FP32, floor=floor).first_divergent_step == 1

    # A floor under the constants changes nothing; a twin gone wrong widens them CEILING × at most.
    tiny = NoiseFloor.measure(base, {"twin": trace([1.0, 0.9, 0.8 + 1e-9, 0.7])})
    assert compare_traces(base, trace([1.0, 0.9 + 2e-6, 0.8, 0.7]), FP32, floor=tiny).margin == pytest.approx(
        2e-6 / FP32.loss_tol(0.9)
    )
    broken = NoiseFloor.measure(base, {"twin": trace([1.0, 0.5, 0.5, 0.5])})
    hidden = compare_traces(base, trace([1.0, 0.9 + 1e-2, 0.8, 0.7]), FP32, floor=broken)
    assert hidden.verdict == "diverge" and CEILING * FP32.loss_tol(0.9) < 1e-2


def test_a_twin_that_drifts_beyond_rounding_sets_no_floor_and_says_why():
    """A problem that changes with the split (dropout from a global RNG): its twin is no measure of
    rounding; its group is judged by the constants, and the report says why."""
    base = trace([1.0, 0.9, 0.8])
    floor = NoiseFloor.measure(base, {"b-floor0": base, "b-floor1": trace([1.0, 0.9 + 1e-2, 0.8])})
    assert floor.beyond_rounding(base, FP32).startswith(
        "its twins b-floor0, b-floor1 drifted beyond what rounding explains by step 1"
    )
    assert NoiseFloor.measure(base, {"b-floor0": trace([1.0, 0.9 + 1e-5, 0.8])}).beyond_rounding(base, FP32) is None


def test_the_grad_norm_envelope_is_relative_like_its_constant():
    base = trace([1.0] * 3, [2.0, 2.0, 2.0])
    floor = NoiseFloor.measure(base, {"twin": trace([1.0] * 3, [2.0 * (1 + 7e-6), 2.0, 2.0])})
    cell = trace([1.0] * 3, [2.0 * (1 + 2e-5), 2.0, 2.0])
    assert compare_traces(base, cell, FP32).caught_by == "grad_norm"
    assert compare_traces(base, cell, FP32, floor=floor).verdict == "match"


@pytest.fixture(scope="module")
def million(tmp_path_factory):
    """A user's matrix, in this process: a 1 M-parameter MLP (16 → 1024 → 1024 → 4), AdamW lr 2e-3, clipping
    1.0 (active: the gradients' norm is above it), 8 steps, B 8 at world 1 — a torch split and the
    planted controls. A torch cell's norm is summed in float32, the baseline's in float64."""
    tmp = tmp_path_factory.mktemp("million")
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [1, 2]},
        cells=[
            {"trainer": "torch", "micro_batch_size": 2, "bug": "no_loss_division"},
            {"trainer": "torch", "micro_batch_size": 2, "bug": "clip_every_micro_step"},
            {"trainer": "torch", "micro_batch_size": 2, "bug": "scheduler_every_micro_step"},
        ],
        problem={  # small_spec's AdamW, warmup-cosine and clipping 1.0, with the user's model, lr and batch
            "model": {"kind": "mlp", "hidden": 1024, "depth": 2},
            "data": {"kind": "regression", "in_features": 16, "out_features": 4},
            "optimizer": {"name": "adamw", "lr": 2e-3, "weight_decay": 0.01},
            "steps": 8,
            "train_batch_size": 8,
        },
    )
    path = tmp / "million.yaml"
    path.write_text(yaml.safe_dump(spec))
    matrix = load_matrix(path)
    outcomes = run_in_process(matrix, tmp)
    return matrix, outcomes, TraceStore(tmp)


def test_at_a_million_parameters_the_splits_match_and_the_controls_are_caught(million):
    matrix, outcomes, traces = million
    report = judge(matrix, outcomes, traces)
    cells = {c.id: c for c in report.cells}
    assert sum(p.numel() for p in _model(matrix).parameters()) > 1_000_000
    assert cells["torch-w1-mb8-ga1"].ran["grad_norm_dtype"] == "float64"  # the reference
    assert cells["torch-w1-mb2-ga4"].ran["grad_norm_dtype"] == "float32"  # as users clip
    assert min(r.grad_norm for r in traces.get("torch-w1-mb8-ga1")) > 1.0  # clipping is active
    for cell_id in ("torch-w1-mb1-ga8", "torch-w1-mb2-ga4", *matrix.floors["fp32"]):
        assert cells[cell_id].verdict == "match", cells[cell_id].reason
    for bug in ("no_loss_division", "clip_every_micro_step", "scheduler_every_micro_step"):
        control = cells[f"torch-w1-mb2-ga4-bug_{bug}"]
        assert control.verdict == "diverge" and control.margin > 3, (bug, control.margin)
    floor = report.floors["fp32"].summary()
    assert floor["max_rel_grad_norm_diff"] > 1e-6  # float32 against float64 sums of a million squares


def test_the_control_without_the_floor_the_same_run_cries_wolf(million):
    """Judged by the constants alone, a correct split at a million parameters diverges: the false
    alarm the floor removes (nothing about accumulation is wrong: the twins are the same optimisation)."""
    matrix, outcomes, traces = million
    report = judge(dataclasses.replace(matrix, floors={}), outcomes, traces)
    verdicts = {c.id: c.verdict for c in report.cells if c.bug is None and c.cell.role == Role.CELL}
    assert "diverge" in verdicts.values(), verdicts


def _model(matrix):
    from gaeq.problem.build import build_problem

    return build_problem(matrix.problem).model


def test_twins_that_did_not_move_are_said_so_never_as_a_floor_of_zero():
    """A floor of exactly 0 over every step (the twins trained the baseline's very numbers) measured nothing: the
    line says so, and that the constants judge; a twin that moved is a floor, said with its drift."""
    from gaeq.results.lines import floor_lines
    from gaeq.results.report import Report

    base = trace([1.0, 0.9, 0.8, 0.7])
    still = NoiseFloor.measure(base, {"floor0": trace([1.0, 0.9, 0.8, 0.7])})
    (line,) = floor_lines(Report(baselines={}, tolerances={}, cells=[], floors={"fp32": still}))
    assert line == (
        "Noise floor fp32: its 1 twin(s) did not move (0 in every step): no floor was measured — the tolerances are "
        "the dtype's constants"
    )
    moved = NoiseFloor.measure(base, {"floor0": trace([1.0, 0.9 + 1e-7, 0.8, 0.7])})
    (line,) = floor_lines(Report(baselines={}, tolerances={}, cells=[], floors={"fp32": moved}))
    assert line.startswith("Noise floor fp32: 1 nudged twin(s) of the baseline drifted max |Δloss| 1.0e-07")
