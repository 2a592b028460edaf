"""A user's script under a real launcher: what each rank of ``gaeq worker`` does for the script cells
of its world size — one launch per world size, as for gaeq's own cells, on one node
(``gaeq run --launcher torchrun|deepspeed``) or on a cluster (``torchrun --nnodes N … -m gaeq worker``).

For each cell, every rank starts ``python -m gaeq.script.attach SCRIPT ARGS`` — a fresh interpreter,
the script as ``python SCRIPT ARGS`` runs it with the probe loaded first — in the environment the
launcher gave that rank. Two things differ from the launcher's own start, both where the ranks meet:
a script cell's ranks join their own process group at ``MASTER_PORT + 1 + k`` (its index among the
launch's script cells: each cell is a fresh group, and a store a previous cell's group used cannot be
met again), served by rank 0's script as ``env://`` does, not by torchrun's agent
(``TORCHELASTIC_USE_AGENT_STORE`` is dropped). A script written for DeepSpeed's launcher gets the
``--local_rank`` it adds; one written for accelerate's, its ``ACCELERATE_*`` defaults (``accelerate
launch --multi_gpu`` is torchrun with those).

No torch here: a rank of ``gaeq worker`` that only starts scripts does not import it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gaeq.matrix import Cell
from gaeq.problem.script import Launcher
from gaeq.problem.spec import ProblemSpec
from gaeq.results.outcome import read_outcome, write_outcome
from gaeq.results.trace import TRACE_FILE
from gaeq.runtime import lifeline, shm
from gaeq.runtime.cells import fail_cell
from gaeq.runtime.crashes import how_it_ended
from gaeq.script.launch import conclude, out_of_memory, prepare, rank_log
from gaeq.script.launchers import worker_args, worker_env

AGENT_ONLY = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
"""What torchrun tells its workers about its agent, which a script cell's group does not use."""


def cell_port(base: int, k: int) -> int:
    """The port the `k`-th script cell of a launch on `base` meets on: a fresh group per cell."""
    return base + 1 + k


def run_launched_script_cells(cells: Sequence[Cell], *, problem: ProblemSpec, run_dir: Path, timeout_s: float) -> int:
    """This rank's part of every script cell of `cells`, one after another: 0 when each finished, 1
    when one failed (its outcome says why; the rank exits and the launcher stops the others)."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    base = int(os.environ["MASTER_PORT"])
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # the launcher stops its workers: each stops its script
    for k, cell in enumerate(cells):
        out, args, env = prepare(cell, problem, run_dir=run_dir)
        port = cell_port(base, k)
        env = {key: value for key, value in os.environ.items() if key not in AGENT_ONLY} | env
        env |= {"MASTER_PORT": str(port), **_launcher_extras(problem.script.launcher, env)}
        started = time.perf_counter()
        code = _run_rank(
            [sys.executable, "-m", "gaeq.script.attach", problem.script.path]
            + worker_args(problem.script.launcher, rank=local_rank)
            + args,
            env=env,
            cwd=problem.script.cwd,
            log=rank_log(out, rank),
            timeout_s=timeout_s,
        )
        seconds = time.perf_counter() - started
        if rank != 0:  # rank 0 concludes; another rank reports only a failure before the trace was published
            if code == 0 or (out / TRACE_FILE).is_file():
                continue
            oom = out_of_memory(cell, out=out)  # a peer's failed allocation: the cause, whoever noticed first
            ended = f"ran past {timeout_s:.0f} s" if code is None else how_it_ended(code)
            why = oom or f"rank {rank}'s script {ended}"
        else:
            ran = {"launched_by": f"{_launcher()} (gaeq worker, a fresh interpreter per rank)"}
            outcome = conclude(cell, problem, out=out, args=args, code=code, seconds=seconds, timeout_s=timeout_s,
                               ran=ran)  # fmt: skip
            if outcome.status == "done":
                write_outcome(out, outcome)
                continue
            why, oom = outcome.reason, outcome.out_of_memory
        # The first rank to fail names the cause (its peers fail after it, "connection closed by peer").
        if read_outcome(out) is None:
            logs = [rank_log(out, r) for r in range(cell.world_size)]
            fail_cell(cell.id, why, run_dir=run_dir, logs=logs, seconds=seconds, world_size=cell.world_size,
                      out_of_memory=bool(oom))  # fmt: skip
        return 1
    return 0


def _launcher() -> str:
    """Which launcher started this rank, as its environment tells."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    return "deepspeed" if "CROSS_RANK" in os.environ else "a launcher"


def _launcher_extras(launcher: Launcher, env: dict[str, str]) -> dict[str, str]:
    """What the script's own launcher adds to the one that started gaeq worker: accelerate's defaults."""
    if launcher is not Launcher.ACCELERATE:
        return {}
    ours = worker_env(launcher, rank=0, world_size=1, port=0)
    return {key: value for key, value in ours.items() if key.startswith("ACCELERATE_") and key not in env}


def _run_rank(cmd: list[str], *, env: dict[str, str], cwd: str, log: Path, timeout_s: float) -> int | None:
    """Run one rank of the script: its exit code, or None when it ran past `timeout_s` (then it is
    killed). It runs in a session of its own, which goes with it — and with this rank, however that
    ends; so does the shared memory DeepSpeed's comm op made for it (on a cluster nobody else frees it)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=lifeline.die_with_parent(),
        )  # fmt: skip
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what the script started, too
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        shm.release_shm_buffers(addr=env["MASTER_ADDR"], port=env["MASTER_PORT"], rank=int(env["RANK"]))


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through _run_rank's finally: the script's session is killed
