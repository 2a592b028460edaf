"""The Python API: load a matrix, run it, judge it, look at it. The CLI and the notebooks call this.

    import gaeq
    result = gaeq.run("experiments/ga.yaml", out="runs/ga")    # or a dict built in a notebook
    result.ok, result.verdicts()                                # {cell id: "match" | "diverge" | ...}
    result.curve("torch-w1-mb4-ga8", "grad_norm")                # (steps, values) from the trace
    result.plot()                                               # the overlay figure (matplotlib)
    gaeq.open_run("runs/ga", atol=1e-7)                         # re-judge a finished run

Nothing here prints: progress goes to `on_event`, problems are raised (`MatrixError` for bad input,
`FileExistsError` for an occupied run directory).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gaeq.files import atomic_write
from gaeq.matrix import MATRIX_FILE, Matrix, MatrixError, load_matrix, matrix_from_dict, with_references  # noqa: F401  (API)
from gaeq.results.cell_report import INSTRUMENTS
from gaeq.results.outcome import CellOutcome, read_outcome
from gaeq.results.overlay import OVERLAY_FILE, overlay_figure, plot_overlay
from gaeq.results.reference import choose, read_references, write_references
from gaeq.results.render import write_report
from gaeq.results.report import CellReport, Report, judge, record_versions, resolve_tolerances, run_versions
from gaeq.results.tensorboard import TB_DIR, write_tensorboard
from gaeq.results.trace import StepRecord, TraceStore, cell_dir

TOLERANCE_OVERRIDES = ("loss_atol", "loss_rtol", "grad_norm_rtol", "tensor_atol", "tensor_rtol")


def load(matrix: str | Path | Mapping[str, Any] | Matrix, *, check: bool = True) -> Matrix:
    """A validated, expanded matrix from a YAML file or a mapping of the same shape.

    With `check`, every problem (plugins included) is also built and two samples are pushed through
    it, so a broken model or loss fails here, in one line, before any process starts.
    Raises :class:`MatrixError`.
    """
    if isinstance(matrix, Matrix):
        return matrix
    m = matrix_from_dict(dict(matrix)) if isinstance(matrix, Mapping) else load_matrix(matrix)
    return check_problems(m) if check else m


def check_problems(m: Matrix) -> Matrix:
    """Build every problem of `m` and push two samples through it (MatrixError naming what failed);
    returns `m` with what the built models decide: an nvme cell that would swap nothing is skipped."""
    from gaeq.problem.build import check_problem, import_plugins_from

    import_plugins_from(m.plugin_dirs)
    numels = {}
    for name, problem in m.problems.items():
        if problem.script is not None:  # the script builds its own (its launch is its check)
            continue
        try:
            built = check_problem(problem)
        except ValueError as exc:  # PluginError, or a built-in's own size checks
            raise MatrixError(f"problem {name!r}: {exc}") from None
        numels[name] = [p.numel() for p in built.model.parameters()]
    return _skip_what_would_not_swap(m, numels)


def _skip_what_would_not_swap(m: Matrix, numels: Mapping[str, list[int]]) -> Matrix:
    """An nvme cell whose partitions are all below DeepSpeed's swap threshold is `skipped` with the
    reason, before training (its label would promise files DeepSpeed never writes)."""
    nvme = [c for c in m.runnable() if c.offload == "nvme"]
    if not nvme:
        return m
    from gaeq.trainers.deepspeed_config import nvme_swaps_nothing

    why = {c.id: reason for c in nvme if (reason := nvme_swaps_nothing(c, numels[c.variant]))}
    cells = tuple(dataclasses.replace(c, skip_reason=why[c.id]) if c.id in why else c for c in m.cells)
    return dataclasses.replace(m, cells=cells)


def check_world_sizes(m: Matrix, *, gpus: bool) -> None:
    """One machine runs at most 4 ranks per CPU core (gloo ranks each want a core) — and, with
    `gpus`, one per GPU (this imports torch). MatrixError beyond."""
    biggest = max((c.world_size for c in m.runnable()), default=1)
    limit, what = 4 * (os.cpu_count() or 1), "4 per CPU core"
    if gpus:
        import torch

        if torch.cuda.is_available():
            limit, what = torch.cuda.device_count(), "one per GPU"
    if biggest > limit:
        raise MatrixError(
            f"world size {biggest} needs {biggest} ranks on this machine, which runs at most {limit} "
            f"({what}): launch bigger world sizes with `gaeq worker` on a cluster"
        )


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """A judged run: the matrix, where it lives, the verdicts and the traces behind them."""

    matrix: Matrix
    run_dir: Path
    report: Report
    traces: TraceStore

    @property
    def ok(self) -> bool:
        """Every verdict is what its cell expected (skipped cells count as expected)."""
        return self.report.ok

    @property
    def exit_code(self) -> int:
        """0 as expected, 1 a verdict differs, 3 a cell failed to run."""
        return self.report.exit_code

    def cell(self, cell_id: str) -> CellReport:
        for c in self.report.cells:
            if c.id == cell_id:
                return c
        raise KeyError(f"no cell {cell_id!r} in this run (cells: {', '.join(c.id for c in self.report.cells)})")

    def verdicts(self) -> dict[str, str]:
        """{cell id: verdict} of the matrix's cells and baselines — not of gaeq's instruments (noise-floor
        twins, the detection limit's cell: `instruments()`), which measure the run rather than claim."""
        return {c.id: c.verdict for c in self.report.cells if c.cell.role not in INSTRUMENTS}

    def instruments(self) -> dict[str, str]:
        """{cell id: role} of the cells that measured this run: its noise floor and its detection limit."""
        return {c.id: c.role for c in self.report.cells if c.cell.role in INSTRUMENTS}

    def baseline(self, cell_id: str | None = None) -> str:
        """The baseline of `cell_id`'s group (of the first group without it)."""
        if cell_id is None:
            return next(iter(self.report.baselines.values()))
        return self.report.baseline_of(self.cell(cell_id))

    def trace(self, cell_id: str) -> list[StepRecord]:
        """Every optimizer step the cell recorded. Raises OSError if it has no trace (error/skipped)."""
        return self.traces.get(cell_id)

    def curve(self, cell_id: str, metric: str = "loss") -> tuple[list[int], list[float]]:
        """(steps, values) of one metric of the trace: loss, grad_norm, lr, seconds, comm_bytes, ..."""
        trace = self.trace(cell_id)
        return [r.step for r in trace], [getattr(r, metric) for r in trace]

    def rows(self) -> list[dict[str, Any]]:
        """One plain dict per cell (the fields of report.json), e.g. for a pandas DataFrame."""
        return self.report.to_json()["cells"]

    def plot(self, cells: Sequence[str] | None = None):
        """The overlay figure (per problem: the loss, |Δloss| and the grad norm's difference, each beside its
        tolerance), as a matplotlib Figure; `cells` restricts it to some cells (their baselines stay as reference)."""
        return overlay_figure(self.report, self.traces, cells=cells)


def run(
    matrix: str | Path | Mapping[str, Any] | Matrix,
    *,
    out: str | Path | None = None,
    isolate: bool = False,
    launcher: str = "local",
    lanes: int | None = None,
    resume: bool = False,
    on_event=None,
) -> RunResult:
    """Train every runnable cell, judge, write the artefacts (report.json/.md, TensorBoard, overlay.png).

    `matrix`: a YAML file, a mapping of the same shape, or an already loaded :class:`Matrix`.

    `out` defaults to ``runs/<name>-<time>``; an existing run there raises FileExistsError.
    `launcher`: ``local`` (gaeq starts the ranks), ``torchrun`` or ``deepspeed`` (that launcher starts
    them on ``gaeq worker``, one launch per world size — the code path a cluster uses).
    `lanes`: at most this many process groups of one world size side by side, each on cores of its
    own (default: as many as the cores hold — two world-1 groups on 2 cores; 1: one after another).
    `resume`: `out` holds an interrupted run of the same matrix; cells that finished there (a complete
    trace and a `done` outcome) are kept, the others are trained again.
    `on_event` receives :class:`gaeq.runtime.events.Event` progress (from this process's threads, one event at a time).
    Ctrl-C stops every rank and raises KeyboardInterrupt.
    """
    from gaeq.runtime import lifeline, shm
    from gaeq.runtime.cells import RunOptions, check_launch
    from gaeq.runtime.events import Event, EventKind, ignore
    from gaeq.runtime.launch import run_all
    from gaeq.runtime.ops import ensure_built, needed
    from gaeq.runtime.server import warm_up
    from gaeq.script.launchers import launch_mismatch

    check_launch(launcher=launcher, isolate=isolate, lanes=lanes)
    # Everything that can be checked without a process comes first: a bad matrix file never starts
    # one. (Plugins are imported and problems built after the fork server has been started, so that
    # its imports overlap with theirs; a plugin that fails stops the server with the run.)
    m = load(matrix, check=False)
    if m.problem.script is not None and (why := launch_mismatch(m.problem.script.launcher, launcher, lanes=lanes)):
        raise MatrixError(why)
    kept = _finished_cells(m, out) if resume else _no_run_in(out)
    check_world_sizes(m, gpus=False)  # without torch: its import would delay the fork server below
    lifeline.mark_parent()  # every process started from here on dies with this one
    if launcher == "local":  # the ranks' fork server imports torch/DeepSpeed while the problems are checked
        warm_up(m.runnable(), m.problems, isolate=isolate)
    m = check_problems(m)
    check_world_sizes(m, gpus=True)
    on_event = on_event or ignore
    run_dir = _prepare_run_dir(m, out, kept=kept)
    freed = shm.free_orphans()  # what runs that were killed left in /dev/shm
    if freed.segments:
        said = {"freed_bytes": freed.bytes, "freed_segments": freed.segments, "freed_from": freed.whose()}
        on_event(Event(kind=EventKind.SHM_FREED, world_size=0, **said))
    opts = RunOptions(
        problems=m.problems,
        run_dir=run_dir,
        timeout_s=m.spec.timeout_s,
        plugin_dirs=m.plugin_dirs,
        isolate=isolate,
        launcher=launcher,
        lanes=lanes,
        on_event=on_event,
    )
    to_run = [c for c in m.runnable() if c.id not in kept]
    # DeepSpeed's ops built before any deadline starts (first use on this machine; a dead build's lock named)
    ensure_built(needed(to_run, m.problems), on_event)
    _import_report_libraries_meanwhile()
    outcomes = kept | run_all(to_run, opts, done=kept)
    if m.auto:  # its references chosen from what ran (gaeq.results.reference), then their instruments
        m = with_references(m, choose(m, outcomes))
        write_references(run_dir, m.references)
        more = [c for c in m.runnable() if c.id not in outcomes]
        on_event(Event(kind=EventKind.MORE, world_size=0, cells=len(more)))
        outcomes |= run_all(more, opts, done=outcomes)
    return judge_run(m, run_dir, outcomes)


REPORT_LIBRARIES = (
    "matplotlib.figure",
    "matplotlib.colormaps",
    "matplotlib.backends.backend_agg",
    "tensorboard.compat.proto.event_pb2",
    "tensorboard.summary.writer.record_writer",
    "torch.utils.tensorboard.summary",
)
"""What judging a run imports (seconds of it): the figure's matplotlib, TensorBoard's event writer."""


def _import_report_libraries_meanwhile() -> None:
    """Import the report's libraries in a background thread while the ranks train (for `gaeq run`
    and every API caller): the parent only waits on their queue then, and the report no longer
    starts with those imports. (Python's import lock makes a module that judging needs before
    the thread is done wait for it.)"""

    def load() -> None:
        for name in REPORT_LIBRARIES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - judging imports it again and reports a real failure
                return

    threading.Thread(target=load, name="gaeq-report-imports", daemon=True).start()


def new_run_dir(name: str, *, root: Path = Path("runs")) -> Path:
    """``runs/<name>-<time>``, created here and unique: two runs started in the same second (or on
    machines sharing the filesystem) never share a directory."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = root / (f"{name}-{stamp}" if n == 0 else f"{name}-{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free run directory for {name} under {root}")


def discard_unused(run_dir: Path) -> None:
    """A directory :func:`new_run_dir` made, removed where the run was refused before writing in it."""
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def _no_run_in(out: str | Path | None) -> dict[str, CellOutcome]:
    """A new run keeps no cell, and never writes over one that is there."""
    if out is not None and (Path(out) / "cells").exists():
        raise FileExistsError(f"{out} already holds a run; pass another out (or resume it)")
    return {}


def write_matrix(run_dir: Path, m: Matrix) -> None:
    """The run directory's copy of the matrix: what was validated — paths made absolute, files and configs
    read in — so that `gaeq report` and `--resume` read it from anywhere, on whichever node wrote it."""
    atomic_write(run_dir / MATRIX_FILE, yaml.safe_dump(m.source, sort_keys=False, allow_unicode=True))


def _prepare_run_dir(m: Matrix, out: str | Path | None, *, kept: Mapping[str, CellOutcome]) -> Path:
    """The run directory, holding the matrix and the library versions — and of the cells it will
    train, nothing an interrupted attempt left (a partial trace, logs)."""
    run_dir = Path(out) if out is not None else new_run_dir(m.spec.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_matrix(run_dir, m)
    record_versions(run_dir)
    for cell in m.runnable():
        if cell.id not in kept:
            shutil.rmtree(cell_dir(run_dir, cell.id), ignore_errors=True)
    return run_dir


def _finished_cells(m: Matrix, out: str | Path | None) -> dict[str, CellOutcome]:
    """The cells an interrupted run of the same matrix completed in `out`."""
    if out is None:
        raise ValueError("resume needs the run directory to resume (out)")
    run_dir = Path(out)
    if not (run_dir / MATRIX_FILE).is_file():
        raise MatrixError(f"{run_dir} holds no run to resume (no {MATRIX_FILE})")
    if yaml.safe_load((run_dir / MATRIX_FILE).read_text()) != m.source:
        raise MatrixError(f"{run_dir} holds a run of another matrix: resume it with its own {run_dir / MATRIX_FILE}")
    traces = TraceStore(run_dir)
    kept = {}
    for cell in m.runnable():
        outcome = read_outcome(cell_dir(run_dir, cell.id))
        if outcome is not None and outcome.status == "done" and traces.usable(cell.id) is not None:
            kept[cell.id] = outcome
    return kept


def open_run(run_dir: str | Path, **tolerances: float | None) -> RunResult:
    """Judge a finished run directory again from its saved traces (optionally with other
    tolerances: loss_atol, loss_rtol, grad_norm_rtol, tensor_atol, tensor_rtol) and rewrite its
    artefacts. Raises MatrixError if `run_dir` is not a gaeq run."""
    run_dir = Path(run_dir)
    unknown = set(tolerances) - set(TOLERANCE_OVERRIDES)
    if unknown:
        raise TypeError(f"unknown tolerance {', '.join(sorted(unknown))}; known: {', '.join(TOLERANCE_OVERRIDES)}")
    if not (run_dir / MATRIX_FILE).is_file():
        raise MatrixError(f"{run_dir} is not a gaeq run directory (no {MATRIX_FILE})")
    m = load(run_dir / MATRIX_FILE, check=False)
    if m.auto:  # the references its run chose
        m = with_references(m, read_references(run_dir))
    outcomes = {c.id: o for c in m.cells if (o := read_outcome(cell_dir(run_dir, c.id))) is not None}
    return judge_run(m, run_dir, outcomes, overrides=tolerances)


def judge_run(
    m: Matrix,
    run_dir: Path,
    outcomes: Mapping[str, CellOutcome],
    *,
    overrides: Mapping[str, float | None] | None = None,
) -> RunResult:
    """Judge every cell against its baseline and (re)write report.json/.md, TensorBoard and the figure."""
    traces = TraceStore(run_dir)
    report = judge(m, outcomes, traces, resolve_tolerances(m, overrides), versions=run_versions(run_dir))
    write_tensorboard(run_dir, report, traces)
    plot_overlay(run_dir / OVERLAY_FILE, report, traces)
    write_report(run_dir, report, figure=OVERLAY_FILE)
    return RunResult(matrix=m, run_dir=run_dir, report=report, traces=traces)


__all__ = ["MatrixError", "RunResult", "TB_DIR", "judge_run", "load", "open_run", "run"]
