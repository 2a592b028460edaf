"""One cell of a user's script: its command line (the script's arguments filled for the split),
its launch under the user's launcher with gaeq's probe loaded first, and how it ended — the split
it really ran checked against the cell's before anything is compared."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterable
from multiprocessing import connection
from pathlib import Path

from gaeq.contract import ENV, FAILURE_FILE, OUT_OF_MEMORY_FILE, PROBE_FILE
from gaeq.files import atomic_write
from gaeq.matrix import Cell
from gaeq.oom import OomKill, kill_count, oom_killer, raised
from gaeq.oom import at as oom_at
from gaeq.problem.placeholders import fill
from gaeq.problem.spec import ProblemSpec
from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.results.trace import TRACE_FILE, cell_dir
from gaeq.runtime import shm
from gaeq.runtime.cells import RunOptions, fail_cell
from gaeq.runtime.crashes import how_it_ended
from gaeq.runtime.dist import free_port
from gaeq.runtime.events import Event, EventKind
from gaeq.runtime.server import preload_modules, rank_context
from gaeq.script.attach import forked_rank
from gaeq.script.launchers import command, worker_args, worker_env

LOG_FILE = "script.log"
DEEPSPEED_CONFIG_FILE = "ds_config.json"

PEERS_GRACE_S = 10.0
"""After a rank fails, how long its peers may take to fail of it (gloo tells a collective at once)."""
ROUNDING_UNIT = {"bf16": "bfloat16", "ds_bf16": "bfloat16", "fp16": "float16", "ds_fp16": "float16"}
"""The dtype a mixed-precision split rounds each micro-batch's gradient in: its twins' nudge is a unit of it."""


def script_args(cell: Cell, problem: ProblemSpec, *, out: Path) -> list[str]:
    """The script's arguments for the cell, filled for its split: every rank is what ``python -m
    gaeq.script.attach SCRIPT ARGS`` would be (the script as ``python SCRIPT ARGS`` runs it, the probe
    loaded first)."""
    values = placeholder_values(cell, problem, out=out)
    return [fill(a, values) for a in (*problem.script.args, *cell.script_args)]


def placeholder_values(cell: Cell, problem: ProblemSpec, *, out: Path) -> dict[str, object]:
    """What each placeholder of a script's arguments and files is in `cell`."""
    return {
        "micro_batch_size": cell.micro_batch_size,
        "grad_accum_steps": cell.grad_accum_steps,
        "world_size": cell.world_size,
        "train_batch_size": cell.train_batch_size,
        "steps": problem.steps,
        "seed": problem.seed,
        "deepspeed_config": out / DEEPSPEED_CONFIG_FILE,
        "cell_dir": out,
    }


def command_line(cell: Cell, problem: ProblemSpec, *, out: Path) -> str:
    """The cell's command as the user would type it under their launcher."""
    script = problem.script
    return command(
        script.launcher, world_size=cell.world_size, script=script.path, args=script_args(cell, problem, out=out)
    )


def rank_log(out: Path, rank: int) -> Path:
    return out / (LOG_FILE if rank == 0 else f"script-rank{rank}.log")


def prepare(cell: Cell, problem: ProblemSpec, *, run_dir: Path) -> tuple[Path, list[str], dict[str, str]]:
    """The cell's directory (with the user's DeepSpeed config for its split, if any), the script's
    arguments, and what every rank's environment adds to the launcher's: the script's own variables
    and what the probe is to record (each launch path adds where the ranks meet)."""
    out = cell_dir(run_dir.resolve(), cell.id)  # absolute: the ranks run in the script's folder
    out.mkdir(parents=True, exist_ok=True)
    switched_off: list[str] = []
    if problem.script.deepspeed_config is not None:  # the user's config with the cell's batch triple
        config = problem.script.deepspeed_config | {
            "train_batch_size": cell.train_batch_size,
            "train_micro_batch_size_per_gpu": cell.micro_batch_size,
            "gradient_accumulation_steps": cell.grad_accum_steps,
        }
        if cell.dtype == "fp32":  # the float32 run: its mixed-precision sections off (the probe says they were)
            off = [k for k in ("bf16", "fp16") if config.get(k, {}).get("enabled")]
            config |= {k: {**config[k], "enabled": False} for k in off}
            switched_off += [f"DeepSpeed {k} section" for k in off]
        atomic_write(out / DEEPSPEED_CONFIG_FILE, json.dumps(config, indent=1), shared=True)  # every launched rank
    values = placeholder_values(cell, problem, out=out)
    for name, content in problem.script.files.items():  # the config files it reads, filled for the split
        atomic_write(out / name, "".join(fill(line, values) for line in content.splitlines(keepends=True)), shared=True)
    probe = {"out": str(out), "steps": problem.steps, "float32": cell.dtype == "fp32", "switched_off": switched_off}
    if cell.perturbation is not None:  # a noise-floor twin's nudge, or an error of known size (gaeq.perturb)
        probe["perturbation"] = dataclasses.asdict(cell.perturbation) | {"unit": ROUNDING_UNIT.get(cell.dtype)}
    env = {"PYTHONUNBUFFERED": "1", **problem.script.env, ENV: json.dumps(probe)}
    return out, script_args(cell, problem, out=out), env


