"""experiments/sequence_parallel.yaml through real process groups: DeepSpeed-Ulysses (its
DistributedAttention on gloo) in the torch trainer matches single-process full-batch training at world
2 and 4, and the two reported ways to count a sequence-parallel loss's tokens are caught; the transformers
Trainer's own sequence parallelism (accelerate's ParallelismConfig, DeepSpeed's UlyssesSPAttentionHF) with
its own loss — sp × the gradient at ZeRO 1–2, right at ZeRO-3 —, and the corrected normaliser beside it
matching. The whole file runs in docs/sequence-parallel.md; here corners of it on fewer steps."""

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


TRAINER_CELLS = [
    {"trainer": "hf_deepspeed", "world_size": 2, "sequence_parallel": 2, "micro_batch_size": 16, "zero_stage": 1,
     "variant": "trainer", "expect": {"verdict": "diverge", "caught_by": "grad_norm", "step": 0}},
    {"trainer": "hf_deepspeed", "world_size": 2, "sequence_parallel": 2, "micro_batch_size": 16, "zero_stage": 3,
     "variant": "trainer"},
    {"trainer": "hf_deepspeed", "world_size": 4, "sequence_parallel": 2, "micro_batch_size": 4, "zero_stage": 1,
     "variant": "trainer", "expect": "diverge"},
    {"trainer": "hf_deepspeed", "world_size": 2, "sequence_parallel": 2, "micro_batch_size": 4, "zero_stage": 2,
     "variant": "trainer_corrected"},
    {"trainer": "hf_deepspeed", "world_size": 2, "sequence_parallel": 2, "micro_batch_size": 8, "zero_stage": 3,
     "variant": "trainer_corrected"},
    {"trainer": "hf_deepspeed", "world_size": 4, "sequence_parallel": 2, "micro_batch_size": 4, "zero_stage": 2,
     "variant": "trainer_corrected"},
]  # fmt: skip


def test_the_trainers_own_sequence_parallelism_scales_the_gradient_and_the_corrected_normaliser_matches(tmp_path):
    cells, tag = experiment_corner("sequence_parallel", TRAINER_CELLS, steps=3, tmp_path=tmp_path)
    # transformers' deepspeed_sp_compute_loss at ZeRO-1, GA 1: the step-0 loss right, the gradient exactly sp ×
    own = cells["hf_deepspeed-z1-w2-sp2-mb16-ga1@trainer"]
    assert own["verdict"] == "diverge" and own["as_expected"], own["reason"]
    assert "deepspeed_sp_compute_loss" in own["reason"] and "2 × the truth" in own["reason"]
    ratio = float(own["reason"].rsplit("grad norm ", 1)[1].split("×")[0])
    assert ratio == pytest.approx(2.0, abs=1e-4), own["reason"]
    assert own["divergence_steps"]["loss"] != 0
    ran = own["ran"]
    assert (ran["sp_loss"], ran["sequence_parallel"], ran["sp_gradients_averaged_over"]) == ("trainer", 2, 1)
    assert ran["attention"].startswith("deepspeed.runtime.sequence_parallel")  # UlyssesSPAttentionHF took it over
    # ZeRO-3's reduce-scatter averages over the sequence ranks too: the same loss is right there
    zero3 = cells["hf_deepspeed-z3-w2-sp2-mb16-ga1@trainer"]
    assert zero3["verdict"] == "match" and zero3["ran"]["sp_gradients_averaged_over"] == 2, zero3["reason"]
    # two data-parallel replicas: the Trainer's gather cannot backpropagate over gloo — skipped, with why
    assert cells["hf_deepspeed-z1-w4-sp2-mb4-ga2@trainer"]["verdict"] == "skipped"
    assert "gloo" in cells["hf_deepspeed-z1-w4-sp2-mb4-ga2@trainer"]["reason"]
    # the corrected normaliser: ZeRO 2 and 3, GA 2-4, one and two data-parallel replicas
    for cell_id in (
        "hf_deepspeed-z2-w2-sp2-mb4-ga4@trainer_corrected",
        "hf_deepspeed-z3-w2-sp2-mb8-ga2@trainer_corrected",
        "hf_deepspeed-z2-w4-sp2-mb4-ga2@trainer_corrected",
    ):
        cell = cells[cell_id]
        assert cell["verdict"] == "match" and cell["max_abs_loss_diff"] < 1e-6, cell["reason"]
        assert cell["ran"]["sp_loss"] == "global_tokens" and cell["ran"]["micro_batch_rows"] == cell["micro_batch_size"]
    assert leftovers(tag) == []
