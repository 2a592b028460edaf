"""The overlay figure: one column of panels per problem (a group: its dtype and variant, its own baseline) — the
loss, |Δloss| from the baseline and the grad norm's relative difference, each difference beside its tolerance as
applied. Cells that match are thin grey lines: together, a band a reader sees at a glance. The cells that diverge,
or were expected to, are coloured and named; each ✗ sits on the metric and at the step that caught it.

Headless: a bare matplotlib Figure (no pyplot, no display backend, no global state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from gaeq.files import replacing
from gaeq.matrix import group_key
from gaeq.results.cell_report import INSTRUMENTS, CellReport
from gaeq.results.compare import Verdict, step_diffs, tolerances_at
from gaeq.results.report import Report
from gaeq.results.trace import TraceStore

OVERLAY_FILE = "overlay.png"
PANEL = (5.2, 2.3)
"""Inches of one panel (a metric of one problem)."""
COLUMNS = 3
"""Problems side by side; more wrap to the next row of panels."""
DIVERGENCE = ":caught"
"""Suffix of the gid of a ✗ (curves carry the bare cell id)."""
MATCHING = "0.55"
"""The grey of the cells that match."""
METRICS = ("loss", "abs_loss", "rel_grad_norm")
TITLES = {"loss": "loss (global-batch mean)", "abs_loss": "|Δloss| from the baseline",
          "rel_grad_norm": "grad norm: |Δ| ÷ the baseline's"}  # fmt: skip
CAUGHT_ON = {"loss": "abs_loss", "grad_norm": "rel_grad_norm"}
"""The panel a metric's catch is drawn on; any other metric's (the update, the weights, the data) on |Δloss|'s,
named beside its ✗."""


def plot_overlay(path: Path, report: Report, traces: TraceStore):
    """Draw and save the figure; returns the matplotlib Figure."""
    fig = overlay_figure(report, traces)
    with replacing(path) as partial:  # an interrupted write never leaves half a PNG
        fig.savefig(partial, dpi=100, format="png")
    return fig


def overlay_figure(report: Report, traces: TraceStore, *, cells: Sequence[str] | None = None):
    """The figure, not saved: every cell with a trace (or only `cells` and their baselines) — gaeq's
    instruments only when named (the noise-floor lines and report.md give what they measured)."""
    from matplotlib.figure import Figure

    wanted = None if cells is None else set(cells) | {report.baseline_of(c) for c in report.cells if c.id in set(cells)}
    if wanted is not None and (unknown := set(cells) - {c.id for c in report.cells}):
        raise KeyError(f"no cell {', '.join(sorted(unknown))} in this report")
    if wanted is None:
        wanted = {c.id for c in report.cells if c.cell.role not in INSTRUMENTS}
    drawn = [(c, t) for c in report.cells if c.id in wanted and (t := traces.usable(c.id)) is not None]
    groups: dict[str, list] = {}
    for cell, trace in drawn:
        groups.setdefault(group_key(dtype=cell.dtype, variant=cell.variant), []).append((cell, trace))
    columns = max(1, min(COLUMNS, len(groups)))
    rows = -(-max(1, len(groups)) // columns)
    fig = Figure(figsize=(PANEL[0] * columns, PANEL[1] * len(METRICS) * rows + 1.1))
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - 0.95 / fig.get_figheight(), bottom=0.05, hspace=0.35,
                        wspace=0.22)  # fmt: skip
    axes = fig.subplots(len(METRICS) * rows, columns, squeeze=False)
    for i, (group, members) in enumerate(groups.items()):
        column = [axes[(i // columns) * len(METRICS) + k][i % columns] for k in range(len(METRICS))]
        _problem(dict(zip(METRICS, column)), group, members, report, traces)
    for i in range(len(groups), rows * columns):  # the grid's empty places
        for k in range(len(METRICS)):
            axes[(i // columns) * len(METRICS) + k][i % columns].set_visible(False)
    shown = "each cell's difference from its baseline" if report.baselines else "no reference: no difference to draw"
    fig.suptitle(
        f"{len(drawn)} cells — grey: matching cells, black: the baseline, colour: a cell that diverges or is expected "
        f"to,\n✗: the metric and step that caught it; {shown}, beside its tolerance as applied",
        fontsize=9,
        y=1 - 0.12 / fig.get_figheight(),
        va="top",
    )
    return fig


def _problem(axes: dict, group: str, members: list, report: Report, traces: TraceStore) -> None:
    """One problem's panels: its cells' loss, |Δloss| and grad-norm difference, its tolerances."""
    base_id = report.baselines.get(group)
    base = traces.usable(base_id) if base_id else None
    marked = [c for c, _ in members if _stands_out(c) and c.id != base_id]
    colors = dict(zip((c.id for c in marked), _colors(len(marked))))
    for cell, trace in members:
        steps = [r.step for r in trace]
        if cell.id == base_id:
            style = {"color": "black", "lw": 2.5, "zorder": 3, "label": f"baseline {cell.id}"}
        elif cell.id in colors:
            style = {"color": colors[cell.id], "lw": 1.4, "zorder": 4, "label": f"{cell.id} ({cell.verdict})"}
        else:
            style = {"color": MATCHING, "lw": 0.7, "zorder": 2}
        axes["loss"].plot(steps, [r.loss for r in trace], gid=cell.id, **style)
        if cell.id == base_id or base is None or not {r.step for r in trace} <= {r.step for r in base}:
            continue
        diffs = step_diffs(base, trace)
        for metric in ("abs_loss", "rel_grad_norm"):  # exact zeros: not drawn on a log axis
            values = [v if (v := getattr(d, metric)) > 0 else math.nan for d in diffs]
            axes[metric].plot(steps, values, gid=cell.id, **(style | {"label": None}))
        _caught(axes, cell, diffs, colors.get(cell.id, MATCHING))
    if base is not None and (dtype := next((c.dtype for c, _ in members if c.id == base_id), None)):
        tolerance = report.tolerances.get(dtype)
        allowed = [tolerances_at(tolerance, b, report.floors.get(group)) for b in base] if tolerance else []
        for metric, k in (("abs_loss", 0), ("rel_grad_norm", 1)):
            values = [a[k].value for a in allowed]
            if values:
                said = f"tolerance, as applied: {_span(values)}"
                axes[metric].step([b.step for b in base], values, where="mid", color="tab:red", lw=1, ls="--",
                                  label=said, gid=f"{group}:tolerance")  # fmt: skip
    matching = sum(1 for c, _ in members if c.id != base_id and c.id not in colors)
    axes["loss"].set_title(f"{group}: {len(members)} cells, {matching} matching in grey", fontsize=9)
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullLocator

    for metric, ax in axes.items():
        ax.set_ylabel(TITLES[metric], fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(6, integer=True))
        if metric != "loss":  # a few decades, labelled plainly: most of the figure's drawing time is its ticks
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(numticks=5))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0e}"))
        else:
            ax.yaxis.set_major_locator(MaxNLocator(4))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=6.5, frameon=False)
    axes["rel_grad_norm"].set_xlabel("optimizer step", fontsize=8)


def _stands_out(cell: CellReport) -> bool:
    """A cell drawn in colour and named: it diverges, errs, or was expected to diverge."""
    return cell.verdict != Verdict.MATCH or cell.expect == "diverge" or not cell.as_expected


def _caught(axes: dict, cell: CellReport, diffs: list, color) -> None:
    """A ✗ on each metric that caught the cell, at its first divergent step; another metric's on |Δloss|'s panel,
    named."""
    for metric, step in (cell.divergence_steps or {}).items():
        if step is None:
            continue
        panel = CAUGHT_ON.get(metric, "abs_loss")
        at = next((d for d in diffs if d.step == step), None)
        value = getattr(at, panel) if at is not None else math.nan
        ax = axes[panel]
        if not value > 0:  # (a catch where the curve is zero or absent: at the panel's foot)
            value = min((v for line in ax.lines for v in line.get_ydata() if v > 0), default=1e-12)
        ax.plot([step], [value], marker="X", ms=9, color=color, mec="black", ls="", gid=cell.id + DIVERGENCE)
        if panel != CAUGHT_ON.get(metric):
            ax.annotate(f"{metric}@{step}", (step, value), textcoords="offset points", xytext=(6, 4), fontsize=6.5)


def _span(values: list[float]) -> str:
    low, high = f"{min(values):.2g}", f"{max(values):.2g}"
    return low if low == high else f"{low} to {high}"


def _colors(n: int) -> list:
    """Distinct colours: tab10's, then tab20's."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]
