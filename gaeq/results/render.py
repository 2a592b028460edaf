"""A report for people: the verdict and cost tables (rich, for the CLI), report.md, and writing
report.json / report.md.

Columns are declared once, as data (:data:`COLUMNS`): a name, how to read it from a
:class:`CellReport`, which table shows it. Adding a report column is one line here (and the
CellReport field it reads).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from rich.table import Table
from rich.text import Text

from gaeq.files import atomic_write
from gaeq.matrix import Cell, Matrix, Role
from gaeq.results.cell_report import INSTRUMENTS
from gaeq.results.compare import Verdict
from gaeq.results.lines import caught, floor_lines, reference_lines, versions_line, weights_lines
from gaeq.results.report import CellReport, Report


@dataclass(frozen=True)
class Column:
    name: str
    get: Callable[[CellReport], str]
    table: str = "verdict"
    """verdict | cost | both (the identifying columns) | tensors (verdict table, when tensors are tracked)
    | tp (identifying, when some cell is tensor-parallel)."""
    right: bool = False


def _sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


MARGIN = "{:.2f}"


def _differs(x: float | None, c: CellReport, spec: str = "{:.1e}") -> str:
    """A difference from the baseline; where one of them skipped an update the other made (an fp16 overflow), its
    grad norm has nothing to compare with: `skipped`, not `nan` (the reason says which step)."""
    if x is not None and math.isnan(x) and "skipped" in (c.divergence_steps or {}):
        return "skipped"
    return _fmt(x, spec)


def _fmt(value: float | None, spec: str, *, zero: str | None = None) -> str:
    if value is None:
        return "-"
    if value == 0 and zero is not None:
        return zero
    return spec.format(value)


_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


def _ran(c: CellReport) -> str:
    """The dtype the forward pass really computed in (read back, gaeq.trainers.provenance); `*`:
    emulated fp16 kernels."""
    computed = (c.ran or {}).get("compute_dtype")
    if computed is None:
        return "-"
    return _SHORT.get(computed, computed) + ("*" if "fp16_kernels" in c.ran else "")


def pipeline_said(c: Cell | CellReport) -> str:
    """Stages and schedule: ``2 gpipe`` (``1``: no pipeline)."""
    return f"{c.pipeline_parallel} {c.pipeline_schedule}" if c.pipeline_parallel > 1 else "1"


def _expect(c: CellReport) -> str:
    """What a cell expects; an instrument measures, and expects nothing (its found words are its verdict)."""
    return "-" if c.cell.role in INSTRUMENTS else str(c.expectation)


def _verdict(c: CellReport) -> str:
    """The verdict; an instrument's in its own words: the detection limit's cell saw its planted δ or did not."""
    if c.cell.role is not Role.SENSITIVITY or c.verdict not in (Verdict.MATCH, Verdict.DIVERGE):
        return c.verdict
    planted = f"δ = {c.weight_error:g}"
    return f"{planted} seen" if c.verdict == Verdict.DIVERGE else f"{planted} not seen: below this run's limit"


def _zero(c: CellReport) -> str:
    return "-" if c.zero_stage is None else str(c.zero_stage) + (f"+{c.offload}" if c.offload != "none" else "")


COLUMNS = (
    Column("cell", lambda c: c.id, "both"),
    Column("W", lambda c: str(c.world_size), "both", right=True),
    Column("TP", lambda c: str(c.tensor_parallel), "tp", right=True),
    Column("PP", lambda c: pipeline_said(c), "pp", right=True),
    Column("SP", lambda c: str(c.sequence_parallel), "sp", right=True),
    Column("MB", lambda c: str(c.micro_batch_size), "both", right=True),
    Column("GA", lambda c: "-" if c.grad_accum_steps is None else str(c.grad_accum_steps), "both", right=True),
    Column("ZeRO", _zero, "both", right=True),
    Column("dtype", lambda c: c.dtype),
    Column("ran", _ran),
    Column("expect", _expect),
    Column("verdict", _verdict),
    Column("max |Δloss|", lambda c: _sci(c.max_abs_loss_diff)),
    Column(
        "max rel Δ‖g‖", lambda c: "-" if "grad_norm" in (c.not_checked or {}) else _differs(c.max_rel_grad_norm_diff, c)
    ),
    Column(
        "margin",
        lambda c: (
            "-" if c.role == "baseline" else _differs(c.margin, c, "{:.2f}" if (c.margin or 0) < 100 else "{:.0e}")
        ),
        right=True,
    ),
    Column("max |Δgrad|", lambda c: _sci(c.max_abs_grad_diff), "tensors"),
    Column("max |Δparam|", lambda c: _sci(c.max_abs_param_diff), "tensors"),
    Column("caught", caught),
    Column("samples/s", lambda c: _fmt(c.samples_per_s, "{:.0f}"), "cost", right=True),
    Column("step ms", lambda c: _fmt(c.step_seconds and c.step_seconds * 1e3, "{:.2f}"), "cost", right=True),
    Column("peak MB", lambda c: _fmt(c.peak_mem_bytes and c.peak_mem_bytes / 2**20, "{:.0f}"), "cost", right=True),
    Column(
        "state KB", lambda c: _fmt(c.model_state_bytes and c.model_state_bytes / 1024, "{:.1f}"), "cost", right=True
    ),
    Column(
        "comm KB/step",
        lambda c: _fmt(c.comm_bytes_per_step and c.comm_bytes_per_step / 1024, "{:.1f}", zero="0"),
        "cost",
        right=True,
    ),
    Column(
        "p2p KB/step",
        lambda c: _fmt(c.p2p_bytes_per_step and c.p2p_bytes_per_step / 1024, "{:.1f}", zero="0"),
        "pp_cost",
        right=True,
    ),
    Column(
        "a2a KB/step",
        lambda c: _fmt(c.a2a_bytes_per_step and c.a2a_bytes_per_step / 1024, "{:.1f}", zero="0"),
        "sp_cost",
        right=True,
    ),
    Column("bubble", lambda c: _fmt(c.bubble, "{:.2f}"), "pp_cost", right=True),
    Column("theory", lambda c: _fmt(c.bubble_theory, "{:.2f}"), "pp_cost", right=True),
    Column("s", lambda c: _fmt(c.seconds, "{:.1f}"), right=True),
)
_STYLE = {
    Verdict.MATCH: "green",
    Verdict.DIVERGE: "yellow",
    Verdict.ERROR: "bold red",
    Verdict.SKIPPED: "dim",
    Verdict.UNJUDGED: "magenta",
}


def columns(report: Report, *, tables: tuple[str, ...] = ("both", "verdict", "tensors", "cost")) -> list[Column]:
    """The columns of `tables`, in order; tensor columns only when the matrix tracks tensors, the
    tensor-parallel column (shown with the split, in both tables) only when some cell has it."""
    shown = {
        "tensors": any(c.max_abs_grad_diff is not None or c.max_abs_param_diff is not None for c in report.cells),
        "tp": any(c.tensor_parallel > 1 for c in report.cells),
        "pp": any(c.pipeline_parallel > 1 for c in report.cells),
        "sp": any(c.sequence_parallel > 1 for c in report.cells),
    }
    shown["pp_cost"], shown["sp_cost"] = shown["pp"], shown["sp"]
    # shown with that table, when some cell has them
    within = {"tp": "both", "pp": "both", "sp": "both", "pp_cost": "cost", "sp_cost": "cost"}
    return [
        col
        for col in COLUMNS
        if (col.table in tables or within.get(col.table) in tables) and shown.get(col.table, True)
    ]


def _table(title: str, cols: list[Column]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in cols:
        table.add_column(col.name, justify="right" if col.right else "left", no_wrap=col.name == "cell")
    return table


INSTRUMENTS_CAPTION = (
    "Set apart, gaeq's instruments — runs of each reference's split, not splits of yours: -floorN twins measure "
    "rounding alone (the noise floor); -weight… plants an error of known size (the detection limit)."
)


def sections(report: Report) -> tuple[list[CellReport], list[CellReport]]:
    """The cells a table shows: the references and the splits judged, then gaeq's instruments apart."""
    instruments = [c for c in report.cells if c.cell.role in INSTRUMENTS]
    return [c for c in report.cells if c.cell.role not in INSTRUMENTS], instruments


