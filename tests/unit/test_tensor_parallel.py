"""Tensor parallelism without process groups: the axis and its arithmetic, what is bad input, the
plans the models bring, and the model-state count the cost table shows.

Training tensor-parallel cells (DTensor, FSDP2 on a 2-D mesh, DeepSpeed AutoTP) is in
tests/integration/test_strategies.py."""

from __future__ import annotations

import pytest
import torch

from gaeq.matrix import MatrixError, load_matrix
from gaeq.problem.models import GPT
from gaeq.problem.spec import GPTSpec
from gaeq.problem.tp import tp_plan
from gaeq.trainers.cost import model_state_bytes
from tests.helpers import judged, small_spec

GPT_PROBLEM = {
    "model": {"kind": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 32},
    "data": {"kind": "tokens", "vocab_size": 32, "seq_len": 8},
    "loss": "cross_entropy",
}


def gpt_spec(**overrides) -> dict:
    spec = small_spec(**overrides)
    spec["problem"].update(GPT_PROBLEM)
    return spec


def test_world_counts_every_rank_and_ga_counts_data_parallel_ranks(write_matrix):
    m = load_matrix(
        write_matrix(
            gpt_spec(axes={"trainer": ["torch"], "world_size": [2, 4], "tensor_parallel": [2], "micro_batch_size": [2]})
        )
    )
    by_id = {c.id: c for c in judged(m.cells)}
    assert set(by_id) == {"torch-w1-mb16-ga1", "torch-w2-tp2-mb2-ga8", "torch-w4-tp2-mb2-ga4"}
    cell = by_id["torch-w4-tp2-mb2-ga4"]
    assert (cell.world_size, cell.tensor_parallel, cell.data_parallel, cell.grad_accum_steps) == (
        4,
        2,
        2,
        4,
    )  # 16 / (2 × 2)


def test_the_axis_leaves_out_splits_that_do_not_exist(write_matrix):
    # world 1 has no tp-2 group; accelerate does not split layers: its cells stay tp 1, once each
    axes = {
        "trainer": ["torch", "accelerate"],
        "world_size": [1, 2],
        "tensor_parallel": [1, 2],
        "micro_batch_size": [4],
    }
    ids = [c.id for c in judged(load_matrix(write_matrix(gpt_spec(axes=axes))).cells)]
    assert ids == [
        "torch-w1-mb16-ga1",
        "torch-w1-mb4-ga4",
        "torch-w2-mb4-ga2",
        "torch-w2-tp2-mb4-ga4",
        "accelerate-w1-mb4-ga4",
        "accelerate-w2-mb4-ga2",
    ]


@pytest.mark.parametrize(
    ("cell", "problem", "message"),
    [
        ({"world_size": 3, "tensor_parallel": 2}, {}, r"world_size 3 is not divisible by tensor_parallel 2"),
        ({"world_size": 4, "tensor_parallel": 2, "micro_batch_size": 3}, {},
         r"micro_batch_size 3 × data-parallel ranks 2 \(world_size 4 ÷ tensor_parallel 2\)"),
        ({"trainer": "accelerate"}, {}, r"tensor_parallel runs in the deepspeed, fsdp, torch trainers, not accelerate"),
        ({"dtype": "fp16"}, {}, r"tensor-parallel cells run fp32 and bf16"),
        ({}, {"model": {"kind": "mlp"}, "data": {"kind": "regression"}, "loss": "mse"},
         r"the MLP has no tensor-parallel plan"),
        ({}, {"model": {"kind": "gpt", "n_head": 3, "n_embd": 30}}, r"n_head 3 is not divisible by tensor_parallel 2"),
        ({"tensor_parallel": 1, "bug": "tp_grad_norm_per_shard"}, {}, r"needs tensor_parallel ≥ 2, the cell has 1"),
    ],
)  # fmt: skip
def test_bad_tensor_parallel_splits_are_bad_input_naming_the_numbers(write_matrix, cell, problem, message):
    spec = gpt_spec(
        axes=None, cells=[{"trainer": "torch", "world_size": 2, "tensor_parallel": 2, "micro_batch_size": 4} | cell]
    )
    spec["problem"].update(problem)
    with pytest.raises(MatrixError, match=message):
        load_matrix(write_matrix(spec))


def test_resume_refuses_a_tensor_parallel_source(write_matrix):
    spec = gpt_spec(resume=[{"from": {"trainer": "torch", "world_size": 2, "tensor_parallel": 2, "micro_batch_size": 4},
                             "at_step": 2, "universal": False, "to": [{"micro_batch_size": 4}]}])  # fmt: skip
    with pytest.raises(MatrixError, match=r"checkpoints are written without tensor parallelism"):
        load_matrix(write_matrix(spec))


def test_gpt_plan_splits_attention_and_mlp_megatron_style():
    model = GPT(GPTSpec(n_layer=2, n_head=4, n_embd=32), vocab_size=16, block_size=8, seed=0)
    assert tp_plan(model) == {
        f"blocks.{i}.{name}": style
        for i in range(2)
        for name, style in (
            ("attn.qkv", "colwise"),
            ("attn.proj", "rowwise"),
            ("mlp.0", "colwise"),
            ("mlp.2", "rowwise"),
        )
    }


def test_transformers_models_bring_their_base_model_tp_plan():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=8,
    )
    plan = tp_plan(transformers.LlamaForCausalLM(config))
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert len(plan) == 7


def test_a_model_without_a_plan_is_named():
    with pytest.raises(
        ValueError, match=r"Sequential has no tensor-parallel plan: give the model a `tp_plan` attribute"
    ):
        tp_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.tp_plan = {"*.fc": "colwise"}
    with pytest.raises(ValueError, match=r"names '\*\.fc', which matches no module"):
        tp_plan(model)


def test_model_state_of_adamw_is_sixteen_bytes_a_parameter():
    """fp32 AdamW after a step: parameters 4Ψ + gradients 4Ψ + two moments 8Ψ (the ZeRO paper's
    16Ψ), plus AdamW's step counters (a 4-byte scalar per tensor)."""
    model = GPT(GPTSpec(n_layer=2, n_head=4, n_embd=32), vocab_size=16, block_size=8, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    counters = 4 * len(list(model.parameters()))
    assert model_state_bytes(model, optimizer) == 16 * n + counters
    optimizer.zero_grad(set_to_none=True)
    assert model_state_bytes(model, optimizer) == 12 * n + counters  # gradients freed
