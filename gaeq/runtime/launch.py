"""The local launcher: process groups reused for all the cells of their world size, side by side
where the cores allow.

Starting ranks and joining a process group costs seconds; a cell of the default matrix trains in
well under one. So each world size gets groups that run its cells in sequence (engines and DDP
are rebuilt per cell), each cell handed to a group by the parent as the group becomes free. Where
the machine has cores for more than one group of a world size (world 1 on 2 cores), that many
groups — lanes — run side by side, each pinned to cores of its own, taking cells from one pool:
a cell never shares a core, so its timings are those of a cell alone. The parent never waits
without a deadline: every wait on a queue is short, and between waits it checks that every rank
is alive and that the current cell has made progress within ``timeout_s``. A failed or hung cell
kills its group (its peers may be stuck in a collective); its lane goes on in a fresh group.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from gaeq.matrix import Cell
from gaeq.oom import raised
from gaeq.registry import TRAINERS
from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.results.trace import cell_dir
from gaeq.runtime import shm, worker
from gaeq.runtime.cells import RunOptions, fail_cell, reference_blocker, resume_blocker
from gaeq.runtime.convert import convert_to_universal
from gaeq.runtime.crashes import how_it_ended
from gaeq.runtime.dist import free_port
from gaeq.runtime.events import Event, EventKind
from gaeq.runtime.external import run_launched_group
from gaeq.runtime.lanes import CellPool, plan_lanes
from gaeq.runtime.server import preload_modules, rank_context


def run_all(
    cells: Sequence[Cell], opts: RunOptions, *, done: Mapping[str, CellOutcome] | None = None
) -> dict[str, CellOutcome]:
    """Every cell, in two phases: first the cells that start from scratch (resume sources among
    them), then — after converting the sources' checkpoints where asked — the resumed cells.
    `done`: cells of an earlier attempt that finished (resume sources among them)."""
    outcomes = dict(done or {}) | run_cells([c for c in cells if c.resume is None], opts)
    conversions: dict[tuple[str, int], str | None] = {}

    def convert(source: str, step: int) -> str | None:  # once per (source, step)
        if (source, step) not in conversions:
            opts.on_event(Event(kind=EventKind.CONVERT, world_size=0, cell_id=source, step=step))
            conversions[(source, step)] = convert_to_universal(
                run_dir=opts.run_dir, source_id=source, step=step, timeout_s=opts.timeout_s
            )
        return conversions[(source, step)]

    ready = []
    for cell in (c for c in cells if c.resume is not None):
        source, step = cell.resume.source, cell.resume.step
        blocker = resume_blocker(cell, source=outcomes.get(source), convert=lambda: convert(source, step))
        if blocker is None:
            ready.append(cell)
        else:
            outcomes[cell.id] = fail_cell(
                cell.id, blocker, run_dir=opts.run_dir, world_size=cell.world_size, on_event=opts.on_event
            )
    outcomes.update(run_cells(ready, opts))
    return {c.id: outcomes[c.id] for c in cells if c.id in outcomes}


def run_cells(cells: Sequence[Cell], opts: RunOptions) -> dict[str, CellOutcome]:
    """Run every cell; return how each ended. Writes ``cells/<id>/outcome.json`` for each.

    The cells of one world size share process groups (lanes side by side, see :func:`plan_lanes`)
    — or, with `isolate`, each cell gets one fresh group (the way one launch per configuration
    works). With `launcher` torchrun or deepspeed, that launcher starts each world size's ranks on
    ``gaeq worker`` (the run directory must hold the matrix as ``matrix.yaml``) — a script's cells
    too, each rank then starting the script's (gaeq.script.launched)."""
    outcomes: dict[str, CellOutcome] = {}
    forked = [c for c in cells if TRAINERS[c.trainer].script and opts.launcher == "local"]
    for cell in forked:  # the user's script, its ranks forked as its launcher would start them, in matrix order
        from gaeq.script.launch import run_script_cell

        if (why := reference_blocker(cell, cells, outcomes)) is not None:  # (its reference, first, did not fit)
            outcomes[cell.id] = fail_cell(cell.id, why, run_dir=opts.run_dir, world_size=cell.world_size,
                                          on_event=opts.on_event)  # fmt: skip
            continue
        outcomes[cell.id] = run_script_cell(cell, opts.problems[cell.variant], opts)
    groups: dict[object, list[Cell]] = {}
    for cell in (c for c in cells if c not in forked):  # under a real launcher, a script's cells go as any
        groups.setdefault(cell.id if opts.isolate else cell.world_size, []).append(cell)
    for group in groups.values():
        world_size = group[0].world_size
        if opts.launcher == "local":
            outcomes.update(_run_lanes(world_size=world_size, cells=group, opts=opts))
            continue
        pending = list(group)
        while pending:
            opts.on_event(Event(kind=EventKind.GROUP, world_size=world_size))
            finished = run_launched_group(world_size=world_size, cells=pending, opts=opts)
            outcomes.update(finished)
            pending = [c for c in pending if c.id not in finished]
    return outcomes


