"""experiments/strategies.yaml: tensor parallelism (DTensor in the torch trainer, FSDP2 on a 2-D
mesh, DeepSpeed AutoTP with ZeRO) trains the same optimisation as one process on the whole batch,
its collectives are counted, and the grad norm measured per shard is caught.

The whole file (46 cells, world 2 and 4) runs in docs/strategies.md; here its world-2 corners plus TP × DP
at world 4, on fewer steps, to keep the suite's time."""

from __future__ import annotations

import json

import pytest
import yaml

from gaeq.matrix.load import matrix_from_dict
from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok
from tests.processes import leftovers

pytestmark = pytest.mark.integration

CELLS = [
    {"trainer": "torch", "world_size": 2, "tensor_parallel": 2, "micro_batch_size": 2},
    {"trainer": "torch", "world_size": 2, "tensor_parallel": 2, "micro_batch_size": 2, "bug": "tp_grad_norm_per_shard"},
    {"trainer": "fsdp", "world_size": 4, "tensor_parallel": 2, "micro_batch_size": 2},
    {"trainer": "deepspeed", "world_size": 2, "tensor_parallel": 2, "micro_batch_size": 2, "zero_stage": 0},
    {"trainer": "deepspeed", "world_size": 2, "tensor_parallel": 2, "micro_batch_size": 2, "zero_stage": 2},
    # DeepSpeed's pipeline engine (two stages, GA = 8 micro-batches through them), its two controls,
    # and at ZeRO-0 its clipping by the first stage's norm (expected to diverge: DeepSpeed's own defect)
    {"trainer": "deepspeed", "world_size": 2, "pipeline_parallel": 2, "micro_batch_size": 2, "zero_stage": 1},
    *(
        {
            "trainer": "deepspeed",
            "world_size": 2,
            "pipeline_parallel": 2,
            "micro_batch_size": 2,
            "zero_stage": 1,
            "bug": b,
        }
        for b in ("pipe_loss_summed_over_ga", "pipe_rescaled_every_stage")
    ),
    {
        "trainer": "deepspeed",
        "world_size": 2,
        "pipeline_parallel": 2,
        "micro_batch_size": 2,
        "zero_stage": 0,
        "expect": "diverge",
    },  # fmt: skip
    # torch.distributed.pipelining: 1F1B alone and × tensor parallelism, interleaved 1F1B on the four-block
    # GPT, and the control (torchtitan#1733)
    {"trainer": "torch", "world_size": 2, "pipeline_parallel": 2, "micro_batch_size": 2},
    {"trainer": "torch", "world_size": 4, "pipeline_parallel": 2, "tensor_parallel": 2, "micro_batch_size": 2},
    {
        "trainer": "torch",
        "world_size": 2,
        "pipeline_parallel": 2,
        "pipeline_schedule": "interleaved_1f1b",
        "micro_batch_size": 2,
        "variant": "deep",
    },
    {
        "trainer": "torch",
        "world_size": 2,
        "pipeline_parallel": 2,
        "micro_batch_size": 2,
        "bug": "pipelining_step_per_micro_batch",
    },
    # HSDP (2 replicas × 2 shards) and its control (VeOmni#862)
    {"trainer": "fsdp", "world_size": 4, "hsdp_replicas": 2, "micro_batch_size": 2},
    {
        "trainer": "fsdp",
        "world_size": 4,
        "hsdp_replicas": 2,
        "micro_batch_size": 2,
        "bug": "hsdp_grad_norm_over_replicas",
    },
    # after AutoTP and pipeline cells in the same process group: plain data parallelism over both ranks again
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 1},
]


