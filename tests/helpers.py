"""What the tests share: matrices, and running `gaeq` as a user does (a child process, tests/processes.py)
or in this process on the session's fork server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import yaml

from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.trainers import RunContext
from tests.processes import CHILDREN_OF, gaeq_command, new_tag, running, start_session_fork_server

REPO_ROOT = Path(__file__).resolve().parents[1]


def small_spec(**overrides) -> dict:
    """A quick matrix: B=16, 12 steps, AdamW + warmup-cosine + clipping, both trainers."""
    spec = {
        "name": "small",
        "problem": {
            "model": {"kind": "mlp", "hidden": 16, "depth": 2},
            "data": {"kind": "regression", "in_features": 8, "out_features": 2},
            "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
            "schedule": {"name": "warmup_cosine", "warmup_steps": 3, "min_lr_ratio": 0.1},
            "gradient_clipping": 1.0,
            "steps": 12,
            "seed": 7,
            "train_batch_size": 16,
        },
        "axes": {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4]},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


GA_STEPS, GA_SAMPLES, GA_GPT_STEPS = 12, 256, 10
"""experiments/ga.yaml at the suite's size (50 and 30 steps in the file, 1024 samples): every claim the tests
check of it holds from step 0 (the controls are caught at steps 0-2), and 256 samples are an epoch of 8
steps, so the run still crosses an epoch's reshuffle as the file's does at step 32."""


def ga_at_test_size() -> dict:
    """experiments/ga.yaml, its cells as they are, at GA_STEPS / GA_SAMPLES / GA_GPT_STEPS."""
    spec = yaml.safe_load((REPO_ROOT / "experiments" / "ga.yaml").read_text())
    spec["problem"]["steps"], spec["problem"]["data"]["num_samples"] = GA_STEPS, GA_SAMPLES
    spec["variants"]["gpt"]["problem"]["steps"] = GA_GPT_STEPS
    return spec


def ga_spec(**overrides) -> dict:
    """experiments/ga.yaml's problem (at the suite's size) with other axes/cells: its cells are cells of the
    suite's `default_run` (tests/conftest.py), whose traces theirs must equal bitwise."""
    return {"name": "ga-subset", "problem": ga_at_test_size()["problem"], **overrides}


def run_in_process(matrix, run_dir):
    """Train every runnable cell of a world-size-1 matrix in this process; return their outcomes
    (a cell that raises is an `error`, as in a rank)."""
    from gaeq.runtime.worker import train

    outcomes = {}
    for cell in matrix.runnable():
        cell_dir = run_dir / "cells" / cell.id
        cell_dir.mkdir(parents=True)
        ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), cell_dir=cell_dir, run_dir=run_dir)
        try:
            ran = train(cell, matrix.problems[cell.variant], ctx)  # as a rank trains it
        except Exception as exc:  # noqa: BLE001 - reported like a failed rank
            outcomes[cell.id] = CellOutcome(status="error", seconds=0.0, reason=f"{type(exc).__name__}: {exc}")
        else:
            outcomes[cell.id] = CellOutcome(status="done", seconds=0.0, ran=ran)
        write_outcome(cell_dir, outcomes[cell.id])
    return outcomes


def deepspeed_shm() -> set[str]:
    """This user's /dev/shm segments of DeepSpeed's CPU comm op (66 MB per rank and group)."""
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*")}


def shm_left(before: set[str], owners: set[int], *, grace: float = 5.0) -> list[str]:
    """The segments new since `before` that a run of `owners` (its gaeq's PIDs) left behind: none a live process
    still maps, none whose group's marker names another gaeq — a `gaeq run` beside the suite, running or killed,
    is not the test's (gaeq.runtime.shm). Unmarked ones are looked at again for `grace` seconds: a plain
    DeepSpeed launch (benchmarks/lab_speed.py's, on the other xdist worker) leaves its segments a moment before
    its benchmark frees them, a leak leaves them for good."""
    from gaeq.runtime import shm

    deadline = time.monotonic() + grace
    while True:
        new = deepspeed_shm() - before
        mapped = {Path(m).name for m in shm.mapped_segments()} if new else set()
        left = sorted(s for s in new if s not in mapped and shm.owner(shm.port_of(s)) in (None, *owners))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def gaeq_run(
    matrix: Path, out: Path, *, timeout: float = 600, extra: list[str] = (), signals=None
) -> tuple[subprocess.CompletedProcess, dict, str]:
    """Run the CLI in a child process (tests/processes.py: tagged, known signal dispositions,
    stopped with everything it started whatever happens).

    Every run checks that it left no DeepSpeed shared memory behind (DeepSpeed never frees its
    segments; gaeq does — under an external launcher too): none appeared that was not there before."""
    tag = new_tag()
    shm_before = deepspeed_shm()
    cmd = gaeq_command("run", "--matrix", str(matrix), "--out", str(out), *extra)
    with running(cmd, tag=tag, signals=signals, env={"COLUMNS": "200"}) as child:
        stdout, stderr = child.communicate(timeout=timeout)
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    assert not (left := shm_left(shm_before, {child.pid})), f"left in /dev/shm: {left}"
    return proc, report, tag


