"""A mixture of experts and its load-balancing loss (gaeq/problem/moe.py), in this process at world 1:
balanced over the global batch it is the same optimisation at every split, balanced over each
micro-batch it is not (the control that must diverge), the two planted bugs are caught, and what is
bad input. Process groups and DeepSpeed: tests/integration/test_moe.py."""

from __future__ import annotations

import pytest
import torch

from gaeq.matrix import MatrixError, load_matrix, matrix_from_dict
from gaeq.problem.build import build_problem
from gaeq.problem.moe import moe_layers
from gaeq.problem.spec import ProblemSpec
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore
from tests.helpers import run_in_process, small_spec

MOE = {"experts": 4, "top_k": 2, "aux_loss_coef": 0.01}


def moe_spec(balance: str, **more) -> dict:
    spec = small_spec(**more)
    spec["problem"].update(
        model={"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 32, "moe": MOE | {"balance": balance}},
        data={"kind": "tokens", "vocab_size": 16, "seq_len": 8},
        loss="cross_entropy",
        steps=3,
    )
    return spec


@pytest.mark.parametrize("balance", ["global", "micro_batch"])
def test_global_balance_matches_every_split_and_micro_batch_balance_does_not(write_matrix, tmp_path, balance):
    axes = {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [2]}
    matrix = load_matrix(write_matrix(moe_spec(balance, axes=axes)))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    cells = {c.id: c for c in report.cells}
    for cell_id in ("torch-w1-mb2-ga8",):
        if balance == "global":
            assert cells[cell_id].verdict == "match" and cells[cell_id].max_abs_loss_diff < 1e-6, cells[cell_id].reason
        else:  # its statistics depend on which samples share a micro-batch: visible in the step-0 loss
            assert (cells[cell_id].verdict, cells[cell_id].first_divergent_step) == ("diverge", 0)
    # every group has its twins, a micro-batch-balanced one too: they train the baseline's own split (nudged),
    # the same optimisation whatever the balance does with another split
    assert matrix.floors == {"fp32": ("torch-w1-mb16-ga1-floor0", "torch-w1-mb16-ga1-floor1")}
    router = cells["torch-w1-mb2-ga8"].ran["router_tokens"]  # the first step's routing, per layer and expert
    assert len(router) == 2 and all(sum(layer) == 16 * 8 * 2 for layer in router)  # every token picks top-2


def test_the_two_balance_bugs_are_caught_at_step_0(write_matrix, tmp_path):
    cells = [{"trainer": "torch", "micro_batch_size": 4, "bug": "moe_aux_loss_not_divided_by_ga"}]
    matrix = load_matrix(
        write_matrix(moe_spec("global", axes={"trainer": ["torch"], "micro_batch_size": [4]}, cells=cells))
    )
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    bug = next(c for c in report.cells if c.bug)
    assert (bug.verdict, bug.first_divergent_step) == ("diverge", 0), bug.reason
    assert next(c for c in report.cells if c.id == "torch-w1-mb4-ga4").verdict == "match"  # its twin


def test_the_balance_loss_is_switch_transformers_and_the_model_routes_top_k():
    problem = ProblemSpec.model_validate(moe_spec("micro_batch")["problem"])
    built = build_problem(problem)
    layers = moe_layers(built.model)
    assert len(layers) == 2 and len(layers[0].experts) == 4
    inputs, _ = built.dataset.batch(list(range(4)))
    built.model(inputs)
    counts, prob_sum, tokens = layers[0].stats
    assert (int(counts.sum()), tokens) == (4 * 8 * 2, 4 * 8)  # top-2 of every token
    torch.testing.assert_close(prob_sum.sum(), torch.tensor(float(tokens)))  # probabilities sum to 1 per token


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cells": [{"trainer": "fsdp", "micro_batch_size": 4}]}, "balance loss runs in the torch, deepspeed trainers"),
        ({"moe": {"top_k": 5}}, "top_k 5 exceeds experts 4"),
    ],
)
def test_where_a_mixture_of_experts_is_bad_input(change, message):
    spec = moe_spec("global", axes=None, cells=change.get("cells", [{"trainer": "torch", "micro_batch_size": 4}]))
    spec["problem"]["model"]["moe"] |= change.get("moe", {})
    with pytest.raises((MatrixError, ValueError), match=message):
        matrix_from_dict(spec)


def test_a_balance_bug_needs_a_mixture_of_experts():
    spec = small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "moe_aux_loss_not_divided_by_ga"}])
    with pytest.raises(MatrixError, match="exists only in a mixture of experts"):
        matrix_from_dict(spec)


MIXTRAL = {
    "hf": "MixtralForCausalLM",
    "config": {
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.02,
    },
}


QWEN3_MOE = {
    "hf": "Qwen3MoeForCausalLM",
    "config": {
        "hidden_size": 16,
        "intermediate_size": 16,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.02,
    },
}


@pytest.mark.parametrize("model", [MIXTRAL, QWEN3_MOE], ids=["mixtral", "qwen3_moe"])
def test_the_pinned_trainer_adds_the_balance_loss_to_every_micro_batch_whole(write_matrix, tmp_path, model):
    """transformers' Trainer skips ÷ GA for a model that takes num_items_in_batch — which divides the
    language-modelling loss only: a mixture of experts' router balance term goes in whole at every
    micro-batch, the very computation of the planted moe_aux_loss_not_divided_by_ga (gaeq's loop weighs
    it by its share). Mixtral and Qwen3-MoE alike; both loops count each router's tokens for `ran`."""
    cells = [
        {"trainer": "hf", "micro_batch_size": 4, "expect": "diverge"},
        {"trainer": "torch", "micro_batch_size": 4, "bug": "moe_aux_loss_not_divided_by_ga"},
    ]
    spec = small_spec(axes=None, cells=cells)
    spec["problem"].update(
        model=model,
        data={"kind": "tokens", "vocab_size": 16, "seq_len": 8, "min_len": 9},
        loss="hf",
        steps=3,
        schedule={"name": "warmup_cosine", "warmup_steps": 1, "warmup_convention": "transformers"},
    )
    matrix = load_matrix(write_matrix(spec))
    assert matrix.floors == {"fp32": ("torch-w1-mb16-ga1-floor0", "torch-w1-mb16-ga1-floor1")}  # its own split
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    cells = {c.id: c for c in report.cells}
    trainer, planted = cells["hf-w1-mb4-ga4"], cells["torch-w1-mb4-ga4-bug_moe_aux_loss_not_divided_by_ga"]
    assert trainer.verdict == planted.verdict == "diverge"
    traces = TraceStore(tmp_path)
    for a, b in zip(traces.get(trainer.id), traces.get(planted.id)):  # step by step, the same optimisation
        assert abs(a.loss - b.loss) < 1e-5 and abs(a.grad_norm / b.grad_norm - 1) < 1e-4
    # the first step's routing: GA 4 forwards of 4 × 8 tokens, each token to its top-2 of 4 experts — the same
    # tokens and weights in both loops, so the same experts
    assert trainer.ran["router_tokens"] == planted.ran["router_tokens"]
    assert [sum(layer) for layer in trainer.ran["router_tokens"]] == [4 * 4 * 8 * 2]
    assert len(trainer.ran["router_tokens"][0]) == 4
