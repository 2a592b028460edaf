"""Pipeline parallelism without process groups: the axis and its arithmetic, where each rank sits,
what is bad input, and the stages cut from the GPT (the unsplit model's own modules).

Training pipeline cells (DeepSpeed's PipelineModule and its controls) is in
tests/integration/test_strategies.py."""

from __future__ import annotations

import pytest
import torch

from gaeq.matrix import MatrixError, load_matrix
from gaeq.problem.models import GPT, gpt_boundaries, gpt_stage
from gaeq.problem.spec import GPTSpec
from gaeq.problem.stages import blocks_of, bubble_theory, schedule_problem
from tests.unit.test_tensor_parallel import gpt_spec


def test_world_counts_every_stage_and_ga_counts_data_parallel_ranks(write_matrix):
    axes = {
        "trainer": ["deepspeed", "fsdp", "torch"],
        "world_size": [2, 4],
        "pipeline_parallel": [1, 2],
        "pipeline_schedule": ["1f1b", "gpipe"],
        "micro_batch_size": [2],
    }
    axes["zero_stage"] = [1]
    m = load_matrix(write_matrix(gpt_spec(axes=axes)))
    by_id = {c.id: c for c in m.cells}
    # fsdp does not pipeline: its cells stay pp 1, once each; DeepSpeed's pipelines run 1F1B only
    assert [i for i in by_id if "pp" in i] == [
        "deepspeed-z1-w2-pp2-1f1b-mb2-ga8",
        "deepspeed-z1-w4-pp2-1f1b-mb2-ga4",
        "torch-w2-pp2-1f1b-mb2-ga8",
        "torch-w2-pp2-gpipe-mb2-ga8",
        "torch-w4-pp2-1f1b-mb2-ga4",
        "torch-w4-pp2-gpipe-mb2-ga4",
    ]
    assert {"fsdp-w2-mb2-ga4", "fsdp-w4-mb2-ga2", "torch-w4-mb2-ga2"} <= set(by_id)
    assert all(c.pipeline_schedule is None for c in m.cells if c.pipeline_parallel == 1)
    cell = by_id["deepspeed-z1-w4-pp2-1f1b-mb2-ga4"]
    assert (cell.pipeline_parallel, cell.data_parallel, cell.grad_accum_steps) == (2, 2, 4)  # 16 / (2 × 2)
    # stage outermost, as DeepSpeed's pipe/data topology: ranks 0, 1 are stage 0 of replicas 0, 1
    assert [(p.stage, p.data, p.tensor) for p in map(cell.place, range(4))] == [
        (0, 0, 0),
        (0, 1, 0),
        (1, 0, 0),
        (1, 1, 0),
    ]


TORCH = {"trainer": "torch", "zero_stage": None}
PP4 = {"world_size": 4, "pipeline_parallel": 4}


@pytest.mark.parametrize(
    ("cell", "problem", "message"),
    [
        ({"world_size": 3}, {}, r"world_size 3 is not divisible by pipeline_parallel 2"),
        ({"world_size": 4, "micro_batch_size": 3}, {},
         r"micro_batch_size 3 × data-parallel ranks 2 \(world_size 4 ÷ pipeline_parallel 2\)"),
        ({"trainer": "fsdp", "zero_stage": None}, {},
         r"pipeline_parallel runs in the deepspeed, torch trainers, not fsdp"),
        ({"zero_stage": 2}, {}, r"DeepSpeed's pipeline engine runs ZeRO 0 and 1 \(it refuses stage 2\)"),
        ({"dtype": "bf16"}, {}, r"pipeline cells run fp32, not bf16"),
        ({"world_size": 4, "tensor_parallel": 2}, {}, r"with tensor_parallel: the torch trainer only"),
        ({}, {"model": {"kind": "mlp"}, "data": {"kind": "regression"}, "loss": "mse"},
         r"pipeline stages are cut from gaeq's GPT .*; model mlp has no layer list gaeq cuts yet"),
        ({"pipeline_parallel": 4, "world_size": 4}, {}, r"n_layer 2 < 4 stages"),
        ({"pipeline_schedule": "gpipe"}, {}, r"the deepspeed trainer's pipelines run 1f1b, not gpipe"),
        ({"pipeline_parallel": 1, "pipeline_schedule": "gpipe"}, {}, r"pipeline_schedule is a pipeline setting"),
        (TORCH | {"pipeline_schedule": "interleaved_1f1b"}, {}, r"\(interleaved_1f1b\): n_layer 2 < 4 stages"),
        (TORCH | PP4 | {"micro_batch_size": 8}, {"model": {"n_layer": 4}},
         r"1F1B needs GA ≥ pipeline_parallel .*: GA 2"),
        (TORCH | {"micro_batch_size": 8, "bug": "pipelining_step_per_micro_batch", "pipeline_schedule": "gpipe"}, {},
         r"runs the step's GA 2 micro-batches in 2 schedule runs: each needs 2 micro-batches at least"),
        (TORCH | PP4 | {"micro_batch_size": 4, "bug": "pipelining_step_per_micro_batch"}, {"model": {"n_layer": 4}},
         r"in 2 schedule runs: 1F1B needs GA ≥ pipeline_parallel"),
        ({"bug": "pipe_loss_summed_over_ga", "pipeline_parallel": 1}, {}, r"lives in a pipeline's schedule"),
        ({"bug": "mean_of_means"}, {}, r"is not planted in a pipeline's loop: it needs pipeline_parallel 1"),
    ],
)  # fmt: skip
def test_bad_pipeline_splits_are_bad_input_naming_the_numbers(write_matrix, cell, problem, message):
    base = {"trainer": "deepspeed", "world_size": 2, "pipeline_parallel": 2, "micro_batch_size": 4, "zero_stage": 1}
    spec = gpt_spec(axes=None, cells=[base | cell])
    for key, value in problem.items():
        spec["problem"][key] = spec["problem"][key] | value if key == "model" and "kind" not in value else value
    with pytest.raises(MatrixError, match=message):
        load_matrix(write_matrix(spec))