def _rows(table: Table, report: Report, row: Callable[[CellReport], list]) -> Table:
    """Every cell's row, the instruments in a section of their own, said in the caption."""
    judged, instruments = sections(report)
    for c in judged:
        table.add_row(*row(c))
    if instruments:
        table.add_section()
        for c in instruments:
            table.add_row(*row(c))
        table.caption, table.caption_justify = INSTRUMENTS_CAPTION, "left"
    return table


def verdict_table(report: Report) -> Table:
    """Equivalence: one row per cell (its cost is in :func:`cost_table`)."""
    cols = columns(report, tables=("both", "verdict", "tensors"))
    table = _table("gaeq verdicts", cols)
    table.add_column("ok")

    def row(c: CellReport) -> list:
        said = [Text(col.get(c), style=_STYLE[c.verdict]) if col.name == "verdict" else col.get(c) for col in cols]
        return [*said, Text("✓", style="green") if c.as_expected else Text("✗", style="bold red")]

    return _rows(table, report, row)


def cost_table(report: Report) -> Table:
    """What each cell cost: throughput, step time, peak memory, bytes through collectives."""
    cols = columns(report, tables=("both", "cost"))
    table = _table("cost per cell", cols)
    costed = replace(report, cells=[c for c in report.cells if c.samples_per_s is not None])
    return _rows(table, costed, lambda c: [col.get(c) for col in cols])


