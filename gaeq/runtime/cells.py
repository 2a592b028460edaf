"""What every launch path shares about a run's cells: its options, how a cell fails, when a
resumed cell may start. (`launch.py` for gaeq's own ranks, `external.py` for torchrun/deepspeed.)"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gaeq.accelerator import forced_fp16
from gaeq.matrix import Cell, Role
from gaeq.problem.spec import ProblemSpec
from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.results.trace import cell_dir
from gaeq.runtime import crashes
from gaeq.runtime.events import Event, EventKind, OnEvent, ignore

DEFAULT_INIT_TIMEOUT_S = 600.0
"""Joining a group (DeepSpeed's ops are built before, by the parent: gaeq.runtime.ops; a rank loads them)."""
LOG_TAIL_LINES = 12
LAUNCHERS = ("local", "torchrun", "deepspeed")
"""Who starts the ranks: gaeq itself, or that launcher (once per world size, on `gaeq worker`)."""


def check_launch(*, launcher: str, isolate: bool, lanes: int | None) -> None:
    """The launch options' rules, in one place (the CLI and the API ask before any process starts;
    :class:`RunOptions` asks again). ValueError says which rule, in words both read as theirs."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: one of {', '.join(LAUNCHERS)}")
    forced_fp16()  # GAEQ_ACCELERATOR_FP16: yes, no or unset (ValueError otherwise)
    if isolate and launcher != "local":
        raise ValueError(
            "isolate works with the local launcher only (an external launcher starts one group per world size)"
        )
    if lanes is not None and lanes < 1:
        raise ValueError(f"lanes {lanes}: at least 1")
    if lanes is not None and (isolate or launcher != "local"):
        raise ValueError(
            "lanes works with the local launcher only, without isolate "
            "(which runs one group per cell, one after another)"
        )


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a run's cells are run — the same for every group of the run."""

    problems: Mapping[str, ProblemSpec]
    """variant → problem"""
    run_dir: Path
    timeout_s: float
    """A cell whose ranks make no progress for this long is `error`."""
    plugin_dirs: tuple[str, ...] = ()
    """Folders plugin modules are imported from (each rank puts them on its ``sys.path``)."""
    init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S
    isolate: bool = False
    """One fresh process group per cell (what one launch per configuration costs)."""
    lanes: int | None = None
    """At most this many groups of one world size side by side (None: as many as the cores hold)."""
    launcher: str = "local"
    """local (gaeq forks the ranks), torchrun or deepspeed (that launcher starts `gaeq worker`)."""
    accelerator_fp16: bool | None = field(default_factory=forced_fp16)
    """DeepSpeed's accelerator's fp16 answer forced in every rank (GAEQ_ACCELERATOR_FP16, read when the run
    begins), or None: its own (gaeq/accelerator.py)."""
    on_event: OnEvent = ignore

    def __post_init__(self) -> None:
        check_launch(launcher=self.launcher, isolate=self.isolate, lanes=self.lanes)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, headed by its name ('' for a missing or empty log) — or, where the
    process crashed in native code, its crash report: the signal and where each thread was."""
    text = path.read_text(errors="replace").rstrip().splitlines() if path.is_file() else []
    if (report := crashes.report_in(text)) is not None:
        return f"--- {path.name} (its crash report) ---\n" + "\n".join(report)
    text = text[-lines:]
    return f"--- {path.name} (last {len(text)} lines) ---\n" + "\n".join(text) if text else ""


def fail_cell(
    cell_id: str,
    why: str,
    *,
    run_dir: Path,
    logs: Iterable[Path] = (),
    seconds: float = 0.0,
    world_size: int = 0,
    on_event: OnEvent | None = None,
    out_of_memory: bool = False,
) -> CellOutcome:
    """The one way a cell fails: an `error` outcome whose reason is `why` followed by the tails of
    `logs`, written to the cell's directory, announced as its `end` event."""
    tails = "\n".join(t for t in map(log_tail, logs) if t)
    reason = f"{why}\n{tails}".rstrip()
    outcome = CellOutcome(status="error", seconds=seconds, reason=reason, out_of_memory=out_of_memory)
    write_outcome(cell_dir(run_dir, cell_id), outcome)
    if on_event is not None:
        on_event(Event(kind=EventKind.END, world_size=world_size, cell_id=cell_id, outcome=outcome))
    return outcome


def reference_blocker(cell: Cell, cells: Iterable[Cell], outcomes: Mapping[str, CellOutcome]) -> str | None:
    """Why an instrument of a group (a noise-floor twin, the detection limit's cell) is not run (None: it is): its
    reference, whose split it trains, ran out of memory — it would too."""
    if cell.role not in (Role.FLOOR, Role.SENSITIVITY):
        return None
    base = next((c for c in cells if c.group == cell.group and c.role is Role.BASELINE), None)
    ended = outcomes.get(base.id) if base is not None else None
    if ended is None or not ended.out_of_memory:
        return None
    return f"not run: the reference {base.id} ran out of memory, and this instrument trains its split"


def resume_blocker(cell: Cell, *, source: CellOutcome | None, convert: Callable[[], str | None]) -> str | None:
    """Why a resumed cell cannot start (None: it can): its source did not finish, or — for a
    universal resume — `convert()` (ds_to_universal, once per source and step) failed."""
    src, step = cell.resume.source, cell.resume.step
    if source is None or source.status != "done":
        return f"source cell {src} did not finish: no checkpoint to resume"
    if cell.resume.universal and (failed := convert()):
        return f"universal conversion of {src} at step {step} failed: {failed}"
    return None
