"""Interruption and resume, concurrent runs, determinism."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from gaeq.matrix import matrix_from_dict
from tests.helpers import gaeq_run_here, small_spec, splits
from tests.processes import gaeq_command, leftovers, new_tag, owned, run, running, spawn

pytestmark = pytest.mark.integration

TRAINING = ("step", "loss", "grad_norm", "lr", "samples")
STEPS = 150


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
    spec["problem"]["steps"] = (
        STEPS  # the DeepSpeed cell is still training when the signal lands (asserted: it has no outcome)
    )
    matrix, out = write_matrix(spec), tmp_path / "run"
    cmd = gaeq_command("run", "--matrix", str(matrix), "--out", str(out))
    long_cell = out / "cells" / "deepspeed-z1-w2-mb2-ga4"
    with running(cmd, stderr=subprocess.STDOUT) as proc:  # SIGINT as in a terminal, however pytest was started
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
        assert leftovers(proc.tag) == []
    assert not (out / "report.json").exists() and not (out / "report.md").exists()
    # Only complete files: every published trace has all its steps; no outcome without a trace.
    finished = {}
    for cell in (out / "cells").iterdir():
        trace = cell / "trace.jsonl"
        if trace.exists():
            assert [r["step"] for r in training(trace)] == list(range(STEPS)), cell.name
            assert json.loads((cell / "outcome.json").read_text())["status"] == "done"
            finished[cell.name] = (trace.stat().st_ino, trace.stat().st_mtime_ns)
        assert not list(cell.glob("*.json.partial"))
    assert "deepspeed-z1-w2-mb2-ga4" not in finished and len(finished) >= 2  # the quick cells finished
    if sig != signal.SIGTERM:
        return  # the files are the same whatever stopped the run: resuming them once is enough

    proc, report, _ = gaeq_run_here(matrix, out, extra=["--resume"])  # the same CLI, on the session's fork server
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert report["ok"] and report["summary"]["match"] == len(splits(matrix_from_dict(spec).cells))
    for name, stamp in finished.items():  # kept, not trained again
        trace = out / "cells" / name / "trace.jsonl"
        assert (trace.stat().st_ino, trace.stat().st_mtime_ns) == stamp, name
    assert [r["step"] for r in training(long_cell / "trace.jsonl")] == list(range(STEPS))


def test_resume_refuses_another_matrix(write_matrix, tmp_path):
    out = tmp_path / "run"
    (out / "cells").mkdir(parents=True)
    (out / "matrix.yaml").write_text(yaml.safe_dump(small_spec(name="other")))
    proc = run(
        gaeq_command("run", "--matrix", str(write_matrix(small_spec())), "--out", str(out), "--resume"), timeout=120
    )
    assert proc.returncode == 2 and "holds a run of another matrix" in proc.stderr, proc.stderr


def test_two_runs_at_once_do_not_collide_and_fp32_traces_are_bitwise_identical(write_matrix, tmp_path):
    """Same matrix, same second, same working directory, default run directory: two distinct runs
    (ports, directories), both green, and the same fp32 traces bit for bit.

    The matrix is SGD with momentum judged on the loss alone: DeepSpeed matches torch there too,
    and the missing ÷ GA is caught on the loss once the first update has been made."""
    spec = small_spec(
        axes={"trainer": ["torch", "deepspeed"], "world_size": [1, 2], "micro_batch_size": [4], "zero_stage": [3]},
        cells=[{"trainer": "torch", "world_size": 2, "micro_batch_size": 4, "bug": "no_loss_division"}],
        tolerances={"fp32": {"grad_norm_rtol": 1e9}},  # judge on the loss alone
    )
    spec["problem"]["optimizer"] = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
    matrix = write_matrix(spec)
    cmd = gaeq_command("run", "--matrix", str(matrix))
    with owned(new_tag()) as tag:
        procs = [spawn(cmd, tag=tag, stderr=subprocess.STDOUT, cwd=tmp_path) for _ in range(2)]
        outputs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        assert leftovers(tag) == []
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2, runs
    traces = [{t.parent.name: training(t) for t in run.glob("cells/*/trace.jsonl")} for run in runs]
    assert len(traces[0]) == len(matrix_from_dict(spec).cells) and traces[0] == traces[1]
    cells = {c["id"]: c for c in json.loads((runs[0] / "report.json").read_text())["cells"]}
    assert {c["verdict"] for c in cells.values() if c["trainer"] == "deepspeed"} == {"match"}
    control = cells["torch-w2-mb4-ga2-bug_no_loss_division"]
    assert control["verdict"] == "diverge" and control["reason"].startswith("loss diverged at step 1"), control
    assert control["max_abs_loss_diff"] > 1e-3


@contextmanager
def endless_run(write_matrix, tmp_path, *, trainer="deepspeed", world_size=2, signals=None, model=None):
    """`gaeq run` on one cell that trains until stopped (a DeepSpeed world-2 cell unless told
    otherwise), owned by the test: yields (proc, trace being written) once it trains, and stops
    it with everything it started when the block ends, however it ends."""
    cell = {"trainer": trainer, "world_size": world_size, "micro_batch_size": 2}
    if trainer == "deepspeed":
        cell["zero_stage"] = 1
    spec = small_spec(axes={k: [v] for k, v in cell.items()}, baseline=cell)
    spec["problem"]["steps"] = 100_000
    if model is not None:
        spec["problem"]["model"] = model
    out = tmp_path / "run"
    cmd = gaeq_command("run", "--matrix", str(write_matrix(spec)), "--out", str(out))
    with running(cmd, signals=signals, stderr=subprocess.STDOUT) as proc:
        partial = None
        deadline = time.monotonic() + 300
        while partial is None or partial.stat().st_size == 0:
            assert proc.poll() is None and time.monotonic() < deadline, "the cell never started training"
            time.sleep(0.2)
            partial = next(out.glob("cells/*/trace.jsonl.partial"), None)
        yield proc, partial


def still_training(proc, partial, seconds: float = 2.0) -> bool:
    size = partial.stat().st_size
    time.sleep(seconds)
    return proc.poll() is None and partial.stat().st_size > size


def test_a_run_started_with_sigint_ignored_keeps_it_ignored_and_stops_on_sighup(write_matrix, tmp_path):
    """The choice (docs/where-it-runs.md, "Signals"): a background run (`gaeq run … &` from a script, a CI
    runner) inherits SIGINT ignored and keeps it so — a stray Ctrl-C in that terminal does not stop
    it; SIGHUP (its terminal closed) and SIGTERM always do. Which signals stop a run is the CLI's,
    whatever the cell: a world-1 torch cell is enough."""
    ignored = {signal.SIGINT: signal.SIG_IGN}
    with endless_run(write_matrix, tmp_path, trainer="torch", world_size=1, signals=ignored) as (proc, partial):
        proc.send_signal(signal.SIGINT)
        assert still_training(proc, partial), "SIGINT stopped a run that was started with it ignored"
        proc.send_signal(signal.SIGHUP)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "interrupted" in output, output
        assert leftovers(proc.tag) == []
    assert not (tmp_path / "run" / "report.json").exists()


def test_a_run_under_nohup_keeps_both_ignored_and_a_failing_test_leaves_nothing_running(write_matrix, tmp_path):
    """`nohup gaeq run … &`: SIGHUP and SIGINT inherited ignored stay ignored. And the suite's own
    guarantee (tests/processes.py): a test body that fails while its run trains — here on purpose —
    still stops gaeq, its fork server and its rank (with SIGTERM, which stops even a nohup run).
    Which signals stop a run is the CLI's, whatever the cell: a world-1 torch cell is enough."""
    ignored = {signal.SIGINT: signal.SIG_IGN, signal.SIGHUP: signal.SIG_IGN}
    with pytest.raises(AssertionError, match="on purpose"):
        with endless_run(write_matrix, tmp_path, trainer="torch", world_size=1, signals=ignored) as (proc, partial):
            tag = proc.tag
            proc.send_signal(signal.SIGHUP)
            proc.send_signal(signal.SIGINT)
            assert still_training(proc, partial), "a signal the run was started with ignored stopped it"
            assert len(leftovers(tag, grace=0)) >= 3  # gaeq, its fork server, the rank
            raise AssertionError("a test failing on purpose while its run trains")
    assert proc.returncode == 130  # stopped by SIGTERM as an interrupted run, not killed
    assert leftovers(tag, grace=0) == []


