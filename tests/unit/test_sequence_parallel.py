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
        ({"trainer": "torch"}, {"model": GPT | {"n_head": 3, "n_embd": 15}}, "n_head 3 and seq_len 8 must divide"),
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
