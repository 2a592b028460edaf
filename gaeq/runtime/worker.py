"""The per-rank loop: join the group once, then for each cell the parent hands it, build the
problem, train, record.

Runs in a child process started by :mod:`gaeq.runtime.launch`. It talks to the parent only through
plain data: the parent sends the index of the next cell (None: no cell left) on the rank's command
queue, the rank answers with messages (:class:`Msg`) on the group's queue. Everything it prints
(DeepSpeed's logging included) goes to log files: the group's log, and while a cell runs, that
cell's ``rank<r>.log``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from gaeq.matrix import Cell
from gaeq.oom import is_out_of_memory
from gaeq.problem.spec import ProblemSpec
from gaeq.results.outcome import CellOutcome
from gaeq.results.trace import cell_dir
from gaeq.runtime import crashes, lifeline

READY, START, STEP, DONE, FAILED = "ready", "start", "step", "done", "failed"


@dataclass(frozen=True)
class Msg:
    """A rank's message to the parent: plain data, pickled through a queue.

    ready — joined the process group; start — began `cell_id`; step — finished optimizer `step`
    (rank 0 only); done — finished the cell, with `seconds` and `ran` (what really ran); failed —
    the cell raised (`reason`); the rank exits right after."""

    kind: str
    rank: int
    cell_id: str | None = None
    step: int | None = None
    seconds: float | None = None
    ran: dict | None = None
    reason: str | None = None
    out_of_memory: bool = False
    """failed: an allocation failed (gaeq.oom): the cell's cause, whatever its peers report after it."""


@dataclass(frozen=True, kw_only=True)
class GroupJob:
    """One process group: the cells of a single world size it may be handed (by index), and the
    cores its ranks run on."""

    world_size: int
    port: int
    cells: tuple[Cell, ...]
    cores: tuple[int, ...]
    """The CPU cores of this group's lane: its ranks are pinned to them, so that a group running
    beside another (lanes, :mod:`gaeq.runtime.launch`) never shares a core with it."""
    lane: int = 0
    problems: dict[str, ProblemSpec]
    """variant → problem"""
    plugin_dirs: tuple[str, ...]
    """Folders plugin modules are imported from: on the rank's ``sys.path`` before its first cell."""
    run_dir: str
    init_timeout_s: float
    accelerator_fp16: bool | None = None
    """The fp16 answer the run forces on DeepSpeed's accelerator (RunOptions), None: its own. Handed
    over, not read from the environment: a fork server started earlier has an older one."""


def group_log(run_dir: str | Path, world_size: int, rank: int, *, lane: int = 0) -> Path:
    name = f"group-w{world_size}-rank{rank}.log" if lane == 0 else f"group-w{world_size}-lane{lane}-rank{rank}.log"
    return Path(run_dir) / "logs" / name


def worker_main(rank: int, job: GroupJob, events: Any, commands: Any) -> None:
    """A rank started by gaeq's own launcher (:mod:`gaeq.runtime.launch`): runs the cells whose
    index arrives on `commands` until None does, and reports on `events`."""
    _detach_from_terminal()
    log = group_log(job.run_dir, job.world_size, rank, lane=job.lane)
    log.parent.mkdir(parents=True, exist_ok=True)
    redirect_fds(log)

    from gaeq.runtime import dist

    dist.set_accelerator_env()  # before anything imports DeepSpeed
    set_up_rank(cores=job.cores, plugin_dirs=job.plugin_dirs, accelerator_fp16=job.accelerator_fp16)
    dist.init_process_group(
        rank=rank,
        world_size=job.world_size,
        port=job.port,
        with_deepspeed=any(c.joins_through_deepspeed for c in job.cells),
        with_nvme=any(c.offload == "nvme" for c in job.cells),
        timeout_s=job.init_timeout_s,
    )
    group_ready()
    print(
        f"gaeq: process group ready (world {job.world_size}, rank {rank}, lane {job.lane}, cores {list(job.cores)})",
        flush=True,
    )
    events.put(Msg(READY, rank))

    # The parent answers within a moment (it dispatches as soon as the group is ready or a cell is
    # done); if it is gone, the lifeline has ended this rank already. The timeout is a last resort.
    while (index := commands.get(timeout=job.init_timeout_s)) is not None:
        cell = job.cells[index]
        print(f"gaeq: cell {cell.id}", flush=True)
        events.put(Msg(START, rank, cell.id))
        try:
            done = run_cell(
                cell,
                rank=rank,
                world_size=job.world_size,
                device=dist.device_for(rank),
                problem=job.problems[cell.variant],
                run_dir=Path(job.run_dir),
                on_step=lambda step, cell_id=cell.id: events.put(Msg(STEP, rank, cell_id, step=step)),
            )
        except BaseException as exc:  # noqa: BLE001 - any failure ends this rank
            said = f"{type(exc).__name__}: {exc}"
            events.put(Msg(FAILED, rank, cell.id, reason=said, out_of_memory=is_out_of_memory(exc)))
            # Peers may be blocked in a collective with us: the group is finished. The parent
            # tears it down and runs the remaining cells in a fresh one.
            _exit(events, 1)
        events.put(Msg(DONE, rank, cell.id, seconds=done.seconds, ran=done.ran))

    dist.destroy_process_group()
    _exit(events, 0)


