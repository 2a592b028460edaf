"""experiments/fp16.yaml: fp16 that really is fp16 — autocast + GradScaler, DeepSpeed's fp16 engine.

Runs on any CPU: where DeepSpeed's accelerator has no fp16, GAEQ_ACCELERATOR_FP16=yes computes the
cells on torch's emulated float16 (each cell's `ran` says so); where it has fp16 the variable
changes nothing.
"""

from __future__ import annotations

import json

import pytest

from gaeq.accelerator import FP16_ENV, fp16_emulated
from gaeq.matrix import load_matrix
from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run, splits
from tests.processes import leftovers

pytestmark = pytest.mark.integration


def losses(run_dir, cell_id: str) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "cells" / cell_id / "trace.jsonl").read_text().splitlines()]


def test_fp16_experiment(tmp_path, monkeypatch):
    monkeypatch.setenv(FP16_ENV, "yes")
    out = tmp_path / "run"
    proc, report, tag = gaeq_run(REPO / "experiments" / "fp16.yaml", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = cells_by_id(report)
    matrix = load_matrix(REPO / "experiments" / "fp16.yaml")  # expanded with the emulation on, as the run
    expected = {v: sum(c.expect == v for c in splits(matrix.cells)) for v in ("match", "diverge")}
    assert report["summary"] == {**expected, "error": 0, "skipped": 0, "unjudged": 0} and expected["diverge"] >= 2

    # The label is what ran: float16 forward passes, a loss scaler on each side.
    for c in cells.values():
        ran = c["ran"]
        if c["dtype"] == "fp32":
            assert ran["compute_dtype"] == "float32"
            continue
        assert ran["compute_dtype"] == "float16", c
        if c["trainer"] == "torch":
            assert ran["grad_scaler"] is True
        else:
            assert ran["fp16_enabled"] is (c["dtype"] == "ds_fp16") and ran["bf16_enabled"] is False
        if c["dtype"] == "ds_fp16":
            assert (ran["model_dtype"], ran["grad_accum_dtype"]) == ("float16", "float16")
        assert ("fp16_kernels" in ran) is fp16_emulated()  # emulated exactly where the CPU has no fp16
        assert ran["accelerator_fp16"].startswith("yes (forced by GAEQ_ACCELERATOR_FP16")
        if fp16_emulated():
            assert ran["fp16_kernels"].startswith("emulated")

    # The report shows it too: the dtype each forward really computed in (`*`: emulated kernels).
    computed = "fp16*" if fp16_emulated() else "fp16"
    assert f"| ds_fp16 | {computed} |" in (out / "report.md").read_text() and f"│ fp16    │ {computed}" in proc.stdout

    # fp16 is not fp32 in disguise: its baseline's curve differs (measured 3.3e-5 here), by more
    # than the fp32 tolerance and less than the fp16 one.
    fp32, fp16 = losses(out, "torch-w1-mb16-ga1@fp32"), losses(out, "torch-w1-mb16-ga1-fp16")
    assert 1e-6 < max(abs(a - b) for a, b in zip(fp32, fp16)) < 3e-4

    matching = [c for c in cells.values() if c["expect"] == "match" and c["role"] == "cell"]
    assert all(c["verdict"] == "match" for c in matching) and len(matching) == expected["match"]
    assert 0 < max(c["max_abs_loss_diff"] for c in matching) < 1e-4

    # The fp16-only control: clipping the scaled gradient, caught at step 0 on the grad norm
    # (65536× the baseline's); its twin without the bug matches.
    bug = cells["torch-w1-mb2-ga8-fp16-bug_loss_scale_not_unscaled_before_clip"]
    assert (bug["verdict"], bug["caught_by"], bug["first_divergent_step"]) == ("diverge", "grad_norm", 0)
    assert bug["max_rel_grad_norm_diff"] > 1e4
    assert cells["torch-w1-mb2-ga8-fp16"]["verdict"] == "match"
    # DeepSpeed 0.19.8's ZeRO-0 fp16 engine never scales the loss but unscales the gradient.
    z0 = cells["deepspeed-z0-w1-mb2-ga8-ds_fp16@ds"]
    assert (z0["verdict"], z0["caught_by"], z0["first_divergent_step"]) == ("diverge", "loss", 1)
    assert z0["ran"]["optimizer"] == "FP16_UnfusedOptimizer"
    assert leftovers(tag) == []
