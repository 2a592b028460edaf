"""Running under someone else's launcher: torchrun, DeepSpeed's `deepspeed`, a cluster's wrapper.

Two halves:

- :func:`launched_main` is ``gaeq worker``: what the launcher starts on every rank. It reads its
  place from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
  runs the matrix's cells whose world size is the launched one — cells from scratch first, then
  resumed cells whose source checkpoint is in the run directory — and rank 0 writes each cell's
  trace and outcome into the shared run directory. ``gaeq report RUN_DIR`` judges them.
- :func:`run_launched_group` is what ``gaeq run --launcher torchrun|deepspeed`` does per world size
  on one node: it starts that launcher on ``gaeq worker`` and watches the run directory, with the
  same deadlines and failure reasons as the local launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gaeq.accelerator import forced_fp16
from gaeq.matrix import MATRIX_FILE, Cell, Matrix
from gaeq.oom import is_out_of_memory, raised
from gaeq.results.outcome import CellOutcome, read_outcome, write_outcome
from gaeq.results.trace import cell_dir
from gaeq.runtime import dist, lifeline, shm, worker
from gaeq.runtime.cells import LAUNCHERS, RunOptions, fail_cell, resume_blocker
from gaeq.runtime.events import Event, EventKind

# --- the rank side: `gaeq worker` ---------------------------------------------------------------


def cells_for_launch(matrix: Matrix, *, world_size: int, only: Sequence[str] = ()) -> list[Cell]:
    """The runnable cells of this world size (restricted to `only` if given), scratch cells first."""
    cells = [c for c in matrix.runnable() if c.world_size == world_size and (not only or c.id in only)]
    if only and (unknown := set(only) - {c.id for c in matrix.cells}):
        raise ValueError(f"no cell {', '.join(sorted(unknown))} in the matrix")
    if not cells:
        sizes = sorted({c.world_size for c in matrix.runnable()})
        raise ValueError(f"no cell of world size {world_size} to run (the matrix has world sizes {sizes})")
    return [c for c in cells if c.resume is None] + [c for c in cells if c.resume is not None]


def launched_main(*, matrix: Matrix, run_dir: Path, only: Sequence[str] = (), init_timeout_s: float = 600.0) -> int:
    """Run this rank's share of the matrix; 0 when every cell finished, 1 when one failed. (A script
    matrix's cells: gaeq.script.launched — this rank starts the script's rank of each.)

    A failing cell gets an ``error`` outcome written by the rank that failed (with its reason);
    the rank then exits non-zero, which makes the launcher stop the others.
    """
    me = dist.rank_from_env()
    cells = cells_for_launch(matrix, world_size=me.world_size, only=only)
    if matrix.problem.script is not None:  # a user's script: each cell's ranks are scripts of their own
        from gaeq.script.launched import run_launched_script_cells

        return run_launched_script_cells(
            cells, problem=matrix.problem, run_dir=run_dir, timeout_s=matrix.spec.timeout_s
        )
    dist.set_accelerator_env()
    worker.set_up_rank(plugin_dirs=matrix.plugin_dirs, accelerator_fp16=forced_fp16())  # the launcher passed gaeq's env
    dist.join_from_env(
        with_deepspeed=any(c.joins_through_deepspeed for c in cells),
        with_nvme=any(c.offload == "nvme" for c in cells),
        timeout_s=init_timeout_s,
    )
    worker.group_ready()
    try:
        return _run_launched_cells(cells, me=me, matrix=matrix, run_dir=run_dir)
    finally:
        # A cluster has no gaeq parent to clean up after the ranks: each frees its own buffer.
        shm.release_shm_buffers(addr=os.environ["MASTER_ADDR"], port=os.environ["MASTER_PORT"], rank=me.rank)


def _run_launched_cells(cells: Sequence[Cell], *, me: dist.LaunchedRank, matrix: Matrix, run_dir: Path) -> int:
    for cell in cells:
        if cell.resume is not None and not _resume_ready(cell, rank=me.rank, run_dir=run_dir, matrix=matrix):
            continue
        try:
            done = worker.run_cell(
                cell,
                rank=me.rank,
                world_size=me.world_size,
                device=dist.device_for(me.local_rank),
                problem=matrix.problems[cell.variant],
                run_dir=run_dir,
            )
        except BaseException as exc:  # noqa: BLE001 - reported, then the launcher tears the group down
            # The first rank to fail names the cause: a peer that exits makes the others fail
            # after it ("connection closed by peer"), and their outcome must not replace its own.
            if read_outcome(cell_dir(run_dir, cell.id)) is None:
                out_of_memory, error = is_out_of_memory(exc), f"{type(exc).__name__}: {exc}"
                split = {"micro_batch_size": cell.micro_batch_size, "world_size": cell.world_size}
                why = raised(**split, rank=me.rank, error=error) if out_of_memory else f"rank {me.rank} failed: {error}"
                log = cell_dir(run_dir, cell.id) / f"rank{me.rank}.log"
                fail_cell(cell.id, why, run_dir=run_dir, logs=[log], out_of_memory=out_of_memory)
            return 1
        if me.rank == 0:
            write_outcome(cell_dir(run_dir, cell.id), done)
    dist.destroy_process_group()
    return 0


def _resume_ready(cell: Cell, *, rank: int, run_dir: Path, matrix: Matrix) -> bool:
    """A resumed cell may start when its source finished here (this or an earlier launch) and, for
    a universal resume, its checkpoint is converted — by rank 0, while the others wait."""
    import torch.distributed as tdist

    from gaeq.runtime.convert import convert_to_universal

    source, step = cell.resume.source, cell.resume.step
    reason = None
    if rank == 0:
        reason = resume_blocker(
            cell,
            source=read_outcome(cell_dir(run_dir, source)),
            convert=lambda: convert_to_universal(
                run_dir=run_dir, source_id=source, step=step, timeout_s=matrix.spec.timeout_s
            ),
        )
        if reason:
            fail_cell(cell.id, reason, run_dir=run_dir)
    verdict = [reason]
    tdist.broadcast_object_list(verdict, src=0)  # every rank skips, or every rank trains
    return verdict[0] is None


# --- the parent side: `gaeq run --launcher torchrun|deepspeed` -----------------------------------


def launcher_command(launcher: str, *, world_size: int, port: int) -> list[str]:
    """The single-node command line that starts `world_size` ranks of ``python -m gaeq``."""
    if launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "--module", "gaeq",
        ]  # fmt: skip
    if launcher == "deepspeed":
        # --no_local_rank: ranks read LOCAL_RANK from the environment, like torchrun's.
        return [
            sys.executable, "-m", "deepspeed.launcher.runner", "--num_nodes", "1", "--num_gpus", str(world_size),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "--no_local_rank", "--module", "gaeq",
        ]  # fmt: skip
    raise ValueError(f"unknown launcher {launcher!r}; one of {', '.join(LAUNCHERS)}")


def run_launched_group(*, world_size: int, cells: Sequence[Cell], opts: RunOptions) -> dict[str, CellOutcome]:
    """Start `opts.launcher` on ``gaeq worker`` for `cells` (all of one world size) and wait for
    their outcomes in the run directory (which holds the matrix as ``matrix.yaml``). Returns the
    outcomes of the cells that ended — finished, or failed (the first cell without an outcome when
    the launcher died or stalled); the caller launches again for the rest."""
    log = opts.run_dir / "logs" / f"{opts.launcher}-w{world_size}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    port = dist.free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("DS_ACCELERATOR", "cuda" if dist.has_cuda() else "cpu")
    with contextlib.ExitStack() as groups:
        for each in _ports(port, cells=cells, opts=opts):  # a marker while it runs; DeepSpeed's segments freed after
            groups.enter_context(shm.group_on(each))
        with log.open("ab") as out:
            # Its own session: a stalled or interrupted launch is killed with every rank it started.
            # (It dies with gaeq, too: a killed gaeq cannot kill it.)
            proc = subprocess.Popen(
                worker_command(opts, world_size=world_size, port=port, cells=cells),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=lifeline.die_with_parent(),
            )
        try:
            return _watch(proc, cells=cells, world_size=world_size, log=log, opts=opts)
        finally:
            _stop(proc)


def _ports(base: int, *, cells: Sequence[Cell], opts: RunOptions) -> list[int]:
    """Every port a launch on `base` meets on: a user's script cells each on one of their own."""
    if all(opts.problems[cell.variant].script is None for cell in cells):
        return [base]
    from gaeq.script.launched import cell_port

    return [base] + [cell_port(base, k) for k in range(len(cells))]


