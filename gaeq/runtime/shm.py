"""DeepSpeed's shared memory: freed after every group, and after runs that were killed.

DeepSpeed's CPU comm op (ops/csrc/cpu/comm/shm.cpp) creates one 66 MB segment per rank and
process group, ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, and never
unlinks it: each group would leak 66 MB of RAM per rank until reboot (a test suite: gigabytes).
gaeq unlinks a group's segments once its ranks are gone (:func:`release_group`).

A `gaeq` that is killed (SIGKILL, the OOM killer) cannot. So while a group runs, a marker
``/dev/shm/gaeq_group_<uid>_<port>`` names the `gaeq` process that owns it (PID and start time, so
that a reused PID is not mistaken for it); the next `gaeq run` removes the segments of every
marker whose owner is gone and which no live process still maps (:func:`free_orphans`) — only
those: never a live run's, never another program's (no marker, no removal).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
LOCALHOST = "127.0.0.1"


def segments(*, port: int | str, addr: str = LOCALHOST, rank: int | None = None) -> list[Path]:
    """The segments DeepSpeed's comm op made for the group on `addr`:`port` (one rank's, with `rank`)."""
    return sorted(
        SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{'*' if rank is None else rank}")
    )


def release_shm_buffers(*, port: int | str, addr: str = LOCALHOST, rank: int | None = None) -> list[Path]:
    """Unlink a group's segments. Call it once the group's ranks are gone (or, for `rank`, from that
    rank after the group is destroyed: on a cluster nobody else can). Returns what was removed."""
    removed = []
    for path in segments(port=port, addr=addr, rank=rank):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _marker(port: int | str) -> Path:
    return SHM_DIR / f"gaeq_group_{os.getuid()}_{port}"


@contextlib.contextmanager
def group_on(port: int) -> Iterator[None]:
    """While a local group runs on `port`: its marker; afterwards its segments and marker go."""
    marker = _marker(port)
    if SHM_DIR.is_dir():
        marker.write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    try:
        yield
    finally:
        release_shm_buffers(port=port)  # the ranks are gone: DeepSpeed never frees these
        marker.unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True)
class Freed:
    segments: int
    bytes: int
    owners: tuple[tuple[int, float], ...] = ()
    """Whose they were: each gone `gaeq`'s PID, and when it started the group (its marker's time)."""

    def whose(self) -> str:
        """`gaeq 48213 (its group started 07:32:05)`, each owner once."""
        return ", ".join(
            f"gaeq {pid} (its group started {time.strftime('%H:%M:%S', time.localtime(at))})" for pid, at in self.owners
        )


def free_orphans() -> Freed:
    """Remove the segments of groups whose `gaeq` is gone and that no live process maps."""
    mapped: set[str] | None = None
    count = size = 0
    owners = []
    for marker in sorted(SHM_DIR.glob(f"gaeq_group_{os.getuid()}_*")):
        try:
            pid, started = marker.read_text().split()
            at = marker.stat().st_mtime
        except (OSError, ValueError):
            continue
        if _start_time(int(pid)) == started:
            continue  # its gaeq is alive: a running group
        port = marker.name.rsplit("_", 1)[1]
        left = segments(port=port)
        mapped = mapped_segments() if mapped is None and left else mapped
        for path in left:
            if str(path) in (mapped or set()):
                continue  # a rank of the killed run still lives (and is about to die): next time
            with contextlib.suppress(FileNotFoundError):
                bytes_ = path.stat().st_size
                path.unlink()
                count, size = count + 1, size + bytes_
                owners += [(int(pid), at)] if (int(pid), at) not in owners else []
        if not segments(port=port):
            marker.unlink(missing_ok=True)
    return Freed(segments=count, bytes=size, owners=tuple(owners))


def owner(port: int | str) -> int | None:
    """The PID of the `gaeq` that runs (or ran, and was killed) the group on `port`, from its marker (None: none)."""
    try:
        return int(_marker(port).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def port_of(segment: str) -> str:
    """The group port in a segment's name (`deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`)."""
    return segment.rsplit("_", 2)[1]


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the name in parentheses may hold spaces


def mapped_segments() -> set[str]:
    """Every /dev/shm DeepSpeed segment some live process maps."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if "/dev/shm/deepspeed_allreduce_buffer_" in line:
                mapped.add(line.split(maxsplit=5)[-1].removesuffix(" (deleted)"))
    return mapped
