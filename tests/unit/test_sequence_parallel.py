"""The sequence_parallel axis as data (no process group): where each rank sits, what a cell is called,
what GA it derives, and where Ulysses is bad input. Training under it: tests/integration/test_sequence_parallel.py."""

from __future__ import annotations

import pytest

from gaeq.matrix import MatrixError, matrix_from_dict
from tests.helpers import small_spec

GPT = {"kind": "gpt", "n_layer": 1, "n_head": 4, "n_embd": 16}
TOKENS = {"kind": "tokens", "vocab_size": 16, "seq_len": 8}
SP_BUG = "sp_tokens_over_data_ranks_only"


def sp_spec(cells, **problem) -> dict:
    spec = small_spec(axes=None, cells=cells)
    spec["problem"].update({"model": GPT, "data": TOKENS, "loss": "cross_entropy"} | problem)
    return spec


def test_a_sequence_parallel_group_is_innermost_and_shares_micro_batches():
    matrix = matrix_from_dict(
        sp_spec([{"trainer": "torch", "world_size": 4, "sequence_parallel": 2, "micro_batch_size": 2}])
    )
    cell = next(c for c in matrix.cells if c.sequence_parallel == 2)
    assert cell.id == "torch-w4-sp2-mb2-ga4" and (cell.data_parallel, cell.grad_accum_steps) == (2, 4)  # B 16
    places = [cell.place(r) for r in range(4)]
    assert [(p.data, p.sequence) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert cell.joins_through_deepspeed  # DistributedAttention talks through deepspeed.comm


@pytest.mark.parametrize(
    ("cell", "problem", "message"),
    [
        ({"trainer": "deepspeed", "zero_stage": 1}, {}, "the deepspeed trainer does not split sequences"),
        ({"trainer": "torch"}, {"model": GPT | {"n_head": 3, "n_embd": 15}}, "n_head 3 must divide"),
        ({"trainer": "torch"}, {"data": TOKENS | {"seq_len": 9}}, "seq_len 9 must divide"),
        ({"trainer": "torch"}, {"model": GPT | {"dropout": 0.1}}, "dropout 0"),
        ({"trainer": "torch", "tensor_parallel": 2, "world_size": 4}, {}, "tensor or pipeline parallelism"),
    ],
)
def test_where_ulysses_is_bad_input(cell, problem, message):
    split = {"world_size": 2, "sequence_parallel": 2, "micro_batch_size": 2} | cell
    with pytest.raises(MatrixError, match=message):
        matrix_from_dict(sp_spec([split], **problem))


def test_its_token_count_bug_needs_sequence_parallelism():
    with pytest.raises(MatrixError, match="needs sequence_parallel ≥ 2"):
        matrix_from_dict(
            sp_spec([{"trainer": "torch", "micro_batch_size": 2, "bug": "sp_tokens_over_data_ranks_only"}])
        )


LLAMA = {"hf": "LlamaForCausalLM", "config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                                              "num_attention_heads": 4, "num_key_value_heads": 2}}  # fmt: skip
TRAINER_SP = {
    "trainer": "hf_deepspeed",
    "zero_stage": 1,
    "world_size": 2,
    "sequence_parallel": 2,
    "micro_batch_size": 2,
}


def trainer_sp_spec(cells, model=LLAMA, **problem) -> dict:
    return sp_spec(cells, model=model, loss="hf", schedule={"name": "constant"}, **problem)


@pytest.mark.parametrize(
    ("cell", "model", "message"),
    [
        ({}, LLAMA | {"config": LLAMA["config"] | {"num_attention_heads": 2, "num_key_value_heads": 1}} | {},
         None),  # 2 query heads over 2 ranks; 1 key-value head replicated over both (DeepSpeed's rule)
        ({"world_size": 4, "sequence_parallel": 4}, LLAMA, None),  # kv 2 < sp 4: each replicated over 2 ranks
        ({}, LLAMA | {"config": LLAMA["config"] | {"num_attention_heads": 3, "hidden_size": 15}},
         "num_attention_heads 3 must divide"),
        ({"world_size": 3, "sequence_parallel": 3, "micro_batch_size": 2},
         LLAMA | {"config": LLAMA["config"] | {"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 24}},
         "seq_len 8 must divide"),
        ({}, {"hf": "LlamaForCausalLM", "config": {"hidden_size": 16}}, "must give num_attention_heads"),
        ({}, {"hf": "MixtralForCausalLM", "config": LLAMA["config"] | {"output_router_logits": True}},
         "a dense transformers causal LM"),
    ],
)  # fmt: skip
def test_where_the_trainers_ulysses_runs(cell, model, message):
    """The Trainer's sequence parallelism wraps a transformers causal LM's attention: its query heads divide
    by the group, its key-value heads divide by it or divide it (DeepSpeed replicates them)."""
    spec = trainer_sp_spec([TRAINER_SP | cell], model=model)
    if message is None:
        assert any(c.sequence_parallel > 1 for c in matrix_from_dict(spec).cells)
        return
    with pytest.raises(MatrixError, match=message):
        matrix_from_dict(spec)


@pytest.mark.parametrize("cuda", [False, True])
def test_the_trainers_own_gather_is_skipped_over_gloo_beyond_one_data_rank(monkeypatch, cuda):
    """transformers' deepspeed_sp_compute_loss backpropagates through torch.distributed.nn's all-gather, whose
    gloo backward cannot run in a sequence-parallel group that does not start at global rank 0: on a CPU such
    a cell is skipped, with why — on CUDA (NCCL) it runs; the corrected loss gathers nothing and runs anywhere."""
    import gaeq.accelerator

    monkeypatch.setattr(gaeq.accelerator, "has_cuda", lambda: cuda)
    corrected = LLAMA | {"sp_loss": "global_tokens"}
    two_replicas = TRAINER_SP | {"world_size": 4, "micro_batch_size": 2}
    for model, skipped in ((LLAMA, not cuda), (corrected, False)):
        cells = matrix_from_dict(trainer_sp_spec([two_replicas, TRAINER_SP], model=model)).cells
        reasons = {c.id: c.skip_reason for c in cells if c.sequence_parallel > 1}
        assert reasons["hf_deepspeed-z1-w2-sp2-mb2-ga8"] is None  # one data rank: its group holds rank 0
        said = reasons["hf_deepspeed-z1-w4-sp2-mb2-ga4"]
        assert (said is not None) == skipped and (said is None or "gloo" in said), said
