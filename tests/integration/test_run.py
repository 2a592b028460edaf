"""`gaeq run` end to end: real process groups (gloo), real DeepSpeed on the CPU accelerator."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from gaeq.matrix import load_matrix
from gaeq.matrix.load import matrix_from_dict
from gaeq.runtime.lanes import plan_lanes
from tests.conftest import REPO
from tests.helpers import cells_by_id, ga_at_test_size, gaeq_run_here, small_spec, splits
from tests.processes import leftovers

pytestmark = pytest.mark.integration

GA = matrix_from_dict(ga_at_test_size())
"""experiments/ga.yaml's cells at the size the suite's default run trains them."""
EXPECTED = {
    v: sum(c.expect == v for c in splits(load_matrix(REPO / "experiments" / "ga.yaml").cells))
    for v in ("match", "diverge")
}
"""What the default matrix expects, from the file: the counts its summary must show (its instruments —
noise-floor twins, the detection-limit cell — are not counted)."""


def test_a_crashing_or_hanging_rank_errors_its_cell_and_the_rest_still_run(write_matrix, tmp_path):
    spec = small_spec(
        axes={"trainer": ["torch", "deepspeed"], "world_size": [2], "micro_batch_size": [2], "zero_stage": [2]},
        cells=[
            {
                "trainer": "deepspeed",
                "world_size": 2,
                "micro_batch_size": 4,
                "zero_stage": 1,
                "fault": {"rank": 1, "step": 3, "kind": "raise"},
            },
            {
                "trainer": "torch",
                "world_size": 2,
                "micro_batch_size": 8,
                "fault": {"rank": 0, "step": 2, "kind": "exit"},
            },
            {  # a segmentation fault in native code (a read of address 0)
                "trainer": "torch",
                "world_size": 2,
                "micro_batch_size": 8,
                "fault": {"rank": 1, "step": 1, "kind": "crash"},
            },
            {
                "trainer": "torch",
                "world_size": 2,
                "micro_batch_size": 1,
                "fault": {"rank": 1, "step": 2, "kind": "hang"},
            },
            {  # an allocation that fails (out of memory) on rank 1: named so, not as rank 0's reset connection
                "trainer": "torch",
                "world_size": 2,
                "micro_batch_size": 2,
                "fault": {"rank": 1, "step": 1, "kind": "oom"},
            },
            {"trainer": "torch", "world_size": 2, "micro_batch_size": 1},
            # World 1 runs in two lanes at once (on 2 cores): a lane that loses its group goes on in a
            # fresh one while the other keeps training.
            {
                "trainer": "torch",
                "world_size": 1,
                "micro_batch_size": 2,
                "fault": {"rank": 0, "step": 2, "kind": "raise"},
            },
            {"trainer": "torch", "world_size": 1, "micro_batch_size": 4},
            {"trainer": "torch", "world_size": 1, "micro_batch_size": 8},
            {"trainer": "deepspeed", "world_size": 1, "micro_batch_size": 4, "zero_stage": 1},
        ],
        baseline={"trainer": "torch", "world_size": 2, "micro_batch_size": 4},  # every cell at world 2
        timeout_s=3,
    )
    started = time.monotonic()
    proc, report, tag = gaeq_run_here(write_matrix(spec), tmp_path / "run")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert time.monotonic() - started < 240
    cells = cells_by_id(report)
    raised = cells["deepspeed-z1-w2-mb4-ga2-fault_raise_r1_s3"]
    assert raised["verdict"] == "error"
    assert raised["reason"].startswith("rank 1 failed: RuntimeError: injected fault: rank 1 raises at step 3")
    assert "--- rank1.log" in raised["reason"] and "Traceback" in raised["reason"]
    exited = cells["torch-w2-mb8-ga1-fault_exit_r0_s2"]
    assert (exited["verdict"], exited["reason"]) == ("error", "rank 0 exited with code 17 before the cell finished")
    crashed = cells["torch-w2-mb8-ga1-fault_crash_r1_s1"]
    assert crashed["verdict"] == "error" and crashed["reason"].startswith(
        "rank 1 was killed by SIGSEGV (signal 11: a crash in native code, its Python stack in its log) before "
        "the cell finished\n--- rank1.log (its crash report) ---\nFatal Python error: Segmentation fault\n"
        "Current thread"
    ), crashed["reason"]
    assert "in inject_fault" in crashed["reason"]  # where it crashed
    oom = cells["torch-w2-mb2-ga4-fault_oom_r1_s1"]
    assert oom["verdict"] == "error" and oom["reason"].startswith(
        "out of memory at micro batch 2 (world 2): rank 1 raised RuntimeError: [enforce fail at alloc_cpu.cpp"
    ), oom["reason"]
    hung = cells["torch-w2-mb1-ga8-fault_hang_r1_s2"]
    assert hung["verdict"] == "error" and hung["reason"].startswith("timed out: no progress for 3 s")
    lane_raised = cells["torch-w1-mb2-ga8-fault_raise_r0_s2"]
    assert lane_raised["verdict"] == "error" and lane_raised["reason"].startswith(
        "rank 0 failed: RuntimeError: injected fault"
    )
    for ok in (
        "torch-w2-mb4-ga2",
        "torch-w2-mb2-ga4",
        "deepspeed-z2-w2-mb2-ga4",
        "torch-w2-mb1-ga8",
        "torch-w1-mb4-ga4",
        "torch-w1-mb8-ga2",
        "deepspeed-z1-w1-mb4-ga4",
    ):
        assert cells[ok]["verdict"] == "match", cells[ok]
    assert report["summary"]["error"] == 6
    assert leftovers(tag) == []


def test_default_matrix_from_the_readme(default_run):
    """`gaeq run --matrix experiments/ga.yaml`: both trainers, ZeRO 0-3, world 1 and 2, GA 1-8,
    the GPT variant, the controls — and what a run leaves behind."""
    proc, report, tag, out = default_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["ok"] is True
    cells = cells_by_id(report)
    assert report["summary"] == {**EXPECTED, "error": 0, "skipped": 0, "unjudged": 0}
    assert EXPECTED["diverge"] >= 2 and EXPECTED["match"] > 30

    matching = [c for c in cells.values() if c["expect"] == "match" and c["role"] == "cell"]
    for c in matching:
        assert c["verdict"] == "match", c
        # Equal up to float summation order: not bitwise, but far inside the fp32 tolerance.
        assert c["max_abs_loss_diff"] < 1e-6 and c["max_rel_grad_norm_diff"] < 1e-5, c
    assert {c["zero_stage"] for c in matching if c["trainer"] == "deepspeed"} == {0, 1, 2, 3}
    assert {c["grad_accum_steps"] for c in matching} == {1, 2, 4, 8}
    assert max(c["max_abs_loss_diff"] for c in matching) > 0  # a different split really ran

    # AdamW barely feels a uniformly scaled gradient; the grad norm does, at step 0, by GA.
    w1 = cells["torch-w1-mb4-ga8-bug_no_loss_division"]
    w2 = cells["torch-w2-mb4-ga4-bug_no_loss_division"]
    assert (w1["verdict"], w1["first_divergent_step"]) == ("diverge", 0)
    assert w1["reason"].startswith("grad norm diverged at step 0: rel 7.00e+00")
    assert w2["reason"].startswith("grad norm diverged at step 0: rel 3.00e+00")

    # Traces: one line per step, complete; DeepSpeed chatter went to the cell logs.
    trace = (out / "cells" / "deepspeed-z3-w2-mb4-ga4" / "trace.jsonl").read_text().splitlines()
    assert len(trace) == GA.problem.steps and set(json.loads(trace[0])) == {
        "step",
        "loss",
        "grad_norm",
        "lr",
        "samples",
        "seconds",
        "skipped",
        "loss_resolution",
        "comm_bytes",
        "peak_mem_bytes",
        "model_state_bytes",
        "p2p_bytes",
        "a2a_bytes",
        "bubble",
    }
    assert (out / "cells" / "deepspeed-z3-w2-mb4-ga4" / "rank1.log").exists()
    # What ran, read back from the live objects (DDP, the engine), is in report.json per cell.
    for c in cells.values():
        assert (c["ran"]["world_size"], c["ran"]["micro_batch_rows"], c["ran"]["micro_steps"]) == (
            c["world_size"],
            c["micro_batch_size"],
            c["grad_accum_steps"],
        ), c
        assert c["ran"]["intra_op_threads"] == 1  # whatever the lane (worker.set_up_rank)
        if c["trainer"] == "torch":
            assert c["ran"]["ddp"] is (c["world_size"] > 1)
        else:
            assert (c["ran"]["zero_stage"], c["ran"]["gradient_clipping"]) == (c["zero_stage"], 1.0)
    assert "DeepSpeed" not in proc.stdout
    assert (
        "gaeq verdicts" in proc.stdout
        and f"OK: {EXPECTED['match']} match, {EXPECTED['diverge']} diverge" in proc.stdout
    )
    # Artefacts for looking at the runs: one TensorBoard run per cell and per group's tolerance, the overlay figure.
    assert f"tensorboard --logdir {out / 'tb'}" in proc.stdout
    tolerances = [f"tolerance-{group}" for group in report["baselines"]]
    assert sorted(p.name for p in (out / "tb").iterdir()) == sorted([*cells, *tolerances]) and len(tolerances) == 2
    assert (out / "overlay.png").stat().st_size > 30_000
    assert leftovers(tag) == []


def test_world_1_cells_ran_in_lanes_side_by_side_each_on_cores_of_its_own(default_run):
    """As many world-1 groups as the cores hold ran at once (two on 2 cores), each pinned to its own
    cores, taking cells from one pool: every world-1 cell ran in exactly one of them."""
    proc, report, tag, out = default_run
    w1 = {c["id"] for c in report["cells"] if c["world_size"] == 1}
    lanes = plan_lanes(world_size=1, cells=len(w1), cores=sorted(os.sched_getaffinity(0)))
    logs = sorted((out / "logs").glob("group-w1-*rank0.log"))
    assert len(logs) == len(lanes)
    ran: list[set[str]] = []
    for lane, cores in enumerate(lanes):
        text = (out / "logs" / (f"group-w1-lane{lane}-rank0.log" if lane else "group-w1-rank0.log")).read_text()
        assert f"process group ready (world 1, rank 0, lane {lane}, cores {list(cores)})" in text
        ran.append(set(re.findall(r"^gaeq: cell (\S+)$", text, flags=re.M)))
    assert set().union(*ran) == w1 and sum(map(len, ran)) == len(w1)  # each cell once
    assert all(ran)  # every lane had work
