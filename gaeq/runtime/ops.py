"""DeepSpeed's C++ ops a run needs, built once by the parent before any cell's deadline starts.

DeepSpeed JIT-compiles an op on its first use on a machine and caches it in torch's extensions folder
(`~/.cache/torch_extensions/<py>_<cpu|cuXY>/<op>`, or under $TORCH_EXTENSIONS_DIR): on 2 cores its CPU comm
op takes ~25 s, its async-I/O op (nvme offload) 3.5–8.5 min. Built inside a rank, that time counts against
the rank's deadline, and a rank killed by the deadline leaves torch's build lock behind (`<op>/lock`, no
library): every later build of that op waits on the lock for ever. So `gaeq run` asks first which ops its
cells need (`needed`), builds the missing ones in a process of its own with the build shown as progress
(`ensure_built`), and names a lock no live build holds (`StaleBuild`) with the command that clears it.

`python -m gaeq.runtime.ops BUILDER` is that process: one JSON line when it knows the op's state (built,
stale, building, none: not on this accelerator or machine), and one more when a build ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gaeq.accelerator import has_cuda
from gaeq.matrix import Cell
from gaeq.problem.script import Launcher
from gaeq.problem.spec import ProblemSpec
from gaeq.registry import DEEPSPEED_TRAINERS
from gaeq.runtime.events import Event, EventKind, OnEvent

STALE_AFTER_S = 60.0
"""A lock older than this, with no library beside it and no process building in its folder, is a dead
build's (torch's FileBaton: the builder holds the file while its compiler runs)."""


@dataclass(frozen=True)
class Op:
    builder: str
    """DeepSpeed's op builder, by its class name (the accelerator resolves it: `create_op_builder`)."""
    name: str
    """Its extension's name (the builder's NAME): its folder and library in torch's extensions folder."""
    why: str


COMM = Op("ShareMemCommBuilder", "deepspeed_shm_comm", "DeepSpeed's CPU collectives")
ASYNC_IO = Op("AsyncIOBuilder", "async_io", "nvme offload's swaps")
FUSED_ADAM = Op("FusedAdamBuilder", "fused_adam", "the config's Adam (DeepSpeed's FusedAdam)")
CPU_ADAM = Op("CPUAdamBuilder", "cpu_adam", "the config's Adam under offload (DeepSpeed's CPU Adam)")


class StaleBuild(RuntimeError):
    """An op's build folder holds a lock and no library, and no process is building there."""


def needed(cells: Iterable[Cell], problems: Mapping[str, ProblemSpec]) -> list[Op]:
    """The ops the cells' ranks would build on first use: on a machine without CUDA, the comm op for any
    cell DeepSpeed runs (gaeq's DeepSpeed trainers, a script given a DeepSpeed config or launcher); async-I/O
    for nvme offload; and DeepSpeed's own Adam where a user's config asks for it, a matrix's or a script's
    (gaeq's own configs ask torch's: torch_adam)."""
    ops: list[Op] = []
    on_cpu = not has_cuda()  # (the comm op is the CPU accelerator's; on CUDA, NCCL's collectives)
    for cell in cells:
        problem = problems[cell.variant]
        script = problem.script
        if on_cpu and (
            cell.trainer in DEEPSPEED_TRAINERS
            or (script is not None and (script.deepspeed_config is not None or script.launcher is Launcher.DEEPSPEED))
        ):
            ops.append(COMM)
        if cell.offload == "nvme":
            ops.append(ASYNC_IO)
        config = (problem.deepspeed_config or {}) if cell.trainer in DEEPSPEED_TRAINERS else {}
        if script is not None and script.deepspeed_config is not None:  # a script's engine builds its Adam too
            config = script.deepspeed_config
        optimizer = config.get("optimizer") or {}
        if optimizer.get("type", "").lower() in ("adam", "adamw") and not optimizer.get("params", {}).get("torch_adam"):
            ops.append(CPU_ADAM if cell.offload != "none" else FUSED_ADAM)
    return list(dict.fromkeys(ops))