def run_script_cell(cell: Cell, problem: ProblemSpec, opts: RunOptions) -> CellOutcome:
    """Start the cell's ranks, wait for them (at most the matrix's timeout_s; a rank that fails stops
    the others), and say how the cell ended."""
    out, args, env = prepare(cell, problem, run_dir=opts.run_dir)
    port, launcher = free_port(), problem.script.launcher
    env = {**os.environ, **env}
    opts.on_event(Event(kind=EventKind.START, world_size=cell.world_size, cell_id=cell.id))
    started = time.perf_counter()
    # Each rank forks from gaeq's fork server, which has imported torch once (a fresh interpreter per
    # rank would import it again, the most of a short cell's time), and becomes a fresh
    # `python -m gaeq.script.attach SCRIPT ARGS` in the rank's environment (attach.forked_rank).
    ctx = rank_context(isolate=opts.isolate, preload=preload_modules([cell], {cell.variant: problem}))
    procs = [
        ctx.Process(
            target=forked_rank,
            args=(
                problem.script.path,
                worker_args(launcher, rank=r) + args,
                env | worker_env(launcher, rank=r, world_size=cell.world_size, port=port, given=env),
                problem.script.cwd,
                str(rank_log(out, r)),
            ),
            name=f"gaeq-script-{cell.id}-r{r}",
        )
        for r in range(cell.world_size)
    ]
    # A DeepSpeed script's comm op leaves a 66 MB segment per rank in /dev/shm, as gaeq's own cells do:
    # freed once the ranks are gone (and by the next run if gaeq is killed).
    kills = kill_count()  # the kernel's OOM kills so far: a rank killed by SIGKILL is told by their count
    with shm.group_on(port):
        try:
            for proc in procs:
                proc.start()
            rank, code = _wait(procs, timeout_s=opts.timeout_s)
            killed = oom_killer(procs[rank].pid, before=kills) if code == -signal.SIGKILL else None
        finally:
            for proc in procs:
                _stop(proc)
    ran = {"launched_by": f"gaeq's fork server, as {launcher.value} starts its workers"}
    outcome = conclude(cell, problem, out=out, args=args, code=code, rank=rank, seconds=time.perf_counter() - started,
                       timeout_s=opts.timeout_s, ran=ran, killed=killed)  # fmt: skip
    if outcome.status != "done":
        return fail_cell(
            cell.id,
            outcome.reason,
            run_dir=opts.run_dir,
            logs=[rank_log(out, r) for r in range(cell.world_size)],
            seconds=outcome.seconds,
            world_size=cell.world_size,
            on_event=opts.on_event,
            out_of_memory=outcome.out_of_memory,
        )
    write_outcome(out, outcome)
    opts.on_event(Event(kind=EventKind.END, world_size=cell.world_size, cell_id=cell.id, outcome=outcome))
    return outcome


