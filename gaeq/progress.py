"""What `gaeq run` shows while it trains (the CLI's, like the rest of the terminal): a bar over
the cells, one row per process group running side by side with its current cell's steps, and a
line for what needs saying at once (a cell's error, /dev/shm freed). Each :class:`Event` of
:mod:`gaeq.runtime.events` moves it."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from gaeq.runtime.events import Event, EventKind


class RunProgress:
    """`with RunProgress(console, cells=n, steps=s) as on_event:` — the callback `api.run` takes."""

    def __init__(self, console: Console, *, cells: int, steps: int) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=not console.is_terminal,  # off a terminal (CI logs) only the lines printed stay
        )
        self.cells, self.steps = cells, steps
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
                "buffer(s) left by gaeq runs that were killed"
            )
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
        elif kind == EventKind.END:
            self.progress.advance(self.overall)
            if event.outcome.status == "error":
                self.say(f"[bold red]error[/] {event.cell_id}: {escape(event.outcome.reason.splitlines()[0])}")

    def say(self, line: str) -> None:
        """A line above the bars (it stays when they go)."""
        self.progress.console.print(line, highlight=False)