def _run_lanes(*, world_size: int, cells: Sequence[Cell], opts: RunOptions) -> dict[str, CellOutcome]:
    """The cells of one world size, in one group per lane, each lane in a thread of its own that
    starts a fresh group whenever its group is lost while cells are left. Ctrl-C (or any failure
    of the parent) stops every lane's ranks before it propagates."""
    lanes = plan_lanes(world_size=world_size, cells=len(cells), cores=sorted(os.sched_getaffinity(0)), limit=opts.lanes)
    pool, stop, lock = CellPool(cells), threading.Event(), threading.Lock()
    opts = replace(opts, on_event=_one_at_a_time(opts.on_event))  # callers never see two events at once
    outcomes: dict[str, CellOutcome] = {}
    errors: list[BaseException] = []

    def lane_main(lane: int, cores: tuple[int, ...]) -> None:
        try:
            while pool and not stop.is_set():
                opts.on_event(Event(kind=EventKind.GROUP, world_size=world_size, lane=lane))
                finished = _run_group(
                    world_size=world_size, cells=cells, pool=pool, lane=lane, cores=cores, opts=opts, stop=stop
                )
                with lock:
                    outcomes.update(finished)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)
            stop.set()

    threads = [
        threading.Thread(target=lane_main, args=(lane, cores), name=f"gaeq-w{world_size}-lane{lane}", daemon=True)
        for lane, cores in enumerate(lanes)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.2)
    except BaseException:
        stop.set()
        for t in threads:
            t.join()
        raise
    if errors:
        raise errors[0]
    return outcomes


def _one_at_a_time(on_event):
    lock = threading.Lock()

    def call(event: Event) -> None:
        with lock:
            on_event(event)

    return call


class _GroupRun:
    """Book-keeping of one process group: which cell it runs, what each rank has said."""

    def __init__(
        self, *, world_size: int, lane: int, cells: Sequence[Cell], pool: CellPool, commands: list, opts: RunOptions
    ) -> None:
        self.world_size = world_size
        self.lane = lane
        self.index = {c.id: i for i, c in enumerate(cells)}
        self.pool = pool
        self.commands = commands
        self.opts = opts
        self.run_dir = opts.run_dir
        self.on_event = opts.on_event
        self.ready: set[int] = set()
        self.current: Cell | None = None
        self.stopped = False
        """Its ranks were told that no cell is left: they leave by themselves."""
        self.done: dict[str, dict[int, tuple[float, dict | None]]] = {}  # cell → rank → (seconds, ran)
        self.outcomes: dict[str, CellOutcome] = {}
        self.failures: list[worker.Msg] = []  # as ranks reported them
        self.cell_started = time.monotonic()

    def dispatch(self) -> None:
        """Hand every rank the pool's next cell — or, with none left, tell them to leave."""
        self.current = self.pool.take()
        self.stopped = self.current is None
        for commands in self.commands:
            commands.put(None if self.current is None else self.index[self.current.id])
        self.cell_started = time.monotonic()

    def finish(self, cell: Cell, outcome: CellOutcome) -> None:
        self.outcomes[cell.id] = outcome
        write_outcome(cell_dir(self.run_dir, cell.id), outcome)
        self.on_event(
            Event(kind=EventKind.END, world_size=self.world_size, lane=self.lane, cell_id=cell.id, outcome=outcome)
        )

    def handle(self, msg: worker.Msg) -> bool:
        """Apply one message from a rank. True when it shows progress (resets the deadline)."""
        if msg.kind == worker.READY:
            self.ready.add(msg.rank)
            if len(self.ready) == self.world_size:
                self.dispatch()
        elif msg.kind == worker.START and msg.rank == 0:
            self.cell_started = time.monotonic()
            self.on_event(Event(kind=EventKind.START, world_size=self.world_size, lane=self.lane, cell_id=msg.cell_id))
        elif msg.kind == worker.STEP:
            self.on_event(
                Event(
                    kind=EventKind.STEP, world_size=self.world_size, lane=self.lane, cell_id=msg.cell_id, step=msg.step
                )
            )
        elif msg.kind == worker.DONE:
            ranks = self.done.setdefault(msg.cell_id, {})
            ranks[msg.rank] = (msg.seconds, msg.ran)
            if len(ranks) == self.world_size and self.current is not None and self.current.id == msg.cell_id:
                seconds = max(s for s, _ in ranks.values())
                self.finish(self.current, CellOutcome(status="done", seconds=seconds, ran=ranks[0][1]))
                self.dispatch()
        elif msg.kind == worker.FAILED:
            self.failures.append(msg)
            return False
        return True

    def fail(self, why: str, *, rank: int | None, out_of_memory: bool = False) -> None:
        """The group is lost: the current cell is `error`; before start-up, every cell still in
        the pool is (a group that cannot start would not start again).

        The reason carries the log tail of the rank that failed (of every rank when we cannot
        tell which one, e.g. a hang).
        """
        started = len(self.ready) == self.world_size
        victims = ([self.current] if self.current is not None else []) if started else self.pool.take_all()
        ranks = range(self.world_size) if rank is None else [rank]
        for cell in victims:
            logs = [
                cell_dir(self.run_dir, cell.id) / f"rank{r}.log"
                if started
                else worker.group_log(self.run_dir, self.world_size, r, lane=self.lane)
                for r in ranks
            ]
            seconds = time.monotonic() - self.cell_started if started else 0.0
            self.outcomes[cell.id] = fail_cell(
                cell.id,
                why,
                run_dir=self.run_dir,
                logs=logs,
                seconds=seconds,
                world_size=self.world_size,
                on_event=self.on_event,
                out_of_memory=out_of_memory,
            )


