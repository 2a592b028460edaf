"""What the terminal shows once a run is judged (the CLI's, like the rest of the terminal): the cost and
verdict tables, each unexpected reason, the references, instruments and versions, and the closing line."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from gaeq.api import RunResult
from gaeq.results.cell_report import INSTRUMENTS
from gaeq.results.compare import Verdict
from gaeq.results.lines import floor_lines, reference_lines, versions_line, weights_lines
from gaeq.results.render import cost_table, verdict_table
from gaeq.results.tensorboard import OUTLIERS, TB_ANSWER_URL, TB_DIR


def print_result(console: Console, result: RunResult) -> int:
    """The cost and verdict tables, each unexpected reason, the summary line; the exit code."""
    report = result.report
    console.print(cost_table(report))
    console.print(verdict_table(report))
    failed = {c.id for c in report.cells if c.verdict == Verdict.ERROR}
    like_baseline = []
    for c in report.cells:
        if not c.reason or c.reason == "baseline" or c.cell.skip_reason is not None:
            continue  # (a cell the matrix skipped says why in `gaeq validate`; one skipped as judged, here)
        if c.cell.role in INSTRUMENTS and c.verdict == Verdict.ERROR and report.baseline_of(c) in failed:
            like_baseline.append(c.id)  # its baseline's split, which failed: said once, with the baseline
            continue
        if c.cell.role in INSTRUMENTS and c.as_expected:
            continue  # what it measured is said by the floor and limit lines below, not as a split's reason
        console.print(f"[bold]{c.id}[/] ({c.verdict}): {escape(c.reason)}", highlight=False, soft_wrap=True)
    if like_baseline:
        console.print(f"{', '.join(like_baseline)} (error): as their baseline, whose split they run", highlight=False)
    for line in [*weights_lines(report), *reference_lines(report), *floor_lines(report), versions_line(report)]:
        console.print(escape(line), highlight=False, soft_wrap=True)  # ([fp32, bf16] is text, not markup)
    s = report.summary
    status = (
        "[bold green]OK[/]"
        if report.ok
        else "[bold magenta]NOT JUDGED[/]"
        if report.unjudged
        else "[bold red]NOT OK[/]"
    )
    baselines = "".join(f", baseline {b} {v}" for b, v in report.baselines_not_matching.items())
    console.print(
        f"{status}: {s['match']} match, {s['diverge']} diverge, {s['error']} error, {s['skipped']} skipped"
        f"{f', {u} unjudged' if (u := s['unjudged']) else ''} "
        f"{'split' if sum(s.values()) == 1 else 'splits'}{baselines}, relative to {report.relative_to} "
        f"— report: {result.run_dir / 'report.md'}",
        highlight=False,
        soft_wrap=True,
    )
    return report.exit_code


def print_overlay_command(console: Console, result: RunResult) -> None:
    """The command that overlays every cell in TensorBoard, and what it shows for this run."""
    shown = (
        f"each cell's difference from its reference as log10, beside its group's tolerance run; {OUTLIERS}"
        if result.report.baselines
        else "each cell's curves: with no reference, there is no difference to draw"
    )
    console.print(
        f"Overlay in TensorBoard:  [bold]tensorboard --logdir {result.run_dir / TB_DIR}[/], then open "
        f"{TB_ANSWER_URL} ({shown})",
        highlight=False,
        soft_wrap=True,
    )
