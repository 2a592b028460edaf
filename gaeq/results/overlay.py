"""The overlay figure: every cell's loss on one axis, |Δloss| vs baseline on a log axis below.

Headless: a bare matplotlib Figure (no pyplot, no display backend, no global state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from gaeq.files import replacing
from gaeq.results.cell_report import INSTRUMENTS
from gaeq.results.compare import step_diffs, tolerances_at
from gaeq.results.report import Report
from gaeq.results.trace import TraceStore

OVERLAY_FILE = "overlay.png"
FIGSIZE = (13.0, 8.5)
"""Inches."""
LEGEND_CHAR, LEGEND_PAD = 0.042, 0.5
"""Inches a legend column takes per character of a cell id at its 7-point font, and for its line and gaps."""
DIVERGENCE = ":first-divergence"
"""Suffix of the gid of a first-divergence marker (curves carry the bare cell id)."""


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
    fig = Figure(figsize=(FIGSIZE[0], FIGSIZE[1]))
    columns = 1 + len(drawn) // 28  # the legend of cell ids, right of the axes
    # Fixed margins, the legend's sized from its longest id: a layout engine measures every tick label
    # first (~1 s of a run's report, most of a short run's).
    legend = columns * (LEGEND_PAD + LEGEND_CHAR * max((len(c.id) for c, _ in drawn), default=0)) / FIGSIZE[0]
    fig.subplots_adjust(left=0.07, right=max(0.5, 0.98 - legend), top=0.95, bottom=0.07, hspace=0.06)
    ax_loss, ax_diff = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    palette = _colors(len(drawn))
    for (cell, trace), color in zip(drawn, palette):
        steps = [r.step for r in trace]
        baseline = cell.id == report.baseline_of(cell)
        # The baseline is drawn wide and underneath: matching cells run along it in colour.
        style = {"color": "black", "lw": 3.5, "zorder": 1} if baseline else {"color": color, "lw": 1.0, "zorder": 2}
        ls = "--" if cell.expect == "diverge" else "-"
        ax_loss.plot(steps, [r.loss for r in trace], ls=ls, label=cell.id, gid=cell.id, **style)
        base = traces.usable(report.baseline_of(cell))
        if not baseline and base is not None and {r.step for r in trace} <= {r.step for r in base}:
            diffs = [d.abs_loss if d.abs_loss > 0 else math.nan for d in step_diffs(base, trace)]
            ax_diff.plot(steps, diffs, ls=ls, gid=cell.id, **style)
        if cell.first_divergent_step is not None:
            s = cell.first_divergent_step
            ax_loss.plot(
                [s],
                [trace[s - trace[0].step].loss],
                marker="X",
                ms=9,
                color=color,
                mec="black",
                ls="",
                gid=cell.id + DIVERGENCE,
            )
            ax_diff.axvline(s, color=color, lw=0.8, ls=":", gid=cell.id + DIVERGENCE)
    for group, base_id in report.baselines.items():  # each group's tolerance as applied, step by step
        base = traces.usable(base_id)
        dtype = next((c.dtype for c in report.cells if c.id == base_id), None)
        if base is None or dtype not in report.tolerances:
            continue
        allowed = [tolerances_at(report.tolerances[dtype], b, report.floors.get(group))[0].value for b in base]
        said = f"{allowed[0]:.1g}" if min(allowed) == max(allowed) else f"{min(allowed):.1g} to {max(allowed):.1g}"
        ax_diff.step([b.step for b in base], allowed, where="mid", color="grey", lw=1, ls="-.",
                     label=f"{group} loss tolerance, as applied: {said}")  # fmt: skip
    ax_loss.set_ylabel("loss (global-batch mean)")
    ax_loss.set_title(
        f"{len(drawn)} cells overlaid — wide black: baseline, dashed: expected to diverge, X: first divergence",
        fontsize=10,
    )
    ax_diff.set_yscale("log")
    ax_diff.set_ylabel(
        "|Δloss| vs baseline (exact zeros not drawn)" if report.baselines else "no reference: no difference to draw"
    )
    ax_diff.set_xlabel("optimizer step")
    if ax_diff.get_legend_handles_labels()[0]:
        ax_diff.legend(loc="upper left", fontsize=8)
    if ax_loss.get_legend_handles_labels()[0]:  # a run whose cells all failed draws no curve
        ax_loss.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, ncol=columns, frameon=False)
    for ax in (ax_loss, ax_diff):
        ax.grid(True, alpha=0.3)
    return fig


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["turbo"]
    return [cmap(0.05 + 0.9 * i / max(1, n - 1)) for i in range(n)]