def ensure_built(ops: Iterable[Op], on_event: OnEvent) -> None:
    """Build each op that is not built yet, one after another, in a process of its own (the parent imports
    neither torch nor DeepSpeed for it). Raises StaleBuild for a dead build's lock, RuntimeError for a build
    that failed (with its output's tail)."""
    for op in ops:
        if built_here(op):  # (the common case, told without starting torch: a run pays nothing for it)
            continue
        proc = subprocess.Popen(
            build_command(op),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its group: ninja and the compilers it starts, stopped with it
        )
        said, lines, started, what = {}, [], time.perf_counter(), f"{op.builder} ({op.why})"
        try:
            for line in proc.stdout:
                lines.append(line)
                if not line.startswith("{"):
                    continue
                said = json.loads(line)
                if said["state"] in ("building", "waiting"):
                    waiting = f"{said['dir']} ({said['for']:.0f} s so far)" if said["state"] == "waiting" else None
                    on_event(Event(kind=EventKind.BUILD, world_size=0, op=what, waiting_on=waiting))
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: the build and every compiler it started (a killed build's
                with contextlib.suppress(ProcessLookupError):  # compilers would write on into the folder)
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if said.get("state") == "stale":
            raise StaleBuild(
                f"DeepSpeed's {what}: a build left unfinished in {said['dir']} — a lock, no "
                "library, and no process building there (a killed build's). Every build of it would wait on "
                f"that lock for ever: clear it with `rm -rf {said['dir']}`, then run again"
            )
        if code != 0 or said.get("state") not in ("built", "none"):
            raise RuntimeError(f"building DeepSpeed's {op.builder} failed (exit {code}):\n{''.join(lines[-20:])}")
        if said.get("seconds") is not None:
            seconds = time.perf_counter() - started
            on_event(Event(kind=EventKind.BUILD, world_size=0, op=what, seconds=seconds))


def build_command(op: Op) -> list[str]:
    """The process that builds `op` (this module's own `_main`), printing its state as JSON lines."""
    return [sys.executable, "-m", "gaeq.runtime.ops", op.builder]


def built_here(op: Op) -> bool:
    """Whether torch's extensions folder holds the op's library (`library`). False when unsure: the build
    process then looks, exactly."""
    return library(op) is not None


def library(op: Op) -> Path | None:
    """The op's library in the folder torch builds into for this Python (``$TORCH_EXTENSIONS_DIR/<op>``, else
    ``~/.cache/torch_extensions/py<XY>_<cpu|cuXY>/<op>``), or None where it was not built there."""
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        found = [Path(root) / op.name / f"{op.name}.so"]
    else:
        python = f"py{sys.version_info.major}{sys.version_info.minor}_"
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
        found = [folder / op.name / f"{op.name}.so" for folder in cache.glob(python + "*")]
    return next((path for path in found if path.exists()), None)


def stale(folder: Path, library: Path, *, now: float | None = None) -> bool:
    """Whether `folder`'s build lock is a dead build's: no library, a lock older than STALE_AFTER_S, and no
    live process whose command line names the folder, or that works in it (ninja runs there, its targets
    relative)."""
    lock = folder / "lock"
    if library.exists() or not lock.exists():
        return False
    if (now or time.time()) - lock.stat().st_mtime < STALE_AFTER_S:
        return False
    return not any(str(folder) in cmd or cwd.is_relative_to(folder) for cmd, cwd in _processes())


def _processes() -> list[tuple[str, Path]]:
    """Every live process's command line and working folder (those this user may read)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((cmd, Path(os.readlink(entry / "cwd"))))
            except OSError:
                continue
    return found


def _main(builder_name: str) -> int:
    known = [op.builder for op in (COMM, ASYNC_IO, FUSED_ADAM, CPU_ADAM)]
    if builder_name not in known:  # (DeepSpeed answers any other name with a builder that builds nothing)
        sys.stderr.write(f"usage: python -m gaeq.runtime.ops BUILDER, one of {', '.join(known)}\n")
        return 2
    from gaeq.runtime import lifeline
    from gaeq.runtime.dist import set_accelerator_env

    lifeline.bind_to_parent()  # a killed gaeq takes its build with it (its group: ninja, the compilers)
    set_accelerator_env()
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None or not builder.is_compatible(verbose=False):
        print(json.dumps({"state": "none"}), flush=True)
        return 0
    folder = Path(_get_build_directory(builder.NAME, verbose=False))
    library = folder / f"{builder.NAME}.so"
    if library.exists():
        print(json.dumps({"state": "built", "dir": str(folder)}), flush=True)
        return 0
    if stale(folder, library):
        print(json.dumps({"state": "stale", "dir": str(folder)}), flush=True)
        return 0
    try:  # another process builds it now (its lock, not stale): torch's lock makes this one wait for it
        said = {"state": "waiting", "dir": str(folder), "for": time.time() - (folder / "lock").stat().st_mtime}
    except OSError:
        said = {"state": "building", "dir": str(folder)}
    print(json.dumps(said), flush=True)
    started = time.perf_counter()
    builder.load(verbose=False)
    print(json.dumps({"state": "built", "dir": str(folder), "seconds": time.perf_counter() - started}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(_main(sys.argv[1] if len(sys.argv) > 1 else ""))
