"""What the tests share: matrices, and running `gaeq` as a user does (a tagged child process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch
import yaml

from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.trainers import RunContext, trainer_for


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


def ga_spec(**overrides) -> dict:
    """experiments/ga.yaml's problem with other axes/cells: its cells are cells of the suite's
    `default_run` (tests/conftest.py), whose traces theirs must equal bitwise."""
    problem = yaml.safe_load((REPO_ROOT / "experiments" / "ga.yaml").read_text())["problem"]
    return {"name": "ga-subset", "problem": problem, **overrides}


def run_in_process(matrix, run_dir):
    """Train every runnable cell of a world-size-1 matrix in this process; return their outcomes
    (a cell that raises is an `error`, as in a rank)."""
    outcomes = {}
    for cell in matrix.runnable():
        cell_dir = run_dir / "cells" / cell.id
        cell_dir.mkdir(parents=True)
        ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), cell_dir=cell_dir, run_dir=run_dir)
        try:
            ran = trainer_for(cell.trainer)(cell=cell, problem=matrix.problems[cell.variant], ctx=ctx)
        except Exception as exc:  # noqa: BLE001 - reported like a failed rank
            outcomes[cell.id] = CellOutcome(status="error", seconds=0.0, reason=f"{type(exc).__name__}: {exc}")
        else:
            outcomes[cell.id] = CellOutcome(status="done", seconds=0.0, ran=ran)
        write_outcome(cell_dir, outcomes[cell.id])
    return outcomes


def deepspeed_shm() -> set[str]:
    """This user's /dev/shm segments of DeepSpeed's CPU comm op (66 MB per rank and group)."""
    return {p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*")}


def gaeq_run(matrix: Path, out: Path, *, timeout: float = 600, extra: list[str] = ()) -> tuple[subprocess.CompletedProcess, dict, str]:
    """Run the CLI in a child process tagged with a unique environment marker (to find leftovers).

    Every run checks that it left no DeepSpeed shared memory behind (DeepSpeed never frees its
    segments; gaeq does — under an external launcher too): none appeared that was not there before."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "GAEQ_TEST_TAG": tag, "COLUMNS": "200"}
    shm_before = deepspeed_shm()
    proc = subprocess.run(
        [sys.executable, "-m", "gaeq", "run", "--matrix", str(matrix), "--out", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    assert deepspeed_shm() <= shm_before, f"left in /dev/shm: {sorted(deepspeed_shm() - shm_before)}"
    return proc, report, tag


PRELOAD_EVERYTHING = (
    "gaeq.runtime.preload",
    "gaeq.runtime.preload_deepspeed",
    "gaeq.runtime.preload_accelerate",
    "gaeq.runtime.preload_hf",
    "gaeq.trainers.hf_trainer",
)


def gaeq_run_here(matrix: Path, out: Path, *, extra: list[str] = ()) -> tuple[subprocess.CompletedProcess, dict, str]:
    """`gaeq run` through the CLI in this process (typer's CliRunner): the same code path, exit code
    and output as :func:`gaeq_run`, but the ranks fork from this session's fork server — started
    once, with every preload — instead of a new one per run (3-5 s of imports each time).

    For tests of a run's results and output. Tests about processes (signals, launchers, the README's
    own command) or that set environment variables for the ranks (they inherit the server's
    environment, not the test's) run `gaeq` as a child with :func:`gaeq_run`. Returns no tag: nothing
    this run starts carries an environment tag, so the returned tag names the fork server instead:
    :func:`leftover_processes` then lists its children still alive (every rank is one). The CLI's
    signal handlers are put back afterwards."""
    from multiprocessing import forkserver

    from typer.testing import CliRunner

    from gaeq.cli import app
    from gaeq.runtime import launch, lifeline

    lifeline.mark_parent()  # the session's fork server and its ranks die with pytest
    launch._context(isolate=False, preload=PRELOAD_EVERYTHING)
    forkserver.ensure_running()
    shm_before = deepspeed_shm()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        result = CliRunner().invoke(app, ["run", "--matrix", str(matrix), "--out", str(out), *extra], catch_exceptions=False)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    assert deepspeed_shm() <= shm_before, f"left in /dev/shm: {sorted(deepspeed_shm() - shm_before)}"
    proc = subprocess.CompletedProcess(["gaeq", "run"], result.exit_code, result.stdout, result.stderr)
    return proc, report, f"{CHILDREN_OF}{forkserver._forkserver._forkserver_pid}"


CHILDREN_OF = "children-of:"
"""A tag of :func:`gaeq_run_here`: the processes it started are the children of this pid."""


def start_gaeq(args: list[str], *, tag: str, sigint=signal.SIG_DFL, **popen) -> subprocess.Popen:
    """Start ``python -m gaeq ARGS`` tagged, with SIGINT's disposition set explicitly: a child
    inherits an ignored SIGINT from a background job or CI runner (and then keeps it ignored, see
    gaeq.cli._stop_on_signals), so a test that means Ctrl-C must not depend on how pytest started."""
    return subprocess.Popen(
        [sys.executable, "-m", "gaeq", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "GAEQ_TEST_TAG": tag, **popen.pop("env", {})},
        cwd=popen.pop("cwd", REPO_ROOT),
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
        **popen,
    )


def leftover_processes(tag: str, *, grace: float = 5.0) -> list[int]:
    """PIDs of live processes that inherited the tag (every rank gaeq started would have) — or,
    for a tag of :func:`gaeq_run_here`, the fork server's live children."""
    if tag.startswith(CHILDREN_OF):
        parent = int(tag.removeprefix(CHILDREN_OF))
        return _live_processes(lambda proc: _child_of(proc, parent), grace=grace)
    marker = f"GAEQ_TEST_TAG={tag}".encode()
    return _live_processes(lambda proc: marker in (proc / "environ").read_bytes(), grace=grace)


def _child_of(proc: Path, parent: int) -> bool:
    stat = (proc / "stat").read_text()
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]  # after "pid (comm) "
    return int(ppid) == parent and state != "Z"


def _live_processes(matches, *, grace: float) -> list[int]:
    """PIDs of /proc entries that `matches`, polled until none is left or `grace` seconds pass."""
    deadline = time.monotonic() + grace
    while True:
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if matches(entry):
                    pids.append(int(entry.name))
            except OSError:  # the process ended while we looked
                continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


def cells_by_id(report: dict) -> dict[str, dict]:
    return {c["id"]: c for c in report["cells"]}