def worker_command(opts: RunOptions, *, world_size: int, port: int, cells: Sequence[Cell]) -> list[str]:
    """The launcher's command line: ``gaeq worker`` on the run directory's matrix, for `cells`."""
    cmd = launcher_command(opts.launcher, world_size=world_size, port=port)
    cmd += ["worker", "--matrix", str(opts.run_dir / MATRIX_FILE), "--out", str(opts.run_dir)]
    for folder in dict.fromkeys(opts.plugin_dirs):  # ordered, without repeats
        cmd += ["--search", folder]
    for cell in cells:
        cmd += ["--cell", cell.id]
    return cmd


def _watch(
    proc: subprocess.Popen, *, cells: Sequence[Cell], world_size: int, log: Path, opts: RunOptions
) -> dict[str, CellOutcome]:
    """The cells' outcomes as rank 0 writes them, in order, until one fails, the launcher exits
    without the next one, or none comes for `timeout_s` (after `init_timeout_s` for the first)."""
    outcomes: dict[str, CellOutcome] = {}
    deadline = time.monotonic() + opts.init_timeout_s
    pending = list(cells)
    opts.on_event(Event(kind=EventKind.START, world_size=world_size, cell_id=pending[0].id))
    while pending:
        outcome = read_outcome(cell_dir(opts.run_dir, pending[0].id))
        if outcome is not None:
            cell = pending.pop(0)
            outcomes[cell.id] = outcome
            opts.on_event(Event(kind=EventKind.END, world_size=world_size, cell_id=cell.id, outcome=outcome))
            if outcome.status != "done":  # the failing rank exits; the launcher stops the rest
                _wait(proc, seconds=30)
                break
            if not pending:  # the ranks end on their own: one killed mid-teardown leaves behind what it frees
                _wait(proc, seconds=30)
                break
            opts.on_event(Event(kind=EventKind.START, world_size=world_size, cell_id=pending[0].id))
            deadline = time.monotonic() + opts.timeout_s
            continue
        code = proc.poll()
        if code is not None:
            time.sleep(0.2)  # an outcome written just before the exit
            if read_outcome(cell_dir(opts.run_dir, pending[0].id)) is None:
                why = f"{opts.launcher} exited with code {code} before the cell finished"
                _fail(pending[0], why, log=log, outcomes=outcomes, world_size=world_size, opts=opts)
                break
            continue
        if time.monotonic() > deadline:
            why = f"timed out: no cell finished for {opts.timeout_s:.0f} s under {opts.launcher} (a rank hangs?)"
            _fail(pending[0], why, log=log, outcomes=outcomes, world_size=world_size, opts=opts)
            break
        time.sleep(0.2)
    return outcomes


def _fail(cell: Cell, why: str, *, log: Path, outcomes: dict, world_size: int, opts: RunOptions) -> None:
    from gaeq.script.launch import rank_log  # a script's ranks log under the script's names

    where = cell_dir(opts.run_dir, cell.id)
    logs = [where / f"rank{r}.log" for r in range(world_size)] + [rank_log(where, r) for r in range(world_size)] + [log]
    outcomes[cell.id] = fail_cell(
        cell.id, why, run_dir=opts.run_dir, logs=logs, world_size=world_size, on_event=opts.on_event
    )


def _wait(proc: subprocess.Popen, *, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def _stop(proc: subprocess.Popen) -> None:
    """A launcher that finished has exited; anything else is killed with its whole session."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)
