"""Compiled training (experiments/compile.yaml; the `compile` axis): gaeq's torch loop with its model
under torch.compile (inductor) and DeepSpeed's engine.compile(), at world 1 and 2, train the same
optimisation as the eager full-batch baseline; what ran says it compiled (graphs, no graph break, the
seconds compiling — left out of the step time); a mistake only a compiled path makes — the loss ÷ a
token count traced in as a constant, its guards skipped — is caught at the step it goes stale. And a
user's nanoGPT-style script run with --compile is judged as its eager self.

Inductor builds its kernels on first use (about 35 s for this GPT on 2 cores; cached under
/tmp/torchinductor_<user>, which .ci/run warms at installation, as it builds DeepSpeed's ops)."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok

pytestmark = pytest.mark.integration


def test_compiled_splits_match_the_eager_baseline_and_a_compiled_only_mistake_is_caught(tmp_path):
    proc, report, _ = gaeq_run_here(REPO / "experiments" / "compile.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    compiled = [c for c in cells.values() if c["id"].endswith("-compiled")]
    assert {c["trainer"] for c in compiled} == {"torch", "deepspeed"} and {c["world_size"] for c in compiled} == {1, 2}
    for c in compiled:
        assert c["verdict"] == "match", c["reason"]
        ran = c["ran"]
        assert ran["compiled"] and ran["compiled_graphs"] >= 1 and ran["graph_breaks"] == 0, ran
        assert ran["compile_seconds"] > 10 * c["step_seconds"] > 0  # compiling reported apart from the steps
    assert cells["torch-w1-mb16-ga1"]["ran"]["compiled"] is False  # the baseline: eager
    planted = cells["torch-w1-mb4-ga4-compiled-bug_compiled_guards_skipped"]
    assert planted["verdict"] == "diverge" and planted["first_divergent_step"] == 1, planted["reason"]
    assert planted["divergence_steps"]["loss"] == 1  # right at step 0, the count of step 0 traced in


def test_a_compiled_script_is_judged_as_its_eager_self(tmp_path):
    spec = {
        "name": "compiled_script",
        "script": {
            "path": str(REPO / "experiments" / "scripts" / "ddp_manual.py"),
            "args": [
                "--batch_size",
                "{micro_batch_size}",
                "--grad_accum",
                "{grad_accum_steps}",
                "--max_steps",
                "{steps}",
            ],
        },
        "steps": 4,
        "train_batch_size": 32,
        "noise_floor": False,
        "detection_limit": False,
        "axes": {"world_size": [1], "micro_batch_size": [32]},
        "cells": [{"world_size": w, "micro_batch_size": 8, "args": ["--compile"]} for w in (1, 2)],
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "m.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    for cell_id in ("script-w1-mb8-ga4-args_compile", "script-w2-mb8-ga2-args_compile"):
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]["reason"]
        assert cells[cell_id]["not_checked"] == {}  # its data checked through the compiled model too