def set_up_rank(
    *, cores: tuple[int, ...] = (), plugin_dirs: tuple[str, ...] = (), accelerator_fp16: bool | None = None
) -> None:
    """Process-wide settings of a rank, before it joins its group (any launcher). `cores`: pin the
    rank to them (gaeq's own launcher: its lane's cores); `plugin_dirs`: where its cells' plugin
    modules are imported from (on ``sys.path`` from here on); `accelerator_fp16`: the answer DeepSpeed's
    accelerator gives to ``is_fp16_supported()`` in this rank (None: its own; gaeq/accelerator.py)."""
    from gaeq.accelerator import force_fp16_answer
    from gaeq.problem.build import import_plugins_from

    crashes.stacks_to_log()
    force_fp16_answer(accelerator_fp16)
    import_plugins_from(plugin_dirs)
    # DeepSpeed calls collectives torch deprecates; the warning repeats on every ZeRO
    # collective (hundreds of lines per cell log, and time).
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    import torch

    if cores:
        os.sched_setaffinity(0, cores)
    # One intra-op thread per rank, whatever the machine and however the run is scheduled: the
    # thread count changes summation order (the GPT's traces differ bitwise between 1 and 2), so a
    # cell's numbers would otherwise depend on the core count and on its neighbours. The models a
    # CPU lab trains are too small for intra-op threads to pay (docs/costs-and-speed.md, How fast the lab is).
    # The variables tell the libraries too: accelerate, where OMP_NUM_THREADS is unset, sets torch's
    # threads to physical cores ÷ local ranks — 2 threads on a rank pinned to one core, its cells
    # many times slower, and every later cell of the rank on 2 threads.
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    torch.set_num_threads(1)


def group_ready() -> None:
    """After joining: everything imported so far lives as long as the rank. Keep it out of the
    collections DeepSpeed forces (a gc.collect() over this whole heap in every ZeRO-3 set-up; docs/costs-and-speed.md:
    How fast the lab is)."""
    gc.freeze()


def run_cell(
    cell: Cell,
    *,
    rank: int,
    world_size: int,
    device: Any,
    problem: ProblemSpec,
    run_dir: Path,
    on_step: Any = None,
) -> CellOutcome:
    """Train one cell on this rank, everything it prints going to ``cells/<id>/rank<r>.log``.
    Returns its `done` outcome (seconds, what ran); a failure is printed into that log and re-raised."""
    from gaeq.trainers import RunContext

    out = cell_dir(run_dir, cell.id)
    out.mkdir(parents=True, exist_ok=True)
    with redirected_output(out / f"rank{rank}.log"):
        started = time.perf_counter()
        ctx = RunContext(
            rank=rank,
            world_size=world_size,
            device=device,
            cell_dir=out,
            on_step=on_step or (lambda step: None),
            run_dir=run_dir,
        )
        try:
            ran = train(cell, problem, ctx)
        except BaseException:
            traceback.print_exc()
            raise
        return CellOutcome(status="done", seconds=time.perf_counter() - started, ran=ran)


