"""Progress of a run, for whoever owns the terminal (the CLI) or calls the API (a notebook).

Events are plain data, made in the `gaeq run` process (from its launcher's loop) and handed to one
callback; library code never prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gaeq.names import Name
from gaeq.results.outcome import CellOutcome


class EventKind(Name):
    GROUP = "group"
    """A process group starts."""
    START = "start"
    STEP = "step"
    END = "end"
    """Of a cell: it started, made an optimizer step, ended (`outcome`)."""
    CONVERT = "convert"
    """ds_to_universal converts a resume source's checkpoint."""
    SHM_FREED = "shm_freed"
    """Shared memory that killed runs left was removed."""
    BUILD = "build"
    """DeepSpeed JIT-builds an op the run needs (first use on this machine): `op`; `seconds` once built."""
    MORE = "more"
    """`cells` more to run: the references `baseline: auto` chose from what ran, and their instruments."""


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: EventKind
    world_size: int
    lane: int = 0
    """Which of the groups of this world size running side by side (0 when only one runs)."""
    cell_id: str | None = None
    step: int | None = None
    outcome: CellOutcome | None = None
    """end: how the cell ended."""
    freed_bytes: int = 0
    """shm_freed: bytes of /dev/shm freed."""
    freed_segments: int = 0
    """shm_freed: how many segments."""
    freed_from: str = ""
    """shm_freed: whose they were (gaeq.runtime.shm.Freed.whose)."""
    op: str | None = None
    """build: the op being built (gaeq.runtime.ops)."""
    seconds: float | None = None
    """build: how long it took, once built (None while it builds)."""
    waiting_on: str | None = None
    """build: the folder another process is building the op in, that this run waits for (its lock held, its
    compilers alive: gaeq.runtime.ops.stale), and for how long it has been building."""
    cells: int = 0
    """more: how many cells are added to the run."""


OnEvent = Callable[[Event], None]


def ignore(event: Event) -> None:
    """The default callback."""