def conclude(
    cell: Cell,
    problem: ProblemSpec,
    *,
    out: Path,
    args: list[str],
    code: int | None,
    rank: int | None = None,
    seconds: float,
    timeout_s: float,
    ran: dict,
    killed: OomKill | None = None,
) -> CellOutcome:
    """How the cell ended, from what its ranks left (the probe's record, rank 0's trace) and the exit
    `code` (None: they ran past `timeout_s`) of `rank`, the one that ended it (None: not known — a
    launched rank 0 knows its own code only): done, with what the probe saw in the first optimizer
    step — never the cell's label — or an error saying why (not yet written). gaeq's probe failed
    only where it failed in that rank: a peer's probe that lost its collective to it did not. Out of
    memory is the reason wherever a rank's allocation failed, or where the OOM killer sent the SIGKILL
    that ended `rank` (`killed`: what the kernel says of it)."""
    probe = out / PROBE_FILE
    facts = json.loads(probe.read_text()) if probe.is_file() else None  # what the probe saw, if it saved it
    who = "the script" if rank is None or cell.world_size == 1 else f"the script's rank {rank}"
    if (oom := out_of_memory(cell, out=out, killed=killed, rank=rank)) is not None:
        return CellOutcome(status="error", reason=oom, seconds=seconds, out_of_memory=True)
    ranks = range(cell.world_size) if rank is None else [rank]
    why = _probe_failed(out, ranks) or _why_not_done(
        problem, out=out, facts=facts, code=code, who=who, timeout_s=timeout_s
    )
    if why is None and (precision := facts.get("precision")) is not None:
        why = precision_mismatch(cell.dtype, precision, deepspeed_config=problem.script.deepspeed_config is not None)
    if why is not None and killed is not None:  # a SIGKILL nothing says the OOM killer sent
        why += f" — perhaps the kernel's OOM killer: {killed.evidence}"
    if why is not None:
        return CellOutcome(status="error", reason=why, seconds=seconds)
    first = facts["steps"][0]
    launcher = problem.script.launcher
    ran = {
        "world_size": first["world_size"],
        "micro_batch_rows": sorted({rows for rank in first["rows"] for rows in rank}),
        "micro_steps": sorted(set(first["backward"])),
        "command": command(launcher, world_size=cell.world_size, script=problem.script.path, args=args),
        **ran,
        "versions": facts.get("versions", {}),
    }
    if precision := facts.get("precision"):  # the arithmetic that ran: the report's `ran` column reads it
        ran["compute_dtype"], ran["precision"] = precision["compute_dtype"], precision
    if facts.get("accelerator_fp16"):  # what DeepSpeed's accelerator answered to fp16, where the script loaded it
        ran["accelerator_fp16"] = facts["accelerator_fp16"]
    if facts.get("dropout"):  # the verdict names it when the cell diverges (results.notes.dropout_note)
        ran["dropout"] = facts["dropout"]
    if facts.get("order_check"):  # a twin's: what besides rounding moves the model's output (gaeq.perturb)
        ran["order_check"] = facts["order_check"]
    if code != 0:
        ran["exit"] = f"{who} {how_it_ended(code)} after its last recorded step (a crash at exit: noted, not an error)"
    return CellOutcome(status="done", seconds=seconds, ran=ran)


def out_of_memory(cell: Cell, *, out: Path, killed: OomKill | None = None, rank: int | None = None) -> str | None:
    """Why the cell ran out of memory (None: nothing says it did): a rank's failed allocation — in the script,
    or in gaeq's probe —, or the OOM killer's SIGKILL of `rank`, with what the kernel says of it."""
    split = {"micro_batch_size": cell.micro_batch_size, "world_size": cell.world_size}
    at = oom_at(**split)
    for r in range(cell.world_size):
        if (record := out / OUT_OF_MEMORY_FILE.format(rank=r)).is_file():
            said = json.loads(record.read_text())
            return f"{raised(**split, rank=r, error=said['error'])} (at {said['where']})"
        if (failure := out / FAILURE_FILE.format(rank=r)).is_file() and (said := json.loads(failure.read_text())).get(
            "out_of_memory"
        ):
            return f"{at}: an allocation in gaeq's probe failed on rank {r}: {said['error']} (at {said['where']})"
    if killed is not None and killed.out_of_memory:
        return f"{at}: rank {rank} was killed by SIGKILL — {killed.evidence} ({killed.sure.value})"
    return None


def _probe_failed(out: Path, ranks: Iterable[int]) -> str | None:
    """gaeq's own failure in one of `ranks` (its probe raised), said as gaeq's, with the frame where it raised."""
    for r in ranks:
        if (failure := out / FAILURE_FILE.format(rank=r)).is_file():
            said = json.loads(failure.read_text())
            return f"gaeq's probe failed on rank {r}: {said['error']} (at {said['where']})"
    return None


