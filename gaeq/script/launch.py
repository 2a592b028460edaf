"""One cell of a user's script: its command line (the script's arguments filled for the split),
its launch under the user's launcher with gaeq's probe loaded first, and how it ended — the split
it really ran checked against the cell's before anything is compared."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gaeq.files import atomic_write
from gaeq.matrix import Cell
from gaeq.problem.spec import ProblemSpec
from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.results.trace import TRACE_FILE, cell_dir
from gaeq.runtime import lifeline
from gaeq.runtime.cells import RunOptions, fail_cell
from gaeq.runtime.dist import free_port
from gaeq.runtime.events import Event, EventKind
from gaeq.script.contract import ENV, PROBE_FILE
from gaeq.script.placeholders import fill

LOG_FILE = "script.log"
DEEPSPEED_CONFIG_FILE = "ds_config.json"


def script_command(cell: Cell, problem: ProblemSpec, *, out: Path, port: int) -> list[str]:
    """What runs the cell: the user's launcher on ``-m gaeq.script.attach SCRIPT ARGS``."""
    script = problem.script
    values = {
        "micro_batch_size": cell.micro_batch_size,
        "grad_accum_steps": cell.grad_accum_steps,
        "world_size": cell.world_size,
        "train_batch_size": cell.train_batch_size,
        "steps": problem.steps,
        "seed": problem.seed,
        "deepspeed_config": out / DEEPSPEED_CONFIG_FILE,
        "cell_dir": out,
    }
    args = [fill(a, values) for a in (*script.args, *cell.script_args)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node"]
    launcher += [str(cell.world_size), "--master_addr", "127.0.0.1", "--master_port", str(port), "-m"]
    return [*launcher, "gaeq.script.attach", script.path, *args]


def run_script_cell(cell: Cell, problem: ProblemSpec, opts: RunOptions) -> CellOutcome:
    """Launch the cell, wait for it (at most the matrix's timeout_s), and say how it ended."""
    out = cell_dir(opts.run_dir, cell.id)
    out.mkdir(parents=True, exist_ok=True)
    if problem.script.deepspeed_config is not None:
        from gaeq.problem.dsconfig import split_config

        config, _ = split_config(problem.script.deepspeed_config, cell)
        atomic_write(out / DEEPSPEED_CONFIG_FILE, json.dumps(config, indent=1))
    cmd = script_command(cell, problem, out=out, port=free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **problem.script.env}
    env[ENV] = json.dumps({"out": str(out), "steps": problem.steps})
    opts.on_event(Event(kind=EventKind.START, world_size=cell.world_size, cell_id=cell.id))
    started = time.perf_counter()
    with (out / LOG_FILE).open("wb") as log:
        # Its own session: a stalled or interrupted launch is killed with every rank it started.
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=problem.script.cwd,
            env=env,
            start_new_session=True,
            preexec_fn=lifeline.die_with_parent(),
        )
    try:
        code = proc.wait(timeout=opts.timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        _stop(proc)
    seconds = time.perf_counter() - started
    why = _why_not_done(cell, problem, out=out, code=code, timeout_s=opts.timeout_s)
    if why is not None:
        return fail_cell(
            cell.id,
            why,
            run_dir=opts.run_dir,
            logs=[out / LOG_FILE],
            seconds=seconds,
            world_size=cell.world_size,
            on_event=opts.on_event,
        )
    facts = json.loads((out / PROBE_FILE).read_text())
    ran = {"world_size": cell.world_size, "command": " ".join(cmd[cmd.index("gaeq.script.attach") + 1 :])}
    ran |= {"versions": facts.get("versions", {})}
    if code != 0:
        ran["exit"] = f"exited with code {code} after its last recorded step (a crash at exit: noted, not an error)"
    outcome = CellOutcome(status="done", seconds=seconds, ran=ran)
    write_outcome(out, outcome)
    opts.on_event(Event(kind=EventKind.END, world_size=cell.world_size, cell_id=cell.id, outcome=outcome))
    return outcome


def _why_not_done(cell: Cell, problem: ProblemSpec, *, out: Path, code: int | None, timeout_s: float) -> str | None:
    """Why the cell has no comparable result (None: it has one): it hung, stopped before its steps, or
    ran another split than its label's."""
    if code is None:
        return f"timed out: the script ran for {timeout_s:.0f} s without finishing its {problem.steps} steps"
    probe = out / PROBE_FILE
    if not probe.is_file():
        return f"the script exited with code {code} before gaeq's probe started"
    facts = json.loads(probe.read_text())
    steps = facts["steps"]
    if not steps:
        return (
            f"no optimizer step seen (the script exited with code {code}): is its training loop behind an "
            "argument gaeq did not pass, or does it step an optimizer gaeq cannot see?"
        )
    if not (out / TRACE_FILE).is_file():
        return f"the script stopped after {len(steps)} of {problem.steps} optimizer steps (exit code {code})"
    return ran_another_split(cell, steps[0])


def ran_another_split(cell: Cell, first: dict) -> str | None:
    """The split the script really ran at its first optimizer step, against the cell's."""
    if first["world_size"] != cell.world_size:
        return f"your script ran {first['world_size']} ranks, the cell {cell.world_size}"
    rows = {r for ranks in first["rows"] for r in ranks}
    if rows != {cell.micro_batch_size}:
        ran = ", ".join(map(str, sorted(rows))) or "no forward pass gaeq could see"
        return (
            f"your script ignored {{micro_batch_size}}: it ran micro-batches of {ran}, the cell {cell.micro_batch_size}"
        )
    if set(first["backward"]) != {cell.grad_accum_steps}:
        ran = ", ".join(map(str, sorted(set(first["backward"]))))
        return (
            f"your script ignored {{grad_accum_steps}}: {ran} backward call(s) in its first optimizer step, the cell "
            f"{cell.grad_accum_steps}"
        )
    return None


def _stop(proc: subprocess.Popen) -> None:
    """Whatever is left of the launch — the launcher and every rank it started — is killed."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=30)
