"""What `gaeq run` shows while it trains (the CLI's, like the rest of the terminal): a bar over
the cells, one row per process group running side by side with its current cell's steps, and a
line for what needs saying at once (a cell's error, /dev/shm freed). Each :class:`Event` of
:mod:`gaeq.runtime.events` moves it."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from gaeq.matrix import Matrix, Role
from gaeq.runtime.events import Event, EventKind


class RunProgress:
    """`with RunProgress(console, cells=n, steps=s) as on_event:` — the callback `api.run` takes."""

    def __init__(
        self,
        console: Console,
        *,
        cells: int,
        steps: int,
        clock: Callable[[], float] = time.monotonic,
        tried: frozenset[str] = frozenset(),
    ) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=not console.is_terminal,  # off a terminal (CI logs) only the lines printed stay
        )
        self.cells, self.steps, self.tried = cells, steps, tried
        """`tried`: references `baseline: auto` tries first — out of memory there is a step, said as one."""
        self.clock, self.started, self.ended = clock, clock(), 0
        self.rows: dict[int, TaskID] = {}
        """lane → its row (one per group of a world size running side by side)."""

    def __enter__(self) -> RunProgress:
        self.progress.__enter__()
        self.overall = self.progress.add_task("cells", total=self.cells)
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def row(self, lane: int) -> TaskID:
        if lane not in self.rows:
            self.rows[lane] = self.progress.add_task("", total=self.steps, visible=False)
        return self.rows[lane]

    def __call__(self, event: Event) -> None:
        current, kind = self.row(event.lane), event.kind
        if kind == EventKind.GROUP:
            where = f"world size {event.world_size}" + (f", lane {event.lane}" if event.lane else "")
            self.progress.update(current, description=f"  starting {where}", completed=0, visible=True)
        elif kind == EventKind.SHM_FREED:
            self.say(
                f"freed {event.freed_bytes / 2**20:.0f} MB of /dev/shm: {event.freed_segments} all-reduce "
                f"buffer{'s' if event.freed_segments != 1 else ''} that {event.freed_from} left, ended without "
                "freeing them (killed, or crashed)"
            )
        elif kind == EventKind.BUILD and event.waiting_on is not None:
            self.say(f"waiting for {event.op}: another process is building it in {event.waiting_on}")
            self.progress.update(current, description=f"  waiting for {event.op.split(' (')[0]}", visible=True)
        elif kind == EventKind.BUILD and event.seconds is None:
            self.say(f"building {event.op}: its first use on this machine (cached after; before any cell starts)")
            self.progress.update(current, description=f"  building {event.op.split(' (')[0]}", visible=True)
        elif kind == EventKind.BUILD:
            self.say(f"built {event.op} in {event.seconds:.0f} s")
        elif kind == EventKind.CONVERT:
            where = f"  ds_to_universal {event.cell_id} @ step {event.step}"
            self.progress.update(current, description=where, visible=True)
        elif kind == EventKind.START:
            self.progress.update(current, description=f"  {event.cell_id}", completed=0, visible=True)
        elif kind == EventKind.STEP:
            self.progress.update(current, completed=event.step + 1)
        elif kind == EventKind.MORE:
            self.cells += event.cells
            self.progress.update(self.overall, total=self.cells, description=self.left())
        elif kind == EventKind.END:
            self.ended += 1
            self.progress.update(self.overall, advance=1, description=self.left())
            if event.outcome.status == "error" and event.outcome.out_of_memory and event.cell_id in self.tried:
                self.say(
                    f"{event.cell_id} ran out of memory: as `baseline: auto` allows, the reference will be GA 1 at the "
                    "largest micro batch a split ran at"
                )
            elif event.outcome.status == "error":
                self.say(f"[bold red]error[/] {event.cell_id}: {escape(event.outcome.reason.splitlines()[0])}")

    def left(self) -> str:
        """The bar's label: the time left, estimated from the launches that ended (at the pace they ended)."""
        if not self.ended or self.ended >= self.cells:
            return "cells"
        seconds = (self.clock() - self.started) / self.ended * (self.cells - self.ended)
        return f"cells, about {seconds / 60:.0f} min left" if seconds >= 90 else f"cells, about {seconds:.0f} s left"

    def say(self, line: str) -> None:
        """A line above the bars (it stays when they go), unbroken: it may hold a path or a command to copy."""
        self.progress.console.print(line, highlight=False, soft_wrap=True)


def plan_line(m: Matrix) -> str:
    """The run's cost before it is spent: its launches (splits, references, instruments) and steps each."""
    runnable = m.runnable()
    count = {role: sum(c.role is role for c in runnable) for role in Role}
    parts = [f"{count[Role.CELL]} split{'s' * (count[Role.CELL] != 1)}"]
    references = count[Role.BASELINE]
    parts.append(f"{references} reference{'s' * (references != 1)}")
    twins, limits = count[Role.FLOOR], count[Role.SENSITIVITY]
    if m.auto:  # its instruments come once its references are chosen
        twins = references * m.spec.floor_twins * m.spec.noise_floor
        limits = references * m.spec.detection_limit
        parts[-1] += " (auto: world 1 with the whole batch first; where it runs out of memory, one more at GA 1)"
    parts += [f"{twins} noise-floor twin{'s' * (twins != 1)}", f"{limits} detection limit{'s' * (limits != 1)}"]
    runs = sum(count.values()) - count[Role.FLOOR] - count[Role.SENSITIVITY] + twins + limits
    steps = sorted({m.problems[c.variant].steps for c in runnable}) or [m.problem.steps]
    each = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"
    return f"Plan: {runs} run{'s' * (runs != 1)} of {each} step{'s' * (each != '1')} each — {', '.join(parts)}"