def precision_mismatch(label: str, precision: dict, *, deepspeed_config: bool) -> str | None:
    """Why what ran is not the cell's label (None: it is). fp32 cells ran with autocast and a loss scaler
    switched off (gaeq.script.precision); what cannot be switched off is said."""
    ran = precision["dtype"]
    if ran == label:
        return None
    if label == "fp32" and precision.get("deepspeed"):
        return (
            f"labelled fp32, ran {ran}: the script's DeepSpeed engine has its {precision['deepspeed']} section on, "
            "which gaeq switches off only in a config it writes — give it as script.deepspeed_config"
            + (" (it is: does the script read {deepspeed_config}?)" if deepspeed_config else "")
        )
    if label == "fp32":
        return (
            f"labelled fp32, ran {ran}: the script's parameters are {', '.join(precision['parameters'])} — it casts "
            "its model itself, which gaeq cannot undo (it switches off autocast and a loss scaler): a float32 run "
            f"of it cannot be made; label its cells {ran}"
        )
    switched = f" (gaeq switched off {', '.join(precision['switched_off'])})" if precision.get("switched_off") else ""
    return f"labelled {label}, ran {ran}{switched}: what the script computes in is not the label — label it {ran}"


def _wait(procs: list, *, timeout_s: float, grace_s: float = PEERS_GRACE_S) -> tuple[int, int | None]:
    """The rank that ended the cell and its exit code: the first to fail — but a rank killed by a signal
    before one that exited with an error, which its peer's death in a collective explains, whichever of
    the two the parent saw end first (a crash report takes a moment to write) —, else (0, 0) when every
    rank finished; (0, None) when they ran past `timeout_s`. A rank that fails leaves its peers blocked
    in a collective: they get `grace_s` to fail of it too (their errors in their logs, rank 0's record
    saved), then are stopped."""
    deadline = time.monotonic() + timeout_s
    running, ended = list(range(len(procs))), []
    while running and (left := deadline - time.monotonic()) > 0:
        now = _ended(procs, running, timeout_s=left)
        running, ended = [r for r in running if r not in now], ended + now
        if any(procs[r].exitcode for r in now):
            peers = time.monotonic() + grace_s
            while running and (left := peers - time.monotonic()) > 0:
                now = _ended(procs, running, timeout_s=left)
                running, ended = [r for r in running if r not in now], ended + now
            failed = [r for r in ended if procs[r].exitcode]
            cause = min(failed, key=lambda r: (procs[r].exitcode > 0, ended.index(r)))
            return cause, procs[cause].exitcode
    return (0, None) if running else (0, 0)


def _ended(procs: list, running: list[int], *, timeout_s: float) -> list[int]:
    """Those of the `running` ranks that end within `timeout_s`, reaped (their exit codes known) —
    returned the moment one ends ([]: none did)."""
    ready = set(connection.wait([procs[r].sentinel for r in running], timeout=timeout_s))
    now = [r for r in running if procs[r].sentinel in ready]
    for r in now:
        procs[r].join()
    return now


def _why_not_done(
    problem: ProblemSpec, *, out: Path, facts: dict | None, code: int | None, who: str, timeout_s: float
) -> str | None:
    """Why the cell has no comparable result (None: it has one): it hung, or stopped before its steps
    (the split it ran is judged with the numbers, gaeq.results.script_checks). `who` ended it with `code`."""
    if code is None:
        return f"timed out: the script ran for {timeout_s:.0f} s without finishing its {problem.steps} steps"
    ended = f"{who} {how_it_ended(code)}"
    if facts is None:
        return f"{ended} before gaeq's probe saved what it saw"
    steps = facts["steps"]
    if not steps and code != 0:
        return f"{ended} before gaeq's probe recorded an optimizer step"
    if not steps:  # it ended of itself, its loop never stepped an optimizer the probe sees
        return (
            f"no optimizer step seen ({ended}): is its training loop behind an "
            "argument gaeq did not pass, or does it step an optimizer gaeq cannot see?"
        )
    if not (out / TRACE_FILE).is_file():
        return f"{ended} after {len(steps)} of {problem.steps} optimizer steps"
    return None


def _stop(proc) -> None:
    """Whatever is left of a rank — it and everything it started (its own session) — is killed."""
    if proc.pid is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()  # not (yet) the leader of its own session
    proc.join(timeout=30)
