"""Universal-checkpoint resume across world size and GA, asserted; broken checkpoints are errors."""

from __future__ import annotations

import shutil

import pytest
import yaml

from gaeq.matrix import load_matrix
from gaeq.results.trace import read_trace
from gaeq.runtime.cells import RunOptions
from gaeq.runtime.events import EventKind
from gaeq.runtime.launch import run_all
from gaeq.trainers.checkpoint import checkpoint_root, deepspeed_tag
from tests.helpers import cells_by_id, small_spec
from tests.processes import leftovers

pytestmark = pytest.mark.integration


def test_universal_experiment(universal_run):
    proc, report, tag, out = universal_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = cells_by_id(report)
    # Saved at world 2 / GA 2 / ZeRO-2, resumed at world 1 / GA 4 and at world 2 / ZeRO-1 / micro halved.
    for cell_id in (
        "deepspeed-z2-w1-mb4-ga4-from_s10_universal",
        "deepspeed-z1-w2-mb2-ga4-from_s10_universal",
        "deepspeed-z2-w2-mb4-ga2-from_s10_universal",
        "deepspeed-z2-w2-mb4-ga2-from_s10_plain",
        "deepspeed-z3-w1-mb16-ga1-from_s10_universal",
        "torch-w1-mb2-ga8-from_s10_plain",
    ):
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]
        assert 0 < cells[cell_id]["max_abs_loss_diff"] < 1e-6
        assert [r.step for r in read_trace(out / "cells" / cell_id)] == list(range(10, 30))
        universal = cell_id.endswith("_universal")  # the resume in the cell's `ran`, as its engine loaded it
        resumed = cells[cell_id]["ran"]["resumed"]
        assert (resumed["at_step"], resumed["universal"]) == (10, universal) and resumed["from"] in cells, resumed
    restarted = cells["deepspeed-z2-w1-mb4-ga4-from_s10_universal-drop_schedule"]
    assert restarted["verdict"] == "diverge" and restarted["caught_by"] == "lr"
    no_optimizer = cells["deepspeed-z2-w2-mb4-ga2-from_s10_plain-drop_optimizer"]
    assert no_optimizer["verdict"] == "diverge" and no_optimizer["max_abs_loss_diff"] > 1e-3
    universal = checkpoint_root(out, "deepspeed-z2-w2-mb4-ga2") / deepspeed_tag(10, universal=True)
    assert (universal / "zero").is_dir()
    assert leftovers(tag) == []


SOURCE = {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 4, "zero_stage": 1}
DAMAGED_AT = {"missing": 4, "corrupted": 6}
"""How the source's checkpoint at each step is broken, between saving and converting/loading."""


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    """One run: the source saves at steps 4 and 6, then one checkpoint is deleted and the other
    overwritten with garbage; each is resumed through a universal conversion and plainly."""
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [16]},
        resume=[
            {
                "from": SOURCE,
                "at_step": step,
                "universal": universal,
                "to": [{"world_size": world, "micro_batch_size": micro, "zero_stage": 1}],
            }
            for step in DAMAGED_AT.values()
            for universal, world, micro in ((True, 1, 8), (False, 2, 4))
        ],
    )
    run_dir = tmp_path_factory.mktemp("broken") / "run"
    run_dir.mkdir()
    (run_dir.parent / "matrix.yaml").write_text(yaml.safe_dump(spec))
    matrix = load_matrix(run_dir.parent / "matrix.yaml")
    checkpoints = {
        damage: checkpoint_root(run_dir, "deepspeed-z1-w2-mb4-ga2") / deepspeed_tag(step)
        for damage, step in DAMAGED_AT.items()
    }

    def break_checkpoints(event) -> None:  # after the source has saved both, before any is converted or loaded
        if event.kind == EventKind.CONVERT and checkpoints["missing"].exists():
            shutil.rmtree(checkpoints["missing"])
            for state in checkpoints["corrupted"].glob("*.pt"):
                state.write_bytes(b"not a checkpoint")

    opts = RunOptions(problems=matrix.problems, run_dir=run_dir, timeout_s=120, on_event=break_checkpoints)
    return run_all(matrix.runnable(), opts), checkpoints


@pytest.mark.parametrize("damage", list(DAMAGED_AT))
def test_a_broken_checkpoint_is_an_error_with_a_readable_reason(broken_run, damage):
    outcomes, checkpoints = broken_run
    step = DAMAGED_AT[damage]
    assert outcomes["deepspeed-z1-w2-mb4-ga2"].status == "done"
    converted = outcomes[f"deepspeed-z1-w1-mb8-ga2-from_s{step}_universal"]
    plain = outcomes[f"deepspeed-z1-w2-mb4-ga2-from_s{step}_plain"]
    assert converted.status == plain.status == "error"
    assert converted.reason.startswith(f"universal conversion of deepspeed-z1-w2-mb4-ga2 at step {step} failed: ")
    if damage == "missing":
        assert "no DeepSpeed checkpoint" in converted.reason and str(checkpoints[damage]) in converted.reason
        assert "FileNotFoundError: no DeepSpeed checkpoint" in plain.reason
    else:
        assert "ds_to_universal failed (exit 1)" in converted.reason
        assert plain.reason.startswith("rank ") and "--- rank" in plain.reason
