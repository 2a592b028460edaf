"""External launchers: torchrun and DeepSpeed's `deepspeed` start the ranks on `gaeq worker`.

The traces they leave must be bitwise the traces of gaeq's own launcher (loss, grad norm, lr), and
`gaeq report` must give the same verdicts.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from typer.testing import CliRunner

from gaeq.cli import app
from gaeq.matrix.load import matrix_from_dict
from gaeq.runtime.dist import free_port
from tests.helpers import ga_spec, gaeq_run
from tests.processes import gaeq_command, leftovers, new_tag, owned, run, spawn

pytestmark = pytest.mark.integration

# Cells of the default matrix: `default_run` (tests/conftest.py) is the local launcher's reference.
# World 2, and its baseline (torch, world 1, the full batch): a cluster's two kinds of launch.
SPEC = ga_spec(
    axes={"trainer": ["torch", "deepspeed"], "world_size": [2], "micro_batch_size": [8], "zero_stage": [1, 3]},
    cells=[{"trainer": "torch", "world_size": 2, "micro_batch_size": 4, "bug": "no_loss_division"}],
    noise_floor=False,
    detection_limit=False,  # these tests compare launch paths: the default run's cells, without a twin of their own
)
# The world-2 half, judged against a world-2 baseline (a cell of the default matrix too): one
# launch per test instead of two.
SPEC_W2 = ga_spec(
    axes={"trainer": ["torch", "deepspeed"], "world_size": [2], "micro_batch_size": [8], "zero_stage": [1, 3]},
    cells=[{"trainer": "torch", "world_size": 2, "micro_batch_size": 4, "bug": "no_loss_division"}],
    baseline={"trainer": "torch", "world_size": 2, "micro_batch_size": 16},
    noise_floor=False,
    detection_limit=False,  # its baseline's twin (at world 2) is not a cell of the default matrix
)


def cell_count(spec: dict) -> int:
    """Cells of a matrix (baselines included), from its expansion."""
    return len(matrix_from_dict(spec).cells)


# The DeepSpeed launcher's two-node run: ZeRO-3 across the two "hosts" and its world-2 baseline.
SPEC_W2_ZERO3 = ga_spec(
    axes={"trainer": ["deepspeed"], "world_size": [2], "micro_batch_size": [8], "zero_stage": [3]},
    baseline={"trainer": "torch", "world_size": 2, "micro_batch_size": 16},
    noise_floor=False,
    detection_limit=False,
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


def roles(run_dir) -> dict[str, str]:
    return {c["id"]: c["role"] for c in json.loads((run_dir / "report.json").read_text())["cells"]}


def same_cells(run_dir, local_run, *, excluding: tuple[str, ...] = ()) -> tuple:
    """(verdicts, traces) of `run_dir` and of the local run, over `run_dir`'s cells but `excluding`.
    A cell that is the baseline in one run and not in the other sums its grad norm in float64 in
    one only: its grad norm is left out of the bitwise comparison (its loss, lr, samples stay in)."""
    mine, theirs = verdicts(run_dir), verdicts(local_run)
    mine = {k: v for k, v in mine.items() if k not in excluding}
    traces, reference = training_traces(run_dir), training_traces(local_run)
    traces = {k: v for k, v in traces.items() if k not in excluding}
    role_of, reference_role = roles(run_dir), roles(local_run)
    for cell_id in [k for k in traces if role_of[k] != reference_role[k]]:
        traces[cell_id] = [{k: v for k, v in r.items() if k != "grad_norm"} for r in traces[cell_id]]
        reference[cell_id] = [{k: v for k, v in r.items() if k != "grad_norm"} for r in reference[cell_id]]
    return (mine, traces), ({k: theirs[k] for k in mine}, {k: reference[k] for k in traces})


FAULT = {
    "trainer": "deepspeed",
    "world_size": 2,
    "micro_batch_size": 2,
    "zero_stage": 2,
    "fault": {"rank": 1, "step": 3, "kind": "raise"},
}
"""A cell whose rank 1 raises at step 3: last of its world size, so no relaunch follows it."""


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_gaeq_run_through_an_external_launcher_gives_the_same_traces_bitwise(launcher, local_run, tmp_path):
    """Under torchrun, one cell's rank also fails: its cell is an error with the rank's reason, and
    every other cell still runs, with the local launcher's traces."""
    spec = {**SPEC_W2, "cells": [*SPEC_W2["cells"], FAULT]} if launcher == "torchrun" else SPEC_W2
    faulty = "deepspeed-z2-w2-mb2-ga8-fault_raise_r1_s3"
    (tmp_path / "m.yaml").write_text(json.dumps(spec))
    proc, report, tag = gaeq_run(tmp_path / "m.yaml", tmp_path / "run", extra=["--launcher", launcher])
    assert proc.returncode == (3 if launcher == "torchrun" else 0), proc.stdout + proc.stderr
    assert leftovers(tag) == []
    ours, reference = same_cells(tmp_path / "run", local_run, excluding=(faulty,))
    assert ours == reference
    assert len(ours[1]) == cell_count(SPEC_W2)
    assert f"{launcher}-w2.log" in os.listdir(tmp_path / "run" / "logs")
    if launcher == "torchrun":
        failed = {c["id"]: c for c in report["cells"]}[faulty]
        assert failed["verdict"] == "error"
        assert failed["reason"].startswith("rank 1 failed: RuntimeError: injected fault: rank 1 raises at step 3"), (
            failed["reason"]
        )


