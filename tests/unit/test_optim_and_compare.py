"""The shared optimisation spec and the comparison of traces."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gaeq.problem.optim import deepspeed_optimizer, lr_factor
from gaeq.problem.spec import OptimizerSpec, ProblemSpec, ScheduleSpec
from gaeq.results.compare import DEFAULT_TOLERANCES, compare_traces, tolerance_for
from gaeq.results.trace import StepRecord


def test_warmup_cosine_is_per_optimizer_step():
    f = lr_factor(ScheduleSpec(name="warmup_cosine", warmup_steps=4, min_lr_ratio=0.1), steps=14)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1)


def test_deepspeed_optimizer_is_torch_adamw_with_every_knob_set():
    cfg = deepspeed_optimizer(OptimizerSpec(name="adamw", lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-7))
    assert cfg == {
        "type": "AdamW",
        "params": {
            "lr": 1e-3,
            "betas": [0.8, 0.9],
            "eps": 1e-7,
            "weight_decay": 0.1,
            "amsgrad": False,
            "foreach": False,
            "torch_adam": True,
        },
    }
    assert deepspeed_optimizer(OptimizerSpec(name="sgd", lr=0.1, momentum=0.9))["type"] == "SGD"


def test_deepspeed_config_sets_clipping_even_when_off():
    pytest.importorskip("deepspeed")
    from gaeq.matrix import Cell
    from gaeq.trainers.deepspeed_native import deepspeed_config

    cell = Cell(trainer="deepspeed", world_size=2, micro_batch_size=4, train_batch_size=32, zero_stage=2)
    cfg = deepspeed_config(cell, ProblemSpec(train_batch_size=32, gradient_clipping=0.0))
    assert cfg["gradient_clipping"] == 0.0  # DeepSpeed's default would be 1.0
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (
        32,
        4,
        4,
    )
    assert cfg["zero_optimization"] == {"stage": 2}


def trace(losses, norms):
    return [
        StepRecord(step=i, loss=loss, grad_norm=g, lr=1e-3, samples=8 * (i + 1), seconds=0.0)
        for i, (loss, g) in enumerate(zip(losses, norms))
    ]


def test_compare_reports_first_divergent_step_and_metric():
    tol = DEFAULT_TOLERANCES["fp32"]
    base = trace([1.0, 0.9, 0.8, 0.7], [2.0, 1.5, 1.0, 0.5])
    same = trace([1.0 + 3e-7, 0.9, 0.8 - 2e-7, 0.7], [2.0 * (1 + 2e-6), 1.5, 1.0, 0.5])
    c = compare_traces(base, same, tol)
    assert (c.verdict, c.first_divergent_step) == ("match", None)
    assert c.max_abs_loss_diff == pytest.approx(3e-7)
    assert c.max_rel_grad_norm_diff == pytest.approx(2e-6)

    loss_off = compare_traces(base, trace([1.0, 0.9, 0.81, 0.7], [2.0, 1.5, 1.0, 0.5]), tol)
    assert (loss_off.verdict, loss_off.first_divergent_step) == ("diverge", 2)
    assert loss_off.reason.startswith("loss diverged at step 2: |Δ| 1.00e-02")

    norm_off = compare_traces(base, trace([1.0, 0.9, 0.8, 0.7], [2.0, 6.0, 1.0, 0.5]), tol)
    assert (norm_off.verdict, norm_off.first_divergent_step) == ("diverge", 1)
    assert norm_off.reason.startswith("grad norm diverged at step 1: rel 3.00e+00")

    nan = compare_traces(base, trace([1.0, math.nan, 0.8, 0.7], [2.0, 1.5, 1.0, 0.5]), tol)
    assert (nan.verdict, nan.first_divergent_step) == ("diverge", 1)

    with pytest.raises(ValueError, match="trace has 2 steps, the baseline has 4 from step 0"):
        compare_traces(base, base[:2], tol)


def test_fp16_skipped_updates_must_be_skipped_alike():
    """An overflowed fp16 step is skipped (no update; its grad norm is inf): both sides skipping
    the same step is a match, one side alone is reported with the side and the step."""
    tol = DEFAULT_TOLERANCES["fp16"]
    base = trace([1.0, 0.9, 0.8, 0.7], [math.inf, 1.5, 1.0, 0.5])
    base[0] = dataclasses.replace(base[0], skipped=True)
    same = [dataclasses.replace(r) for r in base]
    same[0] = dataclasses.replace(same[0], grad_norm=math.nan)  # another way to say "overflowed"
    c = compare_traces(base, same, tol)
    assert (c.verdict, c.divergence_steps["skipped"], c.max_rel_grad_norm_diff) == ("match", None, 0.0)

    late = trace([1.0, 0.9, 0.8, 0.7], [1.2, 1.5, math.inf, 0.5])
    late[2] = dataclasses.replace(late[2], skipped=True)
    off = compare_traces(base, late, tol)
    assert (off.verdict, off.caught_by, off.first_divergent_step) == ("diverge", "skipped", 0)
    assert off.reason == "the baseline skipped the update of step 0 (fp16 overflow), the other did not"
    assert off.divergence_steps["skipped"] == 0
    flipped = compare_traces(late, base, tol)
    assert flipped.reason == "the cell skipped the update of step 0 (fp16 overflow), the other did not"


def test_tolerance_overrides():
    assert tolerance_for("fp32", {"loss_atol": 1e-3, "loss_rtol": None}).loss_atol == 1e-3
    assert tolerance_for("fp32", {"loss_atol": 1e-3}).grad_norm_rtol == DEFAULT_TOLERANCES["fp32"].grad_norm_rtol
