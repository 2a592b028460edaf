"""The manual trainer at world size 1, run in this process: equivalence, its control, the report.

No process group is needed at world size 1, so this is the fast check of the accumulation maths;
tests/integration runs the same through real process groups and DeepSpeed.
"""

from __future__ import annotations

import contextlib
import json

import pytest

from gaeq.matrix import load_matrix
from gaeq.results.outcome import CellOutcome
from gaeq.results.render import write_report
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore, read_trace
from gaeq.trainers import base as trainers_base
from tests.helpers import judged, run_in_process, small_spec


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_accumulation_matches_full_batch_and_the_control_diverges(write_matrix, tmp_path, optimizer):
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [1, 4, 8]},
        cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"}],
    )
    spec["problem"]["optimizer"] = {"name": optimizer, "lr": 0.05 if optimizer == "sgd" else 3e-3}
    matrix = load_matrix(write_matrix(spec))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    by_id = {c.id: c for c in report.cells}

    for cell_id in ("torch-w1-mb1-ga16", "torch-w1-mb4-ga4", "torch-w1-mb8-ga2"):
        cell = by_id[cell_id]
        assert cell.verdict == "match", cell.reason
        assert 0 < cell.max_abs_loss_diff < 1e-6  # float summation order only

    control = by_id["torch-w1-mb4-ga4-bug_no_loss_division"]
    assert control.verdict == "diverge"
    assert control.first_divergent_step == 0
    # The accumulated gradient is GA = 4 times the mean: rel Δ grad norm = GA - 1.
    assert control.reason.startswith("grad norm diverged at step 0: rel 3.00e+00")
    assert control.max_abs_loss_diff > 1e-4  # the loss sees it too (clipping, SGD's step size)
    assert report.ok and report.exit_code == 0


def test_a_cell_that_does_not_run_its_label_is_an_error_not_a_match(write_matrix, tmp_path, monkeypatch):
    """bf16 cells whose autocast silently does nothing train fp32 — and would match each other.
    What ran is read back (the dtype the forward produced), so the label is caught instead."""
    spec = small_spec(axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4, 8]})
    spec["problem"]["dtype"] = "bf16"
    matrix = load_matrix(write_matrix(spec))

    honest = judge(matrix, run_in_process(matrix, tmp_path / "honest"), TraceStore(tmp_path / "honest"))
    assert [c.verdict for c in judged(honest.cells)] == ["match"] * 3
    assert all(
        c.ran["compute_dtype"] == "bfloat16" and c.ran["micro_steps"] == c.grad_accum_steps for c in honest.cells
    )

    monkeypatch.setattr(trainers_base, "autocast", lambda dtype, device: contextlib.nullcontext())
    lying = judge(matrix, run_in_process(matrix, tmp_path / "lying"), TraceStore(tmp_path / "lying"))
    assert [c.verdict for c in lying.cells] == ["error"] * 6  # the instruments too: what ran is not bf16
    assert all("compute_dtype: label 'bfloat16', ran 'float32'" in c.reason for c in lying.cells), lying.cells[0].reason
    assert lying.exit_code != 0


def test_sgd_control_is_caught_on_the_loss_when_grad_norm_is_not_compared(write_matrix, tmp_path):
    spec = small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"}])
    spec["problem"]["optimizer"] = {"name": "sgd", "lr": 0.05}
    spec["tolerances"] = {"fp32": {"grad_norm_rtol": 1e9}}  # blind the grad-norm check
    matrix = load_matrix(write_matrix(spec))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    control = report.cells[-1]
    assert control.verdict == "diverge"
    assert control.first_divergent_step == 1  # step 0's loss is computed before any update
    assert control.reason.startswith("loss diverged at step 1")


def test_report_json_schema_and_exit_codes(write_matrix, tmp_path):
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1, 3], "micro_batch_size": [4]},
        on_indivisible="skip",
        cells=[{"trainer": "torch", "micro_batch_size": 8, "bug": "no_loss_division", "expect": "match"}],
    )
    matrix = load_matrix(write_matrix(spec))
    outcomes = run_in_process(matrix, tmp_path)
    report = judge(matrix, outcomes, TraceStore(tmp_path))
    write_report(tmp_path, report)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["baseline"] == "torch-w1-mb16-ga1"
    splits = {"match": 1, "diverge": 1, "error": 0, "skipped": 1, "unjudged": 0}
    assert data["summary"] == splits  # the splits: not the baseline
    assert data["ok"] is False and report.exit_code == 1  # the mislabelled control
    keys = {
        "id",
        "trainer",
        "world_size",
        "micro_batch_size",
        "grad_accum_steps",
        "zero_stage",
        "dtype",
        "expect",
        "verdict",
        "max_abs_loss_diff",
        "max_rel_grad_norm_diff",
        "first_divergent_step",
        "reason",
        "seconds",
    }
    assert all(keys <= set(c) for c in data["cells"])
    skipped = next(c for c in data["cells"] if c["verdict"] == "skipped")
    assert "not divisible" in skipped["reason"]
    assert "torch-w1-mb8-ga2-bug_no_loss_division" in (tmp_path / "report.md").read_text()

    broken = dict(outcomes)
    broken["torch-w1-mb4-ga4"] = CellOutcome(status="error", seconds=1.0, reason="rank 0 exited with code 17")
    assert judge(matrix, broken, TraceStore(tmp_path)).exit_code == 3
    no_baseline = {k: v for k, v in outcomes.items() if k != "torch-w1-mb16-ga1"}
    assert all(
        c.verdict == "error" for c in judge(matrix, no_baseline, TraceStore(tmp_path)).cells if c.verdict != "skipped"
    )


def test_trace_records_global_mean_loss_in_float64(write_matrix, tmp_path):
    matrix = load_matrix(write_matrix(small_spec()))
    run_in_process(matrix, tmp_path)
    records = read_trace(tmp_path / "cells" / "torch-w1-mb4-ga4")
    assert [r.step for r in records] == list(range(12))
    assert [r.samples for r in records] == [16 * (s + 1) for s in range(12)]
    assert records[0].lr == pytest.approx(3e-3 / 3)  # warmup step 1 of 3
    assert all(r.grad_norm > 0 and r.seconds > 0 for r in records)
    assert not (tmp_path / "cells" / "torch-w1-mb4-ga4" / "trace.jsonl.partial").exists()
