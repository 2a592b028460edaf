"""Resume experiments: the schema, and the torch trainer's own checkpoints resumed in-process."""

from __future__ import annotations

import pytest

from gaeq.matrix import MatrixError, load_matrix
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore, read_trace
from tests.helpers import run_in_process, small_spec

DS_SOURCE = {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 4, "zero_stage": 2}


def resume(**overrides) -> dict:
    entry = {
        "from": DS_SOURCE,
        "at_step": 5,
        "universal": True,
        "to": [{"world_size": 1, "micro_batch_size": 4, "zero_stage": 2}],
    }
    return {**entry, **overrides}


def test_source_is_marked_and_targets_are_named(write_matrix):
    m = load_matrix(
        write_matrix(
            small_spec(
                resume=[resume(), resume(at_step=8, to=[{"world_size": 2, "micro_batch_size": 2, "zero_stage": 1}])]
            )
        )
    )
    by_id = {c.id: c for c in m.cells}
    assert by_id["deepspeed-z2-w2-mb4-ga2"].save_at == (5, 8)
    target = by_id["deepspeed-z2-w1-mb4-ga4-from_s5_universal"]
    assert (target.resume.source, target.resume.step, target.first_step, target.expect) == (
        "deepspeed-z2-w2-mb4-ga2",
        5,
        5,
        "match",
    )
    assert "deepspeed-z1-w2-mb2-ga4-from_s8_universal" in by_id


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (resume(at_step=12), "at_step 12 must lie between 1 and steps - 1 = 11"),
        (
            resume(**{"from": {"trainer": "torch", "micro_batch_size": 4}}),
            "universal checkpoints are DeepSpeed ZeRO ≥ 1",
        ),
        (resume(**{"from": {**DS_SOURCE, "zero_stage": 0}}), "universal checkpoints are DeepSpeed ZeRO ≥ 1"),
        (resume(to=[{"world_size": 1, "micro_batch_size": 4, "zero_stage": 0}]), "loads into ZeRO ≥ 1"),
        (resume(to=[{"world_size": 1, "micro_batch_size": 4, "zero_stage": 3}]), "only when it was saved at ZeRO-3"),
        (
            resume(to=[{"world_size": 1, "micro_batch_size": 4, "zero_stage": 2, "drop": ["optimizer"]}]),
            "drop it only with universal: false",
        ),
        (resume(universal=False), "same world size and ZeRO stage"),
    ],
)
def test_resume_errors_say_what_to_change(write_matrix, entry, message):
    with pytest.raises(MatrixError, match=message):
        load_matrix(write_matrix(small_spec(resume=[entry])))


def test_torch_state_dicts_resume_at_another_split_and_the_controls_diverge(write_matrix, tmp_path):
    spec = small_spec(
        resume=[
            {
                "from": {"trainer": "torch", "micro_batch_size": 8},
                "at_step": 5,
                "universal": False,
                "to": [
                    {"micro_batch_size": 2},
                    {"micro_batch_size": 2, "drop": ["schedule"]},
                    {"micro_batch_size": 2, "drop": ["optimizer"]},
                ],
            }
        ]
    )
    matrix = load_matrix(write_matrix(spec))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    cells = {c.id: c for c in report.cells}
    resumed = cells["torch-w1-mb2-ga8-from_s5_plain"]
    assert resumed.verdict == "match" and 0 < resumed.max_abs_loss_diff < 1e-6
    assert [r.step for r in read_trace(tmp_path / "cells" / resumed.id)] == list(range(5, 12))
    schedule = cells["torch-w1-mb2-ga8-from_s5_plain-drop_schedule"]
    assert (schedule.verdict, schedule.caught_by, schedule.first_divergent_step) == ("diverge", "lr", 5)
    optimizer = cells["torch-w1-mb2-ga8-from_s5_plain-drop_optimizer"]
    assert optimizer.verdict == "diverge" and optimizer.divergence_steps["loss"] == 6
    assert (tmp_path / "checkpoints" / "torch-w1-mb8-ga2" / "torch_step5.pt").is_file()
    assert report.ok