def render_markdown(report: Report, *, figure: str | None = None) -> str:
    s = report.summary
    cols = columns(report)
    lines = [
        "# gaeq report",
        "",
        f"**{'OK' if report.ok else 'NOT JUDGED' if report.unjudged else 'NOT OK'}** — "
        + ", ".join(f"{n} {v}" for v, n in s.items())
        + f"; baseline{'s' if len(report.baselines) > 1 else ''}: "
        + ", ".join(f"`{b}` ({d})" for d, b in report.baselines.items()),
        "",
        versions_line(report),
        "",
        *(line for reference in reference_lines(report) for line in (reference, "")),
        *(line for weights in weights_lines(report) for line in (weights, "")),
        *([f"![loss of every cell, and |Δloss| vs baseline]({figure})", ""] if figure else []),
        "Tolerances: "
        + "; ".join(
            f"{d}: loss {t.loss_atol:g} abs + {t.loss_rtol:g} rel, grad norm {t.grad_norm_rtol:g} rel"
            for d, t in report.tolerances.items()
        ),
        "",
        *(line for floor in floor_lines(report) for line in (floor, "")),
    ]
    header = [
        "| " + " | ".join(col.name.replace("|", "\\|") for col in cols) + " | ok |",
        "|" + "---|" * (len(cols) + 1),
    ]
    judged, instruments = sections(report)
    for part in (judged, instruments):
        lines += header if part is judged else ["", INSTRUMENTS_CAPTION, "", *header]
        lines += ["| " + " | ".join(col.get(c) for col in cols) + f" | {'✓' if c.as_expected else '✗'} |" for c in part]
    notes = [c for c in report.cells if c.reason and c.reason != "baseline"]
    if notes:
        lines += ["", "## Reasons", ""]
        for c in notes:
            first, *rest = c.reason.splitlines()
            lines.append(f"- `{c.id}` ({c.verdict}): {first}")
            if rest:
                lines += ["", "  ```", *("  " + r for r in rest), "  ```"]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: Report, *, figure: str | None = None) -> None:
    """report.json and report.md (linking `figure`, a file in run_dir), each written atomically."""
    atomic_write(run_dir / "report.json", json.dumps(report.to_json(), indent=2) + "\n")
    atomic_write(run_dir / "report.md", render_markdown(report, figure=figure))


INSTRUMENT_NOTES = {
    Role.FLOOR: "measures the noise floor (the baseline, nudged)",
    Role.SENSITIVITY: "measures the detection limit (the baseline, its rows reweighed 1 ± δ, zero-sum)",
}


def cells_table(m: Matrix) -> Table:
    """`gaeq validate`: the expanded cells, without training — each with its GA and what it is for."""
    table = Table(title=f"{m.spec.name}: {len(m.cells)} cells", title_justify="left")
    tp = any(c.tensor_parallel > 1 for c in m.cells)
    pp = any(c.pipeline_parallel > 1 for c in m.cells)
    for name in (
        "cell",
        "trainer",
        "world",
        *(("TP",) if tp else ()),
        *(("PP",) if pp else ()),
        "micro",
        "GA",
        "ZeRO",
        "dtype",
        "expect",
        "note",
    ):
        table.add_column(
            name,
            justify="right" if name in {"world", "TP", "PP", "micro", "GA", "ZeRO"} else "left",
            no_wrap=name == "cell",
        )
    baselines = set(m.baselines.values())
    for c in m.cells:
        if c.skip_reason:
            note = f"skipped: {c.skip_reason}"
        elif c.bug:
            note = f"planted bug: {c.bug}"
        else:
            note = "baseline" if c.id in baselines else INSTRUMENT_NOTES.get(c.role, "")
        table.add_row(
            c.id,
            c.trainer,
            str(c.world_size),
            *((str(c.tensor_parallel),) if tp else ()),
            *((pipeline_said(c),) if pp else ()),
            str(c.micro_batch_size),
            str(c.grad_accum_steps) if c.divisible else "-",
            "-" if c.zero_stage is None else str(c.zero_stage),
            c.dtype,
            str(c.expectation),
            note,
        )
    return table


def problem_line(m: Matrix) -> str:
    """`gaeq validate`: the problem's batch, steps and optimisation in one line."""
    p = m.problem
    if p.script is not None:
        return f"train_batch_size {p.train_batch_size}, {p.steps} steps compared, seed {p.seed}: {p.script.path}"
    if p.mirror is None:
        optimisation = (
            f"{p.optimizer.name} lr {p.optimizer.lr:g}, schedule {p.schedule.name}, "
            f"gradient_clipping {p.gradient_clipping:g}"
        )
    else:
        optimisation = (
            f"optimisation from deepspeed_config: {p.mirror.optimizer.type}, scheduler {p.mirror.schedule or 'none'}"
        )
    return f"train_batch_size {p.train_batch_size}, {p.steps} steps, {optimisation}, seed {p.seed}"
