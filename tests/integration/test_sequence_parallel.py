"""experiments/sequence_parallel.yaml through real process groups: DeepSpeed-Ulysses (its
DistributedAttention on gloo) in the torch trainer matches single-process full-batch training at world
2 and 4, and the two reported ways to count a sequence-parallel loss's tokens are caught. The whole
file runs in docs/sequence-parallel.md; here a corner of it on fewer steps."""

from __future__ import annotations

import pytest

from tests.helpers import experiment_corner
from tests.processes import leftovers

pytestmark = pytest.mark.integration

CELLS = [
    {"trainer": "torch", "world_size": 2, "sequence_parallel": 2, "micro_batch_size": 2},
    {"trainer": "torch", "world_size": 4, "sequence_parallel": 2, "micro_batch_size": 4},
    {"trainer": "torch", "world_size": 2, "sequence_parallel": 2, "micro_batch_size": 4,
     "bug": "sp_tokens_over_data_ranks_only"},
    {"trainer": "torch", "world_size": 4, "sequence_parallel": 2, "micro_batch_size": 2, "bug": "mean_of_means"},
]  # fmt: skip


def test_ulysses_matches_at_world_2_and_4_and_its_token_counting_mistakes_are_caught(tmp_path):
    cells, tag = experiment_corner("sequence_parallel", CELLS, steps=3, tmp_path=tmp_path)
    for cell_id in ("torch-w2-sp2-mb2-ga8", "torch-w4-sp2-mb4-ga2"):
        cell = cells[cell_id]
        assert cell["verdict"] == "match" and cell["max_abs_loss_diff"] < 1e-6, cell
        # what ran: every attention spans a group of 2 (measured from the group), DDP over the world
        assert (cell["ran"]["sequence_parallel"], cell["ran"]["ulysses_attention"], cell["ran"]["ddp"]) == (2, 2, True)
        # Ulysses' all-to-alls: q, k, v and the output, each way, per layer — each a rank's tokens of the
        # step × every head: 8 × layers × (B ÷ dp samples) × (seq_len ÷ sp tokens) × n_embd × 4 bytes
        data_parallel = cell["world_size"] // 2
        assert cell["a2a_bytes_per_step"] == 8 * 2 * (16 // data_parallel) * (24 // 2) * 32 * 4
        assert cell["comm_bytes_per_step"] > cell["a2a_bytes_per_step"]  # and DDP's all-reduce
    for cell_id in (
        "torch-w2-sp2-mb4-ga4-bug_sp_tokens_over_data_ranks_only",
        "torch-w4-sp2-mb2-ga4-bug_mean_of_means",
    ):
        assert (cells[cell_id]["verdict"], cells[cell_id]["first_divergent_step"]) == ("diverge", 0), cells[cell_id]
    assert leftovers(tag) == []