def test_a_killed_gaeq_takes_every_process_with_it_and_the_next_run_frees_its_shared_memory(write_matrix, tmp_path):
    """kill -9 on `gaeq` (an OOM killer, a scheduler) during a DeepSpeed world-2 cell: the fork
    server and both ranks watch gaeq itself and are gone within seconds, each rank with the helper
    process it started (a JIT compile's stand-in); the shared memory they leave (a killed gaeq frees
    nothing) is freed by the next `gaeq run`, which says so."""
    helper = {"import": "tests.plugin_models:with_a_helper", "args": {"in_features": 8, "out_features": 2}}
    with endless_run(write_matrix, tmp_path, model=helper) as (proc, partial):
        helpers = [pid for pid in leftovers(proc.tag, grace=0) if Path(f"/proc/{pid}/comm").read_text() == "sleep\n"]
        assert len(helpers) == 2  # one per rank
        markers = [
            m for m in Path("/dev/shm").glob(f"gaeq_group_{os.getuid()}_*") if m.read_text().split()[0] == str(proc.pid)
        ]
        assert len(markers) == 1, markers
        port = markers[0].name.rsplit("_", 1)[1]
        left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))
        assert len(left) == 2  # one 66 MB segment per rank

        megabytes = round(sum(path.stat().st_size for path in left) / 2**20)  # 2 × 66
        proc.kill()
        proc.wait(timeout=10)
        assert leftovers(proc.tag, grace=10) == []  # fork server, ranks: nothing keeps training
    assert all(path.exists() for path in left)

    spec = small_spec(axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4]})
    freed_beside = not any(path.exists() for path in left)  # a `gaeq run` beside the suite frees them first
    next_run, report, _ = gaeq_run_here(write_matrix(spec, "next.yaml"), tmp_path / "next")
    assert next_run.returncode == 0, next_run.stdout + next_run.stderr
    said = re.search(
        r"freed (\d+) MB of /dev/shm: (\d+) all-reduce buffers? that (.*) left, ended without", next_run.stdout
    )
    assert freed_beside or (said and f"gaeq {proc.pid} (its group started " in said[3]), next_run.stdout
    assert freed_beside or (int(said[1]) >= megabytes and int(said[2]) >= 2)  # (and any other killed run's)
    assert not any(path.exists() for path in left) and not markers[0].exists()
