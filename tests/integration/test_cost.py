"""Cost columns: bytes through the collectives checked against arithmetic; --isolate."""

from __future__ import annotations

import json

import pytest

from gaeq.matrix import load_matrix
from gaeq.problem.models import MLP
from gaeq.problem.spec import MLPSpec
from gaeq.results.trace import read_trace
from tests.helpers import REPO_ROOT, cells_by_id, ga_at_test_size, ga_spec, gaeq_run_here

pytestmark = pytest.mark.integration

# experiments/ga.yaml's MLP: 16 → 64 → 64 → 4, fp32
PARAM_BYTES = 4 * sum(
    p.numel() for p in MLP(MLPSpec(hidden=64, depth=2), in_features=16, out_features=4, seed=0).parameters()
)
SCALARS = 64  # a few scalar reductions (DeepSpeed's grad-norm all-reduce, overflow checks)


def test_bytes_communicated_per_optimizer_step(default_run):
    """Every MLP cell of the default matrix (torch and ZeRO 0-3, world 1 and 2, GA 1-8)."""
    proc, report, _, out = default_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    P = PARAM_BYTES
    cells = {i: c for i, c in cells_by_id(report).items() if c["variant"] == "base"}
    assert len(cells) == sum(c.variant == "base" for c in load_matrix(REPO_ROOT / "experiments" / "ga.yaml").cells)
    assert {c["zero_stage"] for c in cells.values()} == {None, 0, 1, 2, 3}
    for cell_id, cell in cells.items():
        steps = [r.comm_bytes for r in read_trace(out / "cells" / cell_id)]
        ga = cell["grad_accum_steps"]
        if cell["world_size"] == 1:
            assert set(steps) == {0}, cell_id  # a single process sends nothing
        elif cell["trainer"] == "torch":
            assert set(steps) == {P}, cell_id  # one all-reduce per optimizer step (no_sync), whatever GA
        elif cell["zero_stage"] == 0:
            assert all(P <= b <= P + SCALARS for b in steps), (cell_id, steps)  # one all-reduce at the boundary
        elif cell["zero_stage"] == 1:
            assert all(2 * P <= b <= 2 * P + SCALARS for b in steps), (
                cell_id,
                steps,
            )  # reduce-scatter + all-gather at the boundary
        elif cell["zero_stage"] == 2:
            assert all((ga + 1) * P <= b <= (ga + 1) * P + SCALARS for b in steps), (
                cell_id,
                steps,
            )  # reduces every micro-step
        else:  # ZeRO-3: per micro-step one all-gather of the parameters and one reduce-scatter, once
            # it has traced its parameter fetches (the first two steps gather more)
            assert all(2 * ga * P <= b <= 2 * ga * P + SCALARS for b in steps[2:]), (cell_id, steps)
            assert steps[0] >= steps[2]
        assert cell["comm_bytes_per_step"] == pytest.approx(sum(steps) / len(steps))
        assert cell["samples_per_s"] > 0 and cell["step_seconds"] > 0 and cell["peak_mem_bytes"] > 50 * 2**20
    assert "comm KB/step" in proc.stdout and "samples/s" in proc.stdout


def test_isolate_runs_one_group_per_cell_and_changes_no_number(write_matrix, tmp_path, default_run):
    """Cells of the default matrix, each in a fresh process group: their traces are bitwise those
    of the default run, where they shared groups with 38 other cells — the world-1 GPT cell there
    in a lane beside another, pinned to one core, here alone with every core (its traces differ
    bitwise between 1 and 2 intra-op threads: a rank always has one)."""
    *_, shared = default_run
    gpt = ga_at_test_size()["variants"]["gpt"]
    spec = ga_spec(
        axes={"trainer": ["deepspeed"], "world_size": [2], "micro_batch_size": [4], "zero_stage": [1]},
        baseline={"trainer": "torch", "world_size": 2, "micro_batch_size": 16},
        variants={"gpt": {**gpt, "baseline": {"trainer": "torch", "world_size": 1, "micro_batch_size": 4}}},
        cells=[{"variant": "gpt", "trainer": "torch", "world_size": 1, "micro_batch_size": 4}],
        noise_floor=False,
        detection_limit=False,  # cells of the default run only: their traces are the point, not verdicts
    )
    isolated = tmp_path / "isolated"
    proc, report_isolated, _ = gaeq_run_here(write_matrix(spec), isolated, extra=["--isolate"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(c["id"] for c in report_isolated["cells"]) == [
        "deepspeed-z1-w2-mb4-ga4",
        "torch-w1-mb4-ga8@gpt",
        "torch-w2-mb16-ga1",
    ]
    roles = {c["id"]: c["role"] for c in default_run[1]["cells"]}
    for cell in report_isolated["cells"]:
        a = [(r.step, r.loss, r.grad_norm) for r in read_trace(shared / "cells" / cell["id"])]
        b = [(r.step, r.loss, r.grad_norm) for r in read_trace(isolated / "cells" / cell["id"])]
        if cell["role"] == roles[cell["id"]]:
            assert a == b, cell["id"]  # bitwise: a fresh process group, other cores, change nothing
        else:  # the baseline here, a cell there: its norm summed in float64 here, float32 there (never clipping)
            assert [x[:2] for x in a] == [x[:2] for x in b], cell["id"]
            assert all(abs(x[2] / y[2] - 1) < 1e-6 for x, y in zip(a, b)), cell["id"]
    # Each cell started its own group: the world-2 group log holds one start-up per world-2 cell.
    starts = (isolated / "logs" / "group-w2-rank0.log").read_text().count("gaeq: process group ready")
    assert starts == 2
    verdicts = {c["id"]: c["verdict"] for c in json.loads((shared / "report.json").read_text())["cells"]}
    assert {c["id"]: c["verdict"] for c in report_isolated["cells"]} == {
        c["id"]: verdicts[c["id"]] for c in report_isolated["cells"]
    }
