"""The local launcher: one process group per world size, reused for all of its cells.

Starting ranks and joining a process group costs seconds; a cell of the default matrix trains in
well under one. So each world size gets one group that runs its cells in sequence (engines and DDP
are rebuilt per cell). The parent never waits without a deadline: every wait on the queue is
short, and between waits it checks that every rank is alive and that the current cell has made
progress within ``timeout_s``. A failed or hung cell kills its group (its peers may be stuck in a
collective); the cells after it run in a fresh group.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Mapping, Sequence

from gaeq.matrix import DEEPSPEED_TRAINERS, Cell
from gaeq.problem.spec import HFModelSpec, ProblemSpec
from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.results.trace import cell_dir
from gaeq.runtime import shm, worker
from gaeq.runtime.cells import RunOptions, fail_cell, resume_blocker
from gaeq.runtime.convert import convert_to_universal
from gaeq.runtime.dist import free_port
from gaeq.runtime.events import Event
from gaeq.runtime.external import run_launched_group


def run_all(cells: Sequence[Cell], opts: RunOptions, *, done: Mapping[str, CellOutcome] | None = None) -> dict[str, CellOutcome]:
    """Every cell, in two phases: first the cells that start from scratch (resume sources among
    them), then — after converting the sources' checkpoints where asked — the resumed cells.
    `done`: cells of an earlier attempt that finished (resume sources among them)."""
    outcomes = dict(done or {}) | run_cells([c for c in cells if c.resume is None], opts)
    conversions: dict[tuple[str, int], str | None] = {}

    def convert(source: str, step: int) -> str | None:  # once per (source, step)
        if (source, step) not in conversions:
            opts.on_event(Event(kind="convert", world_size=0, cell_id=source, step=step))
            conversions[(source, step)] = convert_to_universal(run_dir=opts.run_dir, source_id=source, step=step, timeout_s=opts.timeout_s)
        return conversions[(source, step)]

    ready = []
    for cell in (c for c in cells if c.resume is not None):
        source, step = cell.resume.source, cell.resume.step
        blocker = resume_blocker(cell, source=outcomes.get(source), convert=lambda: convert(source, step))
        if blocker is None:
            ready.append(cell)
        else:
            outcomes[cell.id] = fail_cell(cell.id, blocker, run_dir=opts.run_dir, world_size=cell.world_size, on_event=opts.on_event)
    outcomes.update(run_cells(ready, opts))
    return {c.id: outcomes[c.id] for c in cells if c.id in outcomes}


def run_cells(cells: Sequence[Cell], opts: RunOptions) -> dict[str, CellOutcome]:
    """Run every cell; return how each ended. Writes ``cells/<id>/outcome.json`` for each.

    One process group per world size runs all of its cells — or, with `isolate`, one fresh group
    per cell (the way one launch per configuration works). With `launcher` torchrun or deepspeed,
    that launcher starts each group's ranks on ``gaeq worker`` (the run directory must hold the
    matrix as ``matrix.yaml``)."""
    by_world: dict[object, list[Cell]] = {}
    for cell in cells:
        by_world.setdefault(cell.id if opts.isolate else cell.world_size, []).append(cell)
    outcomes: dict[str, CellOutcome] = {}
    for group in by_world.values():
        pending = list(group)
        while pending:
            opts.on_event(Event(kind="group", world_size=group[0].world_size))
            run_group = _run_group if opts.launcher == "local" else run_launched_group
            finished = run_group(world_size=group[0].world_size, cells=pending, opts=opts)
            outcomes.update(finished)
            pending = [c for c in pending if c.id not in finished]
    return outcomes


class _GroupRun:
    """Book-keeping of one process group: which cell is current, what each rank has said."""

    def __init__(self, *, world_size: int, cells: Sequence[Cell], opts: RunOptions) -> None:
        self.world_size = world_size
        self.cells = list(cells)
        self.run_dir = opts.run_dir
        self.on_event = opts.on_event
        self.ready: set[int] = set()
        self.done: dict[str, dict[int, tuple[float, dict | None]]] = {}  # cell → rank → (seconds, ran)
        self.outcomes: dict[str, CellOutcome] = {}
        self.failures: list[tuple[int, str]] = []  # (rank, reason) as ranks reported them
        self.cell_started = time.monotonic()

    @property
    def current(self) -> Cell | None:
        return self.cells[len(self.outcomes)] if len(self.outcomes) < len(self.cells) else None

    def finish(self, cell: Cell, outcome: CellOutcome) -> None:
        self.outcomes[cell.id] = outcome
        write_outcome(cell_dir(self.run_dir, cell.id), outcome)
        self.on_event(Event(kind="end", world_size=self.world_size, cell_id=cell.id, outcome=outcome))

    def handle(self, msg: worker.Msg) -> bool:
        """Apply one message from a rank. True when it shows progress (resets the deadline)."""
        if msg.kind == worker.READY:
            self.ready.add(msg.rank)
        elif msg.kind == worker.START and msg.rank == 0:
            self.cell_started = time.monotonic()
            self.on_event(Event(kind="start", world_size=self.world_size, cell_id=msg.cell_id))
        elif msg.kind == worker.STEP:
            self.on_event(Event(kind="step", world_size=self.world_size, cell_id=msg.cell_id, step=msg.step))
        elif msg.kind == worker.DONE:
            ranks = self.done.setdefault(msg.cell_id, {})
            ranks[msg.rank] = (msg.seconds, msg.ran)
            if len(ranks) == self.world_size and self.current is not None and self.current.id == msg.cell_id:
                seconds = max(s for s, _ in ranks.values())
                self.finish(self.current, CellOutcome(status="done", seconds=seconds, ran=ranks[0][1]))
        elif msg.kind == worker.FAILED:
            self.failures.append((msg.rank, msg.reason))
            return False
        return True

    def fail(self, why: str, *, rank: int | None) -> None:
        """The group is lost: the current cell is `error`; before start-up, every cell is.

        The reason carries the log tail of the rank that failed (of every rank when we cannot
        tell which one, e.g. a hang).
        """
        started = len(self.ready) == self.world_size
        victims = [self.current] if started else self.cells[len(self.outcomes) :]
        ranks = range(self.world_size) if rank is None else [rank]
        for cell in victims:
            logs = [
                cell_dir(self.run_dir, cell.id) / f"rank{r}.log" if started else worker.group_log(self.run_dir, self.world_size, r)
                for r in ranks
            ]
            seconds = time.monotonic() - self.cell_started if started else 0.0
            self.outcomes[cell.id] = fail_cell(
                cell.id, why, run_dir=self.run_dir, logs=logs, seconds=seconds, world_size=self.world_size, on_event=self.on_event
            )


def _run_group(*, world_size: int, cells: Sequence[Cell], opts: RunOptions) -> dict[str, CellOutcome]:
    # The server already runs when api.run warmed it up (then its preload list stands).
    ctx = _context(isolate=opts.isolate, preload=preload_modules(cells, opts.problems))
    events = ctx.Queue()
    timeout_s, init_timeout_s = opts.timeout_s, opts.init_timeout_s
    job = worker.GroupJob(
        world_size=world_size,
        port=free_port(),
        cells=tuple(cells),
        problems=dict(opts.problems),
        search=opts.search,
        run_dir=str(opts.run_dir),
        init_timeout_s=init_timeout_s,
    )
    procs = [
        ctx.Process(target=worker.worker_main, args=(rank, job, events), name=f"gaeq-w{world_size}-r{rank}")
        for rank in range(world_size)
    ]
    state = _GroupRun(world_size=world_size, cells=cells, opts=opts)
    with shm.group_on(job.port):  # a marker while it runs; DeepSpeed's shm segments freed after
        try:
            for p in procs:
                p.start()
            deadline = time.monotonic() + init_timeout_s
            while state.current is not None:
                try:
                    msg = events.get(timeout=0.2)
                except queue.Empty:
                    msg = None
                if msg is not None and state.handle(msg):
                    started = len(state.ready) == world_size
                    deadline = time.monotonic() + (timeout_s if started else init_timeout_s)
                if state.failures or any(p.exitcode is not None for p in procs):
                    # Ranks are exiting: either the group finished (last DONEs still in the pipe) or
                    # it is failing. Let it settle, then name the root cause.
                    _drain(events, state)
                    if state.current is None:
                        break
                    why, rank = _root_cause(procs, state)
                    state.fail(why, rank=rank)
                    break
                if time.monotonic() > deadline:
                    started = len(state.ready) == world_size
                    budget = timeout_s if started else init_timeout_s
                    phase = "in the cell" if started else "while joining the process group"
                    state.fail(f"timed out: no progress for {budget:.0f} s {phase} (a rank hangs?)", rank=None)
                    break
        finally:
            _stop(procs, graceful=state.current is None)
            events.close()
            events.cancel_join_thread()
    return state.outcomes


def warm_up(cells: Sequence[Cell], problems: Mapping[str, ProblemSpec], *, isolate: bool = False) -> None:
    """Start the fork server now (its imports take seconds), so that it is ready by the time the
    first process group is launched; call it before other start-up work."""
    if not isolate and sys.platform == "linux":
        _context(isolate=False, preload=preload_modules(cells, problems))
        from multiprocessing import forkserver

        forkserver.ensure_running()


def preload_modules(cells: Sequence[Cell], problems: Mapping[str, ProblemSpec]) -> list[str]:
    """What the fork server imports before it forks a rank: torch and the manual trainer always;
    DeepSpeed, accelerate, transformers only when a cell needs them (the server's imports are on
    the critical path of every run: the first group cannot start before they are done)."""
    trainers = {c.trainer for c in cells}
    hf_trainer = bool(trainers & {"hf", "hf_deepspeed"})  # the transformers Trainer (on accelerate)
    modules = ["gaeq.runtime.preload"]
    if trainers & DEEPSPEED_TRAINERS:
        modules.append("gaeq.runtime.preload_deepspeed")
    if hf_trainer or "accelerate" in trainers:
        modules.append("gaeq.runtime.preload_accelerate")
    if hf_trainer or any(isinstance(problems[c.variant].model, HFModelSpec) for c in cells):
        modules.append("gaeq.runtime.preload_hf")
    if hf_trainer:
        modules.append("gaeq.trainers.hf_trainer")
    return modules


def _context(*, isolate: bool, preload: Sequence[str]):
    """Ranks fork from a server that has imported torch (and what the cells need, `preload`) once
    (Linux); with `isolate`, every group is a fresh interpreter — exactly what one launch per config
    costs."""
    if isolate or sys.platform != "linux":
        return mp.get_context("spawn")
    # DS_ACCELERATOR: set by the fork server's preload (and by a spawned rank) before DeepSpeed
    # is imported — not here, where asking torch about CUDA would import it before the server starts.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def _drain(events, state: _GroupRun, *, seconds: float = 1.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and state.current is not None:
        try:
            state.handle(events.get(timeout=0.1))
        except queue.Empty:
            pass


def _root_cause(procs: list, state: _GroupRun) -> tuple[str, int]:
    """A rank that died without a word comes first: the errors its peers then report (a reset
    connection in a collective) are consequences. Otherwise, the first rank that reported."""
    reported = {rank for rank, _ in state.failures}
    for rank, p in enumerate(procs):
        if p.exitcode is not None and rank not in reported:
            return f"rank {rank} exited with code {p.exitcode} before the cell finished", rank
    rank, reason = state.failures[0]
    return f"rank {rank} failed: {reason}", rank


def _stop(procs: list, *, graceful: bool) -> None:
    """Leave no process behind: a finished group exits by itself; anything else is killed."""
    if graceful:
        deadline = time.monotonic() + 30
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive() or p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and anything it started
            except (ProcessLookupError, PermissionError, TypeError):
                pass
            p.kill()
        p.join(timeout=10)
