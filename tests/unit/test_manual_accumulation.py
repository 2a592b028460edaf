"""A loop that accumulates by hand around a DeepSpeed engine (`deepspeed_accumulation`): the axis,
what it writes into the engine's config, and what is bad input. Training these cells — the live
open-instruct#1498 bug of the pinned DeepSpeed and its two remedies — is in
tests/integration/test_pitfalls.py (experiments/pitfalls.yaml, section 9)."""

from __future__ import annotations

import pytest

from gaeq.matrix import MatrixError, matrix_from_dict
from gaeq.problem.spec import ProblemSpec
from gaeq.trainers.deepspeed_config import deepspeed_config
from tests.helpers import small_spec

MODES = ["managed", "manual", "manual_with_boundary", "manual_unmanaged"]


def test_the_axis_is_the_deepspeed_trainers_and_its_ids_say_the_mode():
    spec = small_spec(
        axes={
            "trainer": ["torch", "deepspeed"],
            "world_size": [2],
            "micro_batch_size": [4],
            "zero_stage": [1],
            "deepspeed_accumulation": MODES,
        }
    )
    ids = [c.id for c in matrix_from_dict(spec).cells if c.world_size == 2]
    assert ids == [
        "torch-w2-mb4-ga2",  # once: a torch loop has no engine to tell
        "deepspeed-z1-w2-mb4-ga2",
        "deepspeed-z1-acc_manual-w2-mb4-ga2",
        "deepspeed-z1-acc_manual_with_boundary-w2-mb4-ga2",
        "deepspeed-z1-acc_manual_unmanaged-w2-mb4-ga2",
    ]


def test_a_manual_loop_tells_the_engine_ga_1_and_the_unmanaged_remedy_turns_managing_off():
    spec = small_spec(
        axes={"trainer": ["deepspeed"], "world_size": [2], "micro_batch_size": [2], "deepspeed_accumulation": MODES}
    )
    m = matrix_from_dict(spec)
    problem = ProblemSpec.model_validate(spec["problem"])
    configs = {c.deepspeed_accumulation: deepspeed_config(c, problem) for c in m.cells if c.world_size == 2}
    assert configs["managed"]["gradient_accumulation_steps"] == 4  # B 16 = 2 × 2 ranks × 4
    for mode in MODES[1:]:
        # DeepSpeed checks train_batch_size = micro × GA × dp: the manual loop's engine sees one micro-batch a step
        assert (configs[mode]["gradient_accumulation_steps"], configs[mode]["train_batch_size"]) == (1, 4)
    assert [c.get("managed_gradient_accumulation", True) for c in configs.values()] == [True, True, True, False]


@pytest.mark.parametrize(
    ("cell", "extra", "message"),
    [
        ({"trainer": "torch"}, {}, "deepspeed_accumulation is the deepspeed trainer's loop"),
        ({"world_size": 2, "pipeline_parallel": 2}, {}, "a pipeline's engine runs its own micro-batches"),
        ({"world_size": 2, "tensor_parallel": 2}, {}, "deepspeed_accumulation with tensor_parallel: not offered"),
        (
            {"world_size": 2, "deepspeed_accumulation": "manual_unmanaged", "zero_stage": 0},
            {"track": ["loss", "grad_norm", "grads"]},
            "unmanaged accumulation at ZeRO-0 reduces the gradients inside step",
        ),
    ],
)
def test_where_a_manual_loop_is_bad_input(cell, extra, message):
    base = {"trainer": "deepspeed", "world_size": 1, "micro_batch_size": 4, "deepspeed_accumulation": "manual"}
    spec = small_spec(cells=[base | cell], **extra)
    if "pipeline_parallel" in cell or "tensor_parallel" in cell:
        spec["problem"].update(
            model={"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32},
            data={"kind": "tokens", "vocab_size": 16, "seq_len": 8},
            loss="cross_entropy",
        )
    with pytest.raises(MatrixError, match=message):
        matrix_from_dict(spec)