def test_tracking_tensors_is_refused_for_pipeline_cells_not_silently_skipped(write_matrix):
    cell = {"trainer": "torch", "world_size": 2, "pipeline_parallel": 2, "micro_batch_size": 4}
    with pytest.raises(MatrixError, match="tracking params .* is not offered for them yet"):
        load_matrix(write_matrix(gpt_spec(axes=None, cells=[cell], track=["loss", "grad_norm", "params"])))


def test_resume_refuses_a_pipeline_source(write_matrix):
    source = {"trainer": "deepspeed", "world_size": 2, "pipeline_parallel": 2, "micro_batch_size": 4, "zero_stage": 1}
    spec = gpt_spec(resume=[{"from": source, "at_step": 1, "to": [{"world_size": 1, "micro_batch_size": 4}]}])
    with pytest.raises(MatrixError, match="checkpoints are written without pipeline stages"):
        load_matrix(write_matrix(spec))


def test_stages_are_the_unsplit_models_own_layers_embeddings_first_head_last():
    assert blocks_of(5, 2) == [range(0, 3), range(3, 5)] and blocks_of(4, 4) == [range(i, i + 1) for i in range(4)]
    gpt = GPT(GPTSpec(n_layer=3, n_head=2, n_embd=16), vocab_size=32, block_size=8, seed=0)
    stages = [gpt_stage(gpt, index=i, count=2) for i in range(2)]
    # every parameter of the model is in exactly one stage, the very tensor (the baseline's weights)
    held = [id(p) for stage in stages for p in stage.parameters()]
    assert sorted(held) == sorted(id(p) for p in gpt.parameters())
    assert [type(layer).__name__ for layer in stages[0]] == ["Embeddings", "Block", "Block"]
    assert [type(layer).__name__ for layer in stages[1]] == ["Block", "Head"]
    tokens = torch.randint(0, 32, (3, 8))
    assert torch.equal(stages[1](stages[0](tokens)), gpt(tokens))  # the same computation, bitwise


def test_the_boundaries_a_stage_is_told_are_what_crosses_each_cut():
    gpt = GPT(GPTSpec(n_layer=4, n_head=2, n_embd=16), vocab_size=32, block_size=8, seed=0)
    tokens = torch.randint(0, 32, (3, 8))
    cuts = gpt_boundaries(gpt, tokens, count=4)
    x = tokens
    for index in range(4):
        assert (x.shape, x.dtype) == (cuts[index].shape, cuts[index].dtype)
        x = gpt_stage(gpt, index=index, count=4)(x)
    assert (x.shape, x.dtype) == (cuts[4].shape, cuts[4].dtype)
    assert [c.requires_grad for c in cuts] == [False, True, True, True, True]  # hidden states carry gradients back


def test_the_bubble_in_theory():
    # GPipe and 1F1B: (pp − 1) / (GA + pp − 1); interleaved over two chunks: (pp − 1) / (2·GA + pp − 1)
    assert bubble_theory("1f1b", pipeline_parallel=2, micro_batches=8) == pytest.approx(1 / 9)
    assert bubble_theory("gpipe", pipeline_parallel=4, micro_batches=8) == pytest.approx(3 / 11)
    assert bubble_theory("interleaved_1f1b", pipeline_parallel=2, micro_batches=8) == pytest.approx(1 / 17)
    assert schedule_problem("gpipe", pipeline_parallel=4, micro_batches=1) is None  # GPipe runs any GA
