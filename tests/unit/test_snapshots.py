"""Parameter and gradient snapshots: saved only when tracked, compared tensor by tensor, localised."""

from __future__ import annotations

import pytest
import torch

from gaeq.matrix import load_matrix
from gaeq.results.report import judge
from gaeq.results.snapshots import SNAPSHOT_FILE, SnapshotWriter, compare_snapshots, read_snapshots
from gaeq.results.trace import TraceStore
from tests.helpers import run_in_process, small_spec

TRACK = ["loss", "grad_norm", "params", "grads"]
MLP_PARAMS = ["hidden.0.weight", "hidden.0.bias", "hidden.1.weight", "hidden.1.bias", "head.weight", "head.bias"]


def run(write_matrix, tmp_path, **overrides):
    spec = small_spec(**overrides)
    matrix = load_matrix(write_matrix(spec))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    return matrix, {c.id: c for c in report.cells}


def test_roundtrip_and_localisation(tmp_path):
    base, other = tmp_path / "base", tmp_path / "other"
    for directory, bump in ((base, 0.0), (other, 0.5)):
        directory.mkdir()
        writer = SnapshotWriter(directory)
        for step in range(3):
            writer.add(step=step, kind="grads", named={"a": torch.ones(3), "b": torch.full((2,), 2.0)})
            b = torch.full((2,), 2.0 + (bump if step == 2 else 0.0))
            writer.add(step=step, kind="params", named={"a": torch.zeros(3), "b": b})
        writer.close()
    snaps = read_snapshots(other)
    assert snaps.order == ["a", "b"] and snaps.steps == [0, 1, 2]
    result = compare_snapshots(read_snapshots(base), snaps, atol=1e-8, rtol=1e-5)
    assert "grads" not in result.first
    first = result.first["params"]
    assert (first.step, first.name, first.abs_diff, first.rel_diff) == (2, "b", 0.5, 0.25)
    assert first.describe() == "diverged at step 2: params of b, abs 5.0e-01, rel 2.5e-01 > tol 1e-05"


def test_untracked_runs_save_nothing(write_matrix, tmp_path):
    run(write_matrix, tmp_path)
    assert not list(tmp_path.glob(f"cells/*/{SNAPSHOT_FILE}"))


def test_accumulated_grads_and_params_match_full_batch_tensor_by_tensor(write_matrix, tmp_path):
    spec = {
        "axes": {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [1, 4]},
        "track": TRACK,
        "track_every": 5,
    }
    matrix, cells = run(write_matrix, tmp_path, **spec)
    snaps = read_snapshots(tmp_path / "cells" / "torch-w1-mb1-ga16")
    assert snaps.order == MLP_PARAMS and snaps.steps == [0, 5, 10, 11]  # every 5th and the last
    for cell_id in ("torch-w1-mb1-ga16", "torch-w1-mb4-ga4"):
        cell = cells[cell_id]
        assert cell.verdict == "match", cell.reason
        assert 0 < cell.max_abs_grad_diff < 1e-6 and 0 < cell.max_abs_param_diff < 1e-6


def test_a_scaled_gradient_under_adamw_is_localised_while_the_loss_still_matches(write_matrix, tmp_path):
    spec = {"track": TRACK, "cells": [{"trainer": "torch", "micro_batch_size": 4, "bug": "one_grad_scaled"}]}
    # Unclipped: a changed global norm would rescale every gradient differently from step to step.
    spec["problem"] = {**small_spec()["problem"], "gradient_clipping": 0.0}
    _, cells = run(write_matrix, tmp_path, **spec)
    bug = cells["torch-w1-mb4-ga4-bug_one_grad_scaled"]
    assert bug.verdict == "diverge"
    assert (bug.caught_by, bug.first_divergent_step) == ("grads", 0)
    assert bug.reason.startswith("diverged at step 0: grads of head.bias, abs ")
    # AdamW normalises a constant per-tensor factor away (up to eps): the loss agrees throughout,
    # and so do the parameters; only the gradient of head.bias — and hence the grad norm — differ.
    assert bug.divergence_steps["loss"] is None and bug.divergence_steps["params"] is None
    assert bug.divergence_steps["grad_norm"] == 0
    assert bug.reason.endswith("(the loss still matches)")
    assert bug.max_abs_loss_diff < 1e-6


def test_lr_zero_control_is_reported_at_step_0_on_the_first_parameter(write_matrix, tmp_path):
    spec = {"track": TRACK, "cells": [{"trainer": "torch", "micro_batch_size": 4, "bug": "lr_zero"}]}
    _, cells = run(write_matrix, tmp_path, **spec)
    control = cells["torch-w1-mb4-ga4-bug_lr_zero"]
    assert (control.verdict, control.caught_by, control.first_divergent_step) == ("diverge", "params", 0)
    assert control.reason.startswith(f"diverged at step 0: params of {MLP_PARAMS[0]}, ")
    assert control.divergence_steps["grads"] == 1  # same parameters at step 0, so the same gradient


@pytest.mark.parametrize("name", ["zero.yaml"])
def test_zero_experiment_expands(name):
    from tests.conftest import REPO

    m = load_matrix(REPO / "experiments" / name)
    ds = [c for c in m.cells if c.trainer == "deepspeed"]
    assert {c.zero_stage for c in ds} == {0, 1, 2, 3} and {c.offload for c in ds} == {"none", "cpu", "nvme"}
    assert all(c.zero_stage == 3 and c.world_size in (1, 2) for c in ds if c.offload == "nvme")
    assert {c.dtype for c in m.cells} == {"fp32", "bf16", "fp16"} and {c.world_size for c in ds} == {1, 2}
    assert all(c.grad_accum_steps > 1 for c in ds)
    assert all(c.skip_reason for c in ds if c.offload == "cpu" and c.zero_stage == 0)
    assert all(c.snapshots == ("grads", "params") for c in m.cells)
