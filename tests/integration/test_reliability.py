"""Interruption and resume, concurrent runs, determinism."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import small_spec
from tests.integration.test_run import leftover_processes, start_gaeq

pytestmark = pytest.mark.integration

TRAINING = ("step", "loss", "grad_norm", "lr", "samples")


def training(trace_path) -> list[dict]:
    return [{k: json.loads(line)[k] for k in TRAINING} for line in trace_path.read_text().splitlines()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_run_leaves_only_complete_files_and_resume_finishes_it(sig, write_matrix, tmp_path):
    # Two quick world-1 cells (and the baseline), then a world-2 DeepSpeed cell: the signal lands
    # as soon as that one has started.
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4, 8]},
        cells=[{"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 1}],
    )
    spec["problem"]["steps"] = 400  # the DeepSpeed cell trains for seconds: the signal lands inside it
    matrix, out = write_matrix(spec), tmp_path / "run"
    env = {**os.environ, "GAEQ_TEST_TAG": uuid.uuid4().hex}
    cmd = [sys.executable, "-m", "gaeq", "run", "--matrix", str(matrix), "--out", str(out)]
    long_cell = out / "cells" / "deepspeed-z1-w2-mb2-ga4"
    proc = start_gaeq(cmd[3:], tag=env["GAEQ_TEST_TAG"])  # SIGINT as in a terminal, however pytest was started
    deadline = time.monotonic() + 300
    while not (long_cell / "rank0.log").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(sig)
    started = time.monotonic()
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert time.monotonic() - started < 30, "ranks were not stopped promptly"
    assert "interrupted" in output and f"--out {out} --resume" in output
    assert leftover_processes(env["GAEQ_TEST_TAG"]) == []
    assert not (out / "report.json").exists() and not (out / "report.md").exists()
    # Only complete files: every published trace has all its steps; no outcome without a trace.
    finished = {}
    for cell in (out / "cells").iterdir():
        trace = cell / "trace.jsonl"
        if trace.exists():
            assert [r["step"] for r in training(trace)] == list(range(400)), cell.name
            assert json.loads((cell / "outcome.json").read_text())["status"] == "done"
            finished[cell.name] = (trace.stat().st_ino, trace.stat().st_mtime_ns)
        assert not list(cell.glob("*.json.partial"))
    assert "deepspeed-z1-w2-mb2-ga4" not in finished and len(finished) >= 2  # the quick cells finished
    if sig != signal.SIGTERM:
        return  # the files are the same whatever stopped the run: resuming them once is enough

    proc = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["summary"]["match"] == 4
    for name, stamp in finished.items():  # kept, not trained again
        trace = out / "cells" / name / "trace.jsonl"
        assert (trace.stat().st_ino, trace.stat().st_mtime_ns) == stamp, name
    assert [r["step"] for r in training(long_cell / "trace.jsonl")] == list(range(400))


def test_resume_refuses_another_matrix(write_matrix, tmp_path):
    out = tmp_path / "run"
    (out / "cells").mkdir(parents=True)
    (out / "matrix.yaml").write_text(yaml.safe_dump(small_spec(name="other")))
    proc = subprocess.run(
        [sys.executable, "-m", "gaeq", "run", "--matrix", str(write_matrix(small_spec())), "--out", str(out), "--resume"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 2 and "holds a run of another matrix" in proc.stderr, proc.stderr


def test_two_runs_at_once_do_not_collide_and_fp32_traces_are_bitwise_identical(write_matrix, tmp_path):
    """Same matrix, same second, same working directory, default run directory: two distinct runs
    (ports, directories), both green, and the same fp32 traces bit for bit."""
    spec = small_spec(axes={"trainer": ["torch", "deepspeed"], "world_size": [1, 2], "micro_batch_size": [4], "zero_stage": [2, 3]})
    matrix = write_matrix(spec)
    env = {**os.environ, "GAEQ_TEST_TAG": uuid.uuid4().hex}
    cmd = [sys.executable, "-m", "gaeq", "run", "--matrix", str(matrix)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2, runs
    traces = [{t.parent.name: training(t) for t in run.glob("cells/*/trace.jsonl")} for run in runs]
    assert len(traces[0]) == 7 and traces[0] == traces[1]
    assert leftover_processes(env["GAEQ_TEST_TAG"]) == []