def worker_launch(launcher: str, matrix, out, *, node_rank: int, nodes: int, port: int, hostfile=None) -> list[str]:
    """docs/where-it-runs.md's "On a cluster" commands: `gaeq worker` under torchrun or DeepSpeed's launcher,
    as node `node_rank` of `nodes` (one rank a node), meeting at 127.0.0.1:`port`."""
    worker = ["--module", "gaeq", "worker", "--matrix", str(matrix), "--out", str(out)]
    if launcher == "torchrun" and nodes == 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *worker]
    if launcher == "torchrun":  # each node's agent; c10d rendezvous, as `--nnodes 2` on a cluster
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node_rank", str(node_rank),
                "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                "--rdzv_id", f"gaeq-{port}", *worker]  # fmt: skip
    # DeepSpeed's launcher with a hostfile, started on each node itself (--no_ssh): its pdsh/ssh
    # runner, which would start the other nodes for it, has no second host to reach here.
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
            "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--no_local_rank", *worker]  # fmt: skip


def launch(*launches: list[str]) -> None:
    """Launch commands started at once, owned by the test (stopped whatever happens); each must succeed."""
    with owned(new_tag()) as tag:
        procs = [spawn(cmd, tag=tag, env={"DS_ACCELERATOR": "cpu"}) for cmd in launches]
        for cmd, proc in zip(launches, procs):
            stdout, stderr = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{' '.join(cmd[2:5])}:\n{stdout[-3000:]}{stderr[-3000:]}"
        assert leftovers(tag) == []


def nodes(launcher: str, matrix, out, *, count: int, hostfile=None) -> list[list[str]]:
    """Every node's launch of one world size, meeting at a free port of 127.0.0.1."""
    port = free_port()
    return [
        worker_launch(launcher, matrix, out, node_rank=n, nodes=count, port=port, hostfile=hostfile)
        for n in range(count)
    ]


def test_the_cluster_recipe_run_as_two_nodes_gives_the_local_traces_bitwise(local_run, tmp_path):
    """What a cluster does (docs/where-it-runs.md, "On a cluster"), with two nodes of one rank each on this
    machine: the baseline launched on its own (`torchrun --standalone`) while world 2 runs as two
    torchrun agents (c10d rendezvous), all into the same shared directory, then `gaeq report`; and
    world 2 as DeepSpeed's launcher on each of two hosts of a hostfile. Traces bitwise those of
    gaeq's own launcher, verdicts the same."""
    matrix, shared = tmp_path / "m.yaml", tmp_path / "shared"
    matrix.write_text(json.dumps(SPEC))
    # the baseline on one node, world 2 on two others, at the same time
    launch(*nodes("torchrun", matrix, shared, count=1), *nodes("torchrun", matrix, shared, count=2))
    report = CliRunner().invoke(app, ["report", str(shared)])
    assert report.exit_code == 0, report.output
    ours, reference = same_cells(shared, local_run)
    assert ours == reference and len(ours[1]) == cell_count(SPEC)

    # A hostfile names each host once (DeepSpeed refuses a host named twice): two names of this machine.
    hostfile, ds_shared = tmp_path / "hostfile", tmp_path / "ds_shared"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    matrix_w2 = tmp_path / "m_w2.yaml"
    matrix_w2.write_text(json.dumps(SPEC_W2_ZERO3))
    launch(*nodes("deepspeed", matrix_w2, ds_shared, count=2, hostfile=hostfile))
    report = CliRunner().invoke(app, ["report", str(ds_shared)])
    assert report.exit_code == 0, report.output
    ours, reference = same_cells(ds_shared, local_run)
    assert ours == reference and len(ours[1]) == cell_count(SPEC_W2_ZERO3)


def test_worker_outside_a_launcher_says_so(tmp_path, monkeypatch):
    (tmp_path / "m.yaml").write_text(json.dumps(SPEC))
    cmd = gaeq_command("worker", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "o"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    proc = run(cmd, timeout=120)
    assert proc.returncode == 2
    assert "not started by a launcher: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run(
        cmd,
        timeout=120,
        env={"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    )
    assert proc.returncode == 2 and "no cell of world size 4 to run (the matrix has world sizes [1, 2])" in proc.stderr
