"""experiments/moe.yaml through real process groups and DeepSpeed: a mixture of experts balanced over
the global batch matches at world 2 in both trainers; balanced over each micro-batch it does not (a
measured divergence, expected); the balance loss ÷ dp twice and the global counts ÷ one micro-batch's
tokens (Megatron-LM#7213) are caught; the pinned Trainer at world 2
multiplies Qwen3-MoE's router term by the processes too (transformers#48690). The whole file runs in
docs/moe.md; here its world-2 corner on fewer steps."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok
from tests.processes import leftovers

pytestmark = pytest.mark.integration

CELLS = [
    {"trainer": "hf", "world_size": 2, "micro_batch_size": 2, "variant": "qwen3_moe", "expect": "diverge"},
    {
        "trainer": "torch",
        "world_size": 2,
        "micro_batch_size": 2,
        "variant": "qwen3_moe_coef_x2",
        "bug": "moe_aux_loss_not_divided_by_ga",
    },
    {"trainer": "torch", "world_size": 2, "micro_batch_size": 2, "expect": "diverge"},
    {"trainer": "torch", "world_size": 2, "micro_batch_size": 2, "variant": "global"},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 1, "variant": "global"},
    {
        "trainer": "torch",
        "world_size": 2,
        "micro_batch_size": 2,
        "variant": "global",
        "bug": "moe_aux_loss_averaged_twice",
    },
    {
        "trainer": "deepspeed",
        "world_size": 2,
        "micro_batch_size": 2,
        "zero_stage": 1,
        "variant": "global",
        "bug": "moe_counts_over_micro_batch_tokens",
    },
]


def test_moe_balance_over_the_global_batch_matches_and_over_micro_batches_does_not(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "moe.yaml").read_text())
    spec["cells"], spec["problem"]["steps"] = CELLS, 4
    for unused in ("buffered", "mixtral"):
        spec["variants"].pop(unused)
    spec["noise_floor"] = spec["detection_limit"] = (
        False  # the dtype's own tolerances: 4 steps, the global cells within 6e-7 after 20
    )
    matrix, out = tmp_path / "moe.yaml", tmp_path / "run"
    matrix.write_text(yaml.safe_dump(spec))
    proc, report, tag = gaeq_run_here(matrix, out)
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    for cell_id in ("torch-w2-mb2-ga4@global", "deepspeed-z1-w2-mb2-ga4@global"):
        assert cells[cell_id]["verdict"] == "match" and cells[cell_id]["max_abs_loss_diff"] < 1e-6, cells[cell_id]
        routed = cells[cell_id]["ran"]["router_tokens"]  # rank 0's first step: 4 micro-batches × 2 × 16 tokens × top-2
        assert [sum(layer) for layer in routed] == [4 * 2 * 16 * 2] * 2
    per_micro_batch = cells["torch-w2-mb2-ga4"]
    assert (per_micro_batch["verdict"], per_micro_batch["caught_by"]) == ("diverge", "loss")  # its step-0 loss
    twice = cells["torch-w2-mb2-ga4-bug_moe_aux_loss_averaged_twice@global"]
    assert (twice["verdict"], twice["first_divergent_step"]) == ("diverge", 0)
    # Megatron-LM#7213: the counts of every rank's 4 micro-batches ÷ one micro-batch's tokens (fᵢ × 8)
    own = cells["deepspeed-z1-w2-mb2-ga4-bug_moe_counts_over_micro_batch_tokens@global"]
    assert (own["verdict"], own["caught_by"], own["first_divergent_step"]) == ("diverge", "loss", 0), own["reason"]
    # The pinned Trainer (transformers 5.23.0) at world 2: its loss — Qwen3-MoE's router term included — ×
    # the processes (transformers#48690), on top of the term whole at every micro-batch: step for step the
    # planted not-÷-GA's with the router coefficient × 2 (at world 1 the planted bug's as it is: tests/unit).
    trainer, planted = (
        [json.loads(line) for line in (out / "cells" / cell_id / "trace.jsonl").read_text().splitlines()]
        for cell_id in (
            "hf-w2-mb2-ga4@qwen3_moe",
            "torch-w2-mb2-ga4-bug_moe_aux_loss_not_divided_by_ga@qwen3_moe_coef_x2",
        )
    )
    for ours, theirs in zip(trainer, planted, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=1e-5)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert cells["hf-w2-mb2-ga4@qwen3_moe"]["verdict"] == "diverge"
    assert leftovers(tag) == []