def gaeq_run_here(matrix: Path, out: Path, *, extra: list[str] = ()) -> tuple[subprocess.CompletedProcess, dict, str]:
    """`gaeq run` of `matrix` into `out` in this process: :func:`gaeq_here`."""
    return gaeq_here(["run", "--matrix", str(matrix), "--out", str(out), *extra], out)


def gaeq_here(args: list[str], out: Path) -> tuple[subprocess.CompletedProcess, dict, str]:
    """`gaeq ARGS` (run, check) writing into `out`, through the CLI in this process (typer's CliRunner):
    the same code path, exit code and output as :func:`gaeq_run`, but the ranks fork from this session's
    fork server — started once, with every preload — instead of a new one per run (3-5 s of imports each time).

    For tests of a run's results and output. Tests about processes (signals, launchers, the README's
    own command) or that set environment variables for the ranks (they inherit the server's
    environment, not the test's — but for GAEQ_ACCELERATOR_FP16, which the run hands each rank: a test
    may set it here) run `gaeq` as a child with :func:`gaeq_run`. Returns no tag: nothing
    this run starts carries an environment tag, so the returned tag names the fork server instead:
    :func:`tests.processes.leftovers` then lists its children still alive (every rank is one). The CLI's
    signal handlers are put back afterwards."""
    from multiprocessing import forkserver

    from typer.testing import CliRunner

    from gaeq.cli import app

    start_session_fork_server()
    shm_before = deepspeed_shm()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        result = CliRunner().invoke(app, args, catch_exceptions=False)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    assert not (left := shm_left(shm_before, {os.getpid()})), f"left in /dev/shm: {left}"
    proc = subprocess.CompletedProcess(["gaeq", *args], result.exit_code, result.stdout, result.stderr)
    return proc, report, f"{CHILDREN_OF}{forkserver._forkserver._forkserver_pid}"


def experiment_at(name: str, folder: Path, **problem) -> Path:
    """experiments/<name>.yaml as it is but for these `problem` fields (fewer steps: the claim a test
    checks holds at its smallest size; the file keeps the size a user runs), written into `folder`. For
    experiments that name no file beside them (a script, a plugin module, a DeepSpeed config file): a
    copy elsewhere would not find it."""
    spec = yaml.safe_load((REPO_ROOT / "experiments" / f"{name}.yaml").read_text())
    assert "script" not in spec, "a script's path is relative to its experiment: the copy would not find it"
    spec["problem"] |= problem
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def experiment_corner(
    name: str, cells: list[dict], *, steps: int, tmp_path: Path, noise_floor: bool = False
) -> tuple[dict[str, dict], str]:
    """experiments/<name>.yaml with its cells replaced by `cells` and fewer steps, run through the CLI in
    this process (:func:`gaeq_run_here`) under the dtype's own tolerances — or, with `noise_floor`, widened
    by what a twin measures (where rounding depends on the machine) —: each cell's report.json entry by
    id, and the tag of what it started. A run that does not exit 0 fails the test with its output."""
    spec = yaml.safe_load((REPO_ROOT / "experiments" / f"{name}.yaml").read_text())
    spec["cells"], spec["problem"]["steps"], spec["noise_floor"] = cells, steps, noise_floor
    spec["detection_limit"] = noise_floor  # the instruments measure the run: with its floor, or not at all
    matrix = tmp_path / f"{name}.yaml"
    matrix.write_text(yaml.safe_dump(spec))
    proc, report, tag = gaeq_run_here(matrix, tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    return cells_by_id(report), tag


def not_ok(proc: subprocess.CompletedProcess, report: dict) -> str:
    """Why a run did not exit 0, for an assertion's message: each cell that was not as expected, with its whole
    reason, then the tail of what the run printed (CI keeps only the end of a failed suite's output, and a
    report's closing lines can push a cell's reason out of it)."""
    unexpected = [f"{c['id']}: {c['verdict']} — {c['reason']}" for c in report.get("cells", []) if not c["as_expected"]]
    return "\n".join(
        ["not as expected:", *unexpected, "the run's output ends:", proc.stdout[-3000:], proc.stderr[-3000:]]
    )


def cells_by_id(report: dict) -> dict[str, dict]:
    return {c["id"]: c for c in report["cells"]}


def judged(cells) -> list:
    """The matrix's own cells and baselines, gaeq's instruments left out (noise-floor twins, the detection
    limit's cell: each group has them, tests/unit/test_noise_floor.py holds what they are)."""
    from gaeq.results.cell_report import INSTRUMENTS

    return [c for c in cells if c.role not in INSTRUMENTS]


def splits(cells) -> list:
    """The splits a run judges, what its summary line counts: :func:`judged` without the baselines."""
    from gaeq.matrix import Role

    return [c for c in cells if c.role is Role.CELL]
