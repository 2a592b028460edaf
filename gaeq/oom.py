"""Out of memory, told from what a rank left — never guessed from sizes.

Two ways a training process runs out of memory:

- an allocation fails and raises: torch's `OutOfMemoryError` (CUDA's, and DeepSpeed's, which is torch's),
  the CPU allocator's `RuntimeError` ("DefaultCPUAllocator: can't allocate memory"), Python's
  `MemoryError` — anywhere in the exception's chain (:func:`is_out_of_memory`, no torch imported);
- the kernel's OOM killer sends SIGKILL. How sure that is comes from the kernel itself
  (:func:`oom_killer`): its log naming the process is sure, its count of kills rising while the rank
  ran is likely, and nothing readable leaves it a possibility only.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

MESSAGES = (
    "out of memory",  # CUDA's, HIP's, MPS's, XPU's "… out of memory", DeepSpeed's
    "can't allocate memory",  # torch's CPU allocator (c10 alloc_cpu)
    "cannot allocate memory",  # errno 12 (ENOMEM) in words
    "not enough memory",  # torch's older CPU allocator
    "std::bad_alloc",  # a C++ extension's allocation
    "cublas_status_alloc_failed",
)
"""Lower-case words of an allocation failure's message, where its type is a plain RuntimeError."""

KERNEL_KILL = re.compile(r"Killed process (\d+)")
"""The kernel log's line when its OOM killer kills a process ('Out of memory: Killed process 123 (python)')."""
VMSTAT = Path("/proc/vmstat")


def at(*, micro_batch_size: int, world_size: int) -> str:
    """How a split that ran out of memory is named, the start of its cell's reason."""
    return f"out of memory at micro batch {micro_batch_size} (world {world_size})"


def raised(*, micro_batch_size: int, world_size: int, rank: int, error: str) -> str:
    """A cell's reason where a rank's allocation failed: the split named, the rank, what it raised."""
    return f"{at(micro_batch_size=micro_batch_size, world_size=world_size)}: rank {rank} raised {error}"


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether `exc`, or an exception it was raised from or while handling, is a failed allocation."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
            return True
        if any(words in str(exc).lower() for words in MESSAGES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class Sure(Enum):
    """How sure a SIGKILL is the OOM killer's."""

    SURE = "sure"
    """The kernel's log names the process."""
    LIKELY = "likely"
    """The kernel's count of OOM kills rose while the process ran (its log not readable, or naming another pid:
    a process in a container has another pid there)."""
    UNKNOWN = "unknown"
    """Neither can be read here: SIGKILL is the OOM killer's signal, but nothing says it sent it."""


@dataclass(frozen=True)
class OomKill:
    sure: Sure
    evidence: str

    @property
    def out_of_memory(self) -> bool:
        """Said as out of memory (the kernel's own word for it), not as a possibility."""
        return self.sure is not Sure.UNKNOWN


def kill_count() -> int | None:
    """The kernel's count of processes its OOM killer has killed since boot (/proc/vmstat's oom_kill;
    None where it cannot be read)."""
    try:
        for line in VMSTAT.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def kernel_log() -> str | None:
    """The kernel's ring buffer (`dmesg`), None where this user may not read it."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def oom_killer(pid: int, *, before: int | None) -> OomKill | None:
    """Whether the kernel's OOM killer sent the SIGKILL that ended process `pid`, and how sure that is;
    `before` is :func:`kill_count` when the process started. None: it did not — its count of kills is
    readable and did not rise (someone else sent the signal)."""
    log = kernel_log()
    if log is not None and str(pid) in KERNEL_KILL.findall(log):
        return OomKill(Sure.SURE, f"the kernel's log says its OOM killer killed the rank's process {pid}")
    after = kill_count()
    if before is not None and after is not None:
        if after == before:
            return None
        rose = f"the kernel's count of OOM kills rose by {after - before} while it ran"
        return OomKill(Sure.LIKELY, f"{rose} ({'its log names other pids' if log else 'its log is not readable here'})")
    return OomKill(Sure.UNKNOWN, "SIGKILL is the OOM killer's signal, but neither its log nor its count is readable")