def _run_group(
    *,
    world_size: int,
    cells: Sequence[Cell],
    pool: CellPool,
    lane: int,
    cores: tuple[int, ...],
    opts: RunOptions,
    stop: threading.Event,
) -> dict[str, CellOutcome]:
    """One process group of `world_size` on `cores`, running cells from `pool` until it is empty
    (or the group is lost, or `stop` is set: then its ranks are killed). `cells`: all the cells it
    may be handed."""
    # The server already runs when api.run warmed it up (then its preload list stands).
    ctx = rank_context(isolate=opts.isolate, preload=preload_modules(cells, opts.problems))
    events = ctx.Queue()
    commands = [ctx.Queue() for _ in range(world_size)]
    job = worker.GroupJob(
        world_size=world_size,
        port=free_port(),
        cells=tuple(cells),
        cores=cores,
        lane=lane,
        problems=dict(opts.problems),
        plugin_dirs=opts.plugin_dirs,
        run_dir=str(opts.run_dir),
        init_timeout_s=opts.init_timeout_s,
        accelerator_fp16=opts.accelerator_fp16,
    )
    procs = [
        ctx.Process(
            target=worker.worker_main,
            args=(rank, job, events, commands[rank]),
            name=f"gaeq-w{world_size}-l{lane}-r{rank}",
        )
        for rank in range(world_size)
    ]
    state = _GroupRun(world_size=world_size, lane=lane, cells=cells, pool=pool, commands=commands, opts=opts)
    with shm.group_on(job.port):  # a marker while it runs; DeepSpeed's shm segments freed after
        try:
            for p in procs:
                p.start()
            _watch(procs, events, state, stop=stop)
        finally:
            _stop(procs, graceful=state.stopped)
            for q in (events, *commands):
                q.close()
                q.cancel_join_thread()
    return state.outcomes


def _watch(procs: list, events, state: _GroupRun, *, stop: threading.Event) -> None:
    """Hand the ranks' messages to `state` until the group is done, fails (a rank failed or exited:
    the root cause named), makes no progress within its budget, or `stop` is set."""
    timeout_s, init_timeout_s = state.opts.timeout_s, state.opts.init_timeout_s
    deadline = time.monotonic() + init_timeout_s
    while not state.stopped and not stop.is_set():
        try:
            msg = events.get(timeout=0.2)
        except queue.Empty:
            msg = None
        if msg is not None and state.handle(msg):
            started = len(state.ready) == state.world_size
            deadline = time.monotonic() + (timeout_s if started else init_timeout_s)
        if state.failures or any(p.exitcode is not None for p in procs):
            # Ranks are exiting: either the group finished (last DONEs still in the pipe) or it is
            # failing. Let it settle, then name the root cause.
            _drain(events, state)
            if not state.stopped:
                why, rank, out_of_memory = _root_cause(procs, state)
                state.fail(why, rank=rank, out_of_memory=out_of_memory)
            return
        if time.monotonic() > deadline:
            started = len(state.ready) == state.world_size
            budget = timeout_s if started else init_timeout_s
            phase = "in the cell" if started else "while joining the process group"
            state.fail(f"timed out: no progress for {budget:.0f} s {phase} (a rank hangs?)", rank=None)
            return


def _drain(events, state: _GroupRun, *, seconds: float = 1.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not state.stopped:
        try:
            state.handle(events.get(timeout=0.1))
        except queue.Empty:
            pass


def _root_cause(procs: list, state: _GroupRun) -> tuple[str, int, bool]:
    """A rank that died without a word comes first: the errors its peers then report (a reset
    connection in a collective) are consequences. Otherwise a rank whose allocation failed, else the
    first rank that reported. (Why, which rank, whether it ran out of memory.)"""
    reported = {msg.rank for msg in state.failures}
    for rank, p in enumerate(procs):
        if p.exitcode is not None and rank not in reported:
            return f"rank {rank} {how_it_ended(p.exitcode)} before the cell finished", rank, False
    first = next((msg for msg in state.failures if msg.out_of_memory), state.failures[0])
    if first.out_of_memory and state.current is not None:
        micro = state.current.micro_batch_size
        said = raised(micro_batch_size=micro, world_size=state.world_size, rank=first.rank, error=first.reason)
        return said, first.rank, True
    return f"rank {first.rank} failed: {first.reason}", first.rank, False


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
