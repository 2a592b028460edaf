"""External launchers: torchrun and DeepSpeed's `deepspeed` start the ranks on `gaeq worker`.

The traces they leave must be bitwise the traces of gaeq's own launcher (loss, grad norm, lr), and
`gaeq report` must give the same verdicts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from tests.conftest import REPO
from tests.helpers import ga_spec, gaeq_run, leftover_processes, small_spec

pytestmark = pytest.mark.integration

# Cells of the default matrix: `default_run` (tests/conftest.py) is the local launcher's reference.
SPEC = ga_spec(
    axes={"trainer": ["torch", "deepspeed"], "world_size": [1, 2], "micro_batch_size": [8], "zero_stage": [1, 3]},
    cells=[{"trainer": "torch", "world_size": 2, "micro_batch_size": 4, "bug": "no_loss_division"}],
)
# The world-2 half, judged against a world-2 baseline (a cell of the default matrix too): one
# launch per test instead of two.
SPEC_W2 = ga_spec(
    axes={"trainer": ["torch", "deepspeed"], "world_size": [2], "micro_batch_size": [8], "zero_stage": [1, 3]},
    cells=[{"trainer": "torch", "world_size": 2, "micro_batch_size": 4, "bug": "no_loss_division"}],
    baseline={"trainer": "torch", "world_size": 2, "micro_batch_size": 16},
)
SAME = ("step", "loss", "grad_norm", "lr", "samples")  # seconds, bytes and memory are measurements


def training_traces(run_dir) -> dict[str, list[dict]]:
    return {
        p.parent.name: [{k: json.loads(line)[k] for k in SAME} for line in p.read_text().splitlines()]
        for p in sorted((run_dir / "cells").glob("*/trace.jsonl"))
    }


def verdicts(run_dir) -> dict[str, str]:
    return {c["id"]: c["verdict"] for c in json.loads((run_dir / "report.json").read_text())["cells"]}


@pytest.fixture
def local_run(default_run):
    """The same cells run by gaeq's own launcher (in the default matrix), restricted to SPEC's."""
    *_, out = default_run
    return out


def same_cells(run_dir, local_run) -> tuple:
    """(verdicts, traces) of `run_dir` and of the local run, over `run_dir`'s cells."""
    mine, theirs = verdicts(run_dir), verdicts(local_run)
    traces, reference = training_traces(run_dir), training_traces(local_run)
    return (mine, traces), ({k: theirs[k] for k in mine}, {k: reference[k] for k in traces})


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_gaeq_run_through_an_external_launcher_gives_the_same_traces_bitwise(launcher, local_run, tmp_path):
    (tmp_path / "m.yaml").write_text(json.dumps(SPEC_W2))
    proc, report, tag = gaeq_run(tmp_path / "m.yaml", tmp_path / "run", extra=["--launcher", launcher])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours, reference = same_cells(tmp_path / "run", local_run)
    assert ours == reference
    assert len(ours[1]) == 5  # 4 cells + the baseline
    assert f"{launcher}-w2.log" in os.listdir(tmp_path / "run" / "logs")
    assert leftover_processes(tag) == []


def test_launchers_started_by_hand_then_gaeq_report(local_run, tmp_path):
    """What a cluster does: each world size launched on its own (here torchrun for world 1,
    DeepSpeed's launcher for world 2) into one shared run directory; then `gaeq report` judges it."""
    matrix, out = tmp_path / "m.yaml", tmp_path / "shared"
    matrix.write_text(json.dumps(SPEC))
    env = {**os.environ, "GAEQ_TEST_TAG": uuid.uuid4().hex, "DS_ACCELERATOR": "cpu"}
    worker = ["--module", "gaeq", "worker", "--matrix", str(matrix), "--out", str(out)]
    launches = [
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *worker],
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank", *worker],
    ]
    for cmd in launches:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = subprocess.run([sys.executable, "-m", "gaeq", "report", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert report.returncode == 0, report.stdout + report.stderr
    ours, reference = same_cells(out, local_run)
    assert ours == reference and len(ours[1]) == 8
    assert leftover_processes(env["GAEQ_TEST_TAG"]) == []


def test_a_rank_that_fails_under_torchrun_errors_its_cell_and_the_rest_still_run(tmp_path):
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [2], "micro_batch_size": [4, 8]},
        cells=[{"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 2, "fault": {"rank": 1, "step": 3, "kind": "raise"}}],
        baseline={"trainer": "torch", "world_size": 2, "micro_batch_size": 8},  # one launch: world 2 only
    )
    (tmp_path / "m.yaml").write_text(json.dumps(spec))
    proc, report, tag = gaeq_run(tmp_path / "m.yaml", tmp_path / "run", extra=["--launcher", "torchrun"])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    cells = {c["id"]: c for c in report["cells"]}
    failed = cells["deepspeed-z2-w2-mb2-ga4-fault_raise_r1_s3"]
    assert failed["verdict"] == "error"
    assert failed["reason"].startswith("rank 1 failed: RuntimeError: injected fault: rank 1 raises at step 3"), failed["reason"]
    assert {c["verdict"] for i, c in cells.items() if i != failed["id"]} == {"match"}
    assert leftover_processes(tag) == []


def test_worker_outside_a_launcher_says_so(tmp_path):
    (tmp_path / "m.yaml").write_text(json.dumps(SPEC))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "gaeq", "worker", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "not started by a launcher: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" in proc.stderr
    assert "Traceback" not in proc.stderr
    env.update(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "gaeq", "worker", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2 and "no cell of world size 4 to run (the matrix has world sizes [1, 2])" in proc.stderr