def test_tensor_parallel_strategies(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "strategies.yaml").read_text())
    spec.pop("axes")
    spec["cells"] = CELLS
    spec["problem"]["steps"] = 6
    matrix, out = tmp_path / "strategies.yaml", tmp_path / "run"
    matrix.write_text(yaml.safe_dump(spec))
    proc, report, tag = gaeq_run_here(matrix, out)
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)

    twins = [c for c in cells.values() if c["expect"] == "match" and c["id"] != report["baseline"]]
    assert len(twins) == sum(c.expect == "match" for c in matrix_from_dict(spec).cells) - 1  # but the baseline
    assert all(c["verdict"] == "match" for c in twins)
    assert max(c["max_abs_loss_diff"] for c in twins) < 1e-5  # measured ≤ 6.9e-7 over 20 steps
    for c in twins:  # the label is what ran: layers really split over tensor_parallel ranks
        assert c["ran"]["tensor_parallel"] == c["tensor_parallel"], c["ran"]
        assert c["ran"]["world_size"] == c["world_size"]
    assert cells["deepspeed-z1-w2-mb2-ga4"]["grad_accum_steps"] == 4  # both ranks see data again
    assert (cells["fsdp-w4-tp2-mb2-ga4"]["tensor_parallel"], cells["fsdp-w4-tp2-mb2-ga4"]["grad_accum_steps"]) == (2, 4)

    # The tensor-parallel collectives are counted: per micro-step, each block's attention and MLP
    # all-reduce their output (forward) and their input's gradient (backward) — 2 blocks × 4
    # all-reduces of micro × seq_len × n_embd fp32 — plus the 4-byte norm of each of the 12 split
    # tensors, reduced over its shards, at the boundary.
    activation = 2 * 16 * 64 * 4

    def trace(cell_id: str) -> list[dict]:
        return [json.loads(line) for line in (out / "cells" / cell_id / "trace.jsonl").read_text().splitlines()]

    assert {s["comm_bytes"] for s in trace("torch-w2-tp2-mb2-ga8")} == {8 * 8 * activation + 12 * 4}
    autotp = trace("deepspeed-z0-w2-tp2-mb2-ga8")
    assert {s["comm_bytes"] for s in autotp[1:]} == {8 * 8 * activation + 4}  # DeepSpeed: one norm all-reduce

    # The pipeline: two stages cut by layer (embeddings and block 0 | block 1 and the head), GA micro-batches
    pipe = cells["deepspeed-z1-w2-pp2-1f1b-mb2-ga8"]["ran"]
    assert (pipe["pipeline_parallel"], pipe["stage_layers"], pipe["pipeline_micro_batches"]) == (2, [0, 2, 4], 8)
    assert pipe["schedule"] == "TrainSchedule"
    torch_pipe = cells["torch-w2-pp2-1f1b-mb2-ga8"]["ran"]
    assert (torch_pipe["schedule"], torch_pipe["stages"], torch_pipe["pipeline_micro_batches"]) == (
        "Schedule1F1B",
        2,
        8,
    )
    interleaved = cells["torch-w2-pp2-interleaved_1f1b-mb2-ga8@deep"]["ran"]
    assert (interleaved["stages"], interleaved["stage_indices"]) == (4, [0, 2])  # rank 0 holds stages 0 and 2
    assert cells["torch-w4-tp2-pp2-1f1b-mb2-ga8"]["ran"]["tensor_parallel"] == 2

    # What crosses rank 0's link each step, exactly: per micro-batch the activation (micro × seq_len ×
    # n_embd fp32) out and its gradient back — three times over under interleaving (stage 0 → 1, and
    # stage 2 ← 1 → 3, both ways). DeepSpeed's first step also sends the shapes (1 KB) once.
    for cell_id, per_micro_batch in (
        ("deepspeed-z1-w2-pp2-1f1b-mb2-ga8", 2),
        ("torch-w2-pp2-1f1b-mb2-ga8", 2),
        ("torch-w4-tp2-pp2-1f1b-mb2-ga8", 2),  # each tensor-parallel rank passes the whole activation on
        ("torch-w2-pp2-interleaved_1f1b-mb2-ga8@deep", 6),
    ):
        p2p = [s["p2p_bytes"] for s in trace(cell_id)]
        assert set(p2p[1:]) == {8 * per_micro_batch * activation} and p2p[0] >= p2p[1], (cell_id, p2p)
        bubbles = [s["bubble"] for s in trace(cell_id)]
        assert all(0 < b < 1 for b in bubbles), (cell_id, bubbles)  # measured: each rank waits for some of it
    assert cells["torch-w2-pp2-1f1b-mb2-ga8"]["bubble_theory"] == 1 / 9  # (pp − 1) / (GA + pp − 1)

    stepped = cells["torch-w2-pp2-1f1b-mb2-ga8-bug_pipelining_step_per_micro_batch"]
    assert (stepped["caught_by"], stepped["first_divergent_step"]) == ("grad_norm", 0)
    summed = cells["deepspeed-z1-w2-pp2-1f1b-mb2-ga8-bug_pipe_loss_summed_over_ga"]
    assert (summed["caught_by"], summed["first_divergent_step"]) == ("grad_norm", 0)
    assert summed["max_abs_loss_diff"] < 1e-5  # the loss does not show it: only the grad norm (GA× too large)
    assert abs(summed["max_rel_grad_norm_diff"] - 7.0) < 1e-3
    rescaled = cells["deepspeed-z1-w2-pp2-1f1b-mb2-ga8-bug_pipe_rescaled_every_stage"]
    assert (rescaled["caught_by"], rescaled["first_divergent_step"]) == ("grad_norm", 0)
    zero0 = cells["deepspeed-z0-w2-pp2-1f1b-mb2-ga8"]  # its own norm (gaeq's) matches until clipping acts on it
    assert (zero0["verdict"], zero0["caught_by"]) == ("diverge", "loss"), zero0["reason"]

    hsdp = cells["fsdp-w4-hsdp2-mb2-ga2"]
    assert (hsdp["ran"]["hsdp_replicas"], hsdp["ran"]["sharded_parameters"]) == (2, True)
    over = cells["fsdp-w4-hsdp2-mb2-ga2-bug_hsdp_grad_norm_over_replicas"]
    assert (over["caught_by"], over["first_divergent_step"]) == ("grad_norm", 0)
    assert abs(over["max_rel_grad_norm_diff"] - (2**0.5 - 1)) < 1e-3  # each shard's squares counted twice: √2

    shard = cells["torch-w2-tp2-mb2-ga8-bug_tp_grad_norm_per_shard"]
    assert (shard["verdict"], shard["caught_by"], shard["first_divergent_step"]) == ("diverge", "grad_norm", 0)
    assert leftovers(tag) == []