def train(cell: Cell, problem: ProblemSpec, ctx: Any) -> dict:
    """Train `cell` in this rank with its trainer (`ctx`: its gaeq.trainers.RunContext); what ran — a
    noise-floor twin's with its order check (what besides rounding moves the model's output:
    gaeq.rows.OrderCheck)."""
    from gaeq.trainers import trainer_for

    # Eager kernels unless the cell compiles: a library function that compiles itself (DeepSpeed's
    # Muon update) would spend tens of seconds compiling in every cell on a CPU, and recompile per shape.
    with eager(cell), perturbed(cell) as applied, weighed(cell, ctx):
        train_cell = trainer_for(cell.trainer, pipeline_parallel=cell.pipeline_parallel)
        ran = train_cell(cell=cell, problem=problem, ctx=ctx)
    if applied is not None and applied.check is not None and applied.check.found is not None:
        ran = {**ran, "order_check": applied.check.found}
    return ran


def eager(cell: Cell) -> contextlib.AbstractContextManager:
    """Every cell runs eagerly — torch.compile'd library functions too (DeepSpeed's Muon update) — but a
    compiled one (the `compile` axis), which compiles what its model and libraries compile."""
    import torch

    return torch.compiler.set_stance("default" if cell.compile else "force_eager")


def perturbed(cell: Cell) -> contextlib.AbstractContextManager:
    """An instrument's perturbation while it trains (gaeq.perturb); nothing for every other cell."""
    import gaeq.perturb as perturb

    p = cell.perturbation
    return perturb.applied(twin_seed=p.twin_seed, weight=p.weight) if p else contextlib.nullcontext()


def weighed(cell: Cell, ctx: Any) -> contextlib.AbstractContextManager:
    """The weight every target gets in each step, read in a split or baseline of gaeq's own trainers
    (gaeq.script.targets; a script's probe reads its own). Not where ranks share a batch (TP, PP, SP) nor in an
    instrument, which plants or nudges."""
    from gaeq.contract import TARGETS_FILE
    from gaeq.matrix import Role
    from gaeq.registry import TRAINERS
    from gaeq.script import targets

    shared = cell.tensor_parallel * cell.pipeline_parallel * cell.sequence_parallel > 1
    if TRAINERS[cell.trainer].script or shared or cell.role not in (Role.CELL, Role.BASELINE):
        return contextlib.nullcontext()
    return targets.reading(Path(ctx.cell_dir) / TARGETS_FILE.format(rank=ctx.rank))


def _exit(events: Any, code: int) -> None:
    """Exit without losing queued messages (os._exit would drop what the feeder thread holds)."""
    events.close()
    events.join_thread()
    hard_exit(code)


def hard_exit(code: int) -> NoReturn:
    """Leave a rank once its results are on disk or in the pipe: flush, then os._exit. No
    interpreter shutdown and no C++ static destructors, which abort a process (SIGABRT,
    "terminate called without an active exception") when a native thread of gloo or of
    DeepSpeed's shm op is still joinable at exit — a finished rank's result must not depend on it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _detach_from_terminal() -> None:
    # Own process group: Ctrl-C reaches only the parent, which stops the ranks in order, and the
    # parent can kill a rank together with anything it started (e.g. a JIT compiler).
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Die with gaeq itself, whatever kills it, taking the process group — the rank and what it started
    # (a JIT compiler) — with it. A death signal tied to the fork server only where gaeq cannot be
    # watched: when gaeq is killed the server exits too, and a rank SIGKILLed for that first would
    # leave what it started running.
    if not lifeline.bind_to_parent():
        lifeline.arm_death_signal()


def redirect_fds(path: Path) -> None:
    """Send fds 1 and 2 of this process (Python, C++ and library output alike) to `path`, appended."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@contextlib.contextmanager
def redirected_output(path: Path) -> Iterator[None]:
    """Send fds 1 and 2 (Python, C++ and DeepSpeed output alike) to `path` for the duration."""
    saved = os.dup(1), os.dup(2)
    redirect_fds(path)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
