"""Report artefacts: TensorBoard event files, the overlay figure, and `gaeq report` re-judging."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from typer.testing import CliRunner

from gaeq.cli import app
from gaeq.matrix import load_matrix
from gaeq.results import tensorboard as tbmod
from gaeq.results.overlay import DIVERGENCE, plot_overlay
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore, read_trace
from tests.helpers import run_in_process, small_spec

CELLS = ["torch-w1-mb16-ga1", "torch-w1-mb2-ga8", "torch-w1-mb8-ga2", "torch-w1-mb4-ga4-bug_no_loss_division"]
INSTRUMENTS = ["torch-w1-mb16-ga1-floor0", "torch-w1-mb16-ga1-floor1", "torch-w1-mb16-ga1-weight1e-02"]
"""The group's noise-floor twins and detection-limit cell: runs in TensorBoard, not curves of the figure."""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A small finished run directory (trained in-process), as `gaeq run` leaves it before judging."""
    run_dir = tmp_path_factory.mktemp("run")
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1, 3], "micro_batch_size": [2, 8]},
        on_indivisible="skip",
        cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"}],
    )
    import yaml

    (run_dir / "matrix.yaml").write_text(yaml.safe_dump(spec))
    matrix = load_matrix(run_dir / "matrix.yaml")
    outcomes = run_in_process(matrix, run_dir)
    return matrix, run_dir, outcomes


@pytest.fixture
def judged(finished_run, tmp_path):
    matrix, source, outcomes = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    traces = TraceStore(run_dir)
    return matrix, run_dir, judge(matrix, outcomes, traces), traces


def accumulate(path) -> EventAccumulator:
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})  # 0 = keep everything
    acc.Reload()
    return acc


def test_every_cell_is_one_run_with_identical_tags_and_the_trace_values(judged):
    matrix, run_dir, report, traces = judged
    tb = tbmod.write_tensorboard(run_dir, report, traces)
    # One run directory per cell with a trace (the skipped cell has none), one event file each, and the group's
    # tolerance run: no extra run directory from hparams.
    assert sorted(p.name for p in tb.iterdir()) == sorted(CELLS + INSTRUMENTS + ["tolerance-fp32"])
    assert all(len(list((tb / c).iterdir())) == 1 for c in CELLS + INSTRUMENTS)

    expected_tags = {
        tbmod.LOSS,
        tbmod.GRAD_NORM,
        tbmod.LR,
        tbmod.ABS_LOSS_DIFF,
        tbmod.REL_GRAD_NORM_DIFF,
        tbmod.STEP_SECONDS,
        tbmod.COMM_BYTES,
        tbmod.PEAK_MEM,
        tbmod.MAX_ABS_LOSS_DIFF,
        tbmod.MAX_REL_GRAD_NORM_DIFF,
        tbmod.SAMPLES_PER_S,
    }
    baseline = read_trace(run_dir / "cells" / CELLS[0])
    for cell_id in CELLS:
        acc = accumulate(tb / cell_id)
        # the log10 twins of the differences; the baseline's are exact zeros, which have no logarithm (not drawn)
        logs = set() if cell_id == CELLS[0] else set(tbmod.LOG10.values())
        assert set(acc.Tags()["scalars"]) == expected_tags | logs
        for tag in tbmod.LOG10:
            linear = {e.step: e.value for e in acc.Scalars(tag) if e.value > 0}
            logged = {e.step: e.value for e in acc.Scalars(tbmod.LOG10[tag])} if tbmod.LOG10[tag] in logs else {}
            assert logged.keys() == linear.keys()  # every nonzero value, and only those
            for step, value in logged.items():
                assert value == pytest.approx(np.log10(linear[step]), abs=1e-5)
        trace = read_trace(run_dir / "cells" / cell_id)
        for tag, field in ((tbmod.LOSS, "loss"), (tbmod.GRAD_NORM, "grad_norm"), (tbmod.LR, "lr")):
            events = acc.Scalars(tag)
            assert [e.step for e in events] == list(range(12))
            np.testing.assert_array_equal(
                np.array([e.value for e in events], dtype=np.float32),
                np.array([getattr(r, field) for r in trace], dtype=np.float32),
            )
        diffs = [e.value for e in acc.Scalars(tbmod.ABS_LOSS_DIFF)]
        np.testing.assert_array_equal(
            np.array(diffs, dtype=np.float32),
            np.array([abs(r.loss - b.loss) for r, b in zip(trace, baseline)], dtype=np.float32),
        )
        # custom-scalars layout and hparams live in the cell's own run
        layout = layout_pb2.Layout()
        layout.ParseFromString(acc.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
        assert [c.title for c in layout.category] == ["equivalence", "cost"]
        charts = {ch.title: list(ch.multiline.tag) for ch in layout.category[0].chart}
        assert next(iter(charts)) == "log10 |Δloss| vs baseline — above its group's tolerance run: diverged"
        assert charts[next(iter(charts))] == [f"^{tbmod.LOG10[tbmod.ABS_LOSS_DIFF]}$"]  # the tolerance run's too
        assert charts["loss — every cell"] == [f"^{tbmod.LOSS}$"]
        assert charts["|Δloss| vs baseline, and its tolerance"] == [f"^{tbmod.ABS_LOSS_DIFF}$"]
        hparams = acc.PluginTagToContent("hparams")
        assert {"_hparams_/experiment", "_hparams_/session_start_info", "_hparams_/session_end_info"} <= set(hparams)
        cell = next(c for c in report.cells if c.id == cell_id)
        session = hparams["_hparams_/session_start_info"]
        assert cell.verdict.encode() in session and b"grad_accum_steps" in session
        assert cell.cell.role.value.encode() in session and b"role" in session

    # the group's tolerance, once: each step's as applied (the constant, or the noise floor's envelope above it),
    # under the tags of the differences it bounds, beside them on every card
    tolerance = accumulate(tb / "tolerance-fp32")
    assert set(tolerance.Tags()["scalars"]) == {tbmod.ABS_LOSS_DIFF, tbmod.REL_GRAD_NORM_DIFF, *tbmod.LOG10.values()}
    tol = report.tolerances["fp32"]
    allowed = [e.value for e in tolerance.Scalars(tbmod.ABS_LOSS_DIFF)]
    assert len(allowed) == 12 and all(a >= np.float32(tol.loss_tol(b.loss)) for a, b in zip(allowed, baseline))
    assert all(e.value >= np.float32(tol.grad_norm_rtol) for e in tolerance.Scalars(tbmod.REL_GRAD_NORM_DIFF))

    control = accumulate(tb / CELLS[3]).Scalars(tbmod.REL_GRAD_NORM_DIFF)
    assert control[0].value == pytest.approx(3.0)  # GA 4: the gradient is 4× the mean

    # Rewriting replaces, never appends.
    tbmod.write_tensorboard(run_dir, report, traces)
    assert len(accumulate(tb / CELLS[1]).Scalars(tbmod.LOSS)) == 12


def test_overlay_figure_draws_each_problem_its_matching_cells_grey_and_marks_the_catch_on_its_metric(judged):
    """One column per problem: the loss, |Δloss| and the grad norm's difference, each beside its tolerance as
    applied; matching cells thin grey, the planted mistake in colour and named, its ✗ on the metric and step that
    caught it; no legend of every cell."""
    from gaeq.results.overlay import MATCHING, TITLES

    matrix, run_dir, report, traces = judged
    path = run_dir / "overlay.png"
    fig = plot_overlay(path, report, traces)
    panel = {ax.get_ylabel(): ax for ax in fig.axes if ax.get_visible()}
    assert set(panel) == set(TITLES.values())  # one problem here: one column of three panels
    loss, diff, norm = (panel[TITLES[m]] for m in ("loss", "abs_loss", "rel_grad_norm"))
    assert sorted(line.get_gid() for line in loss.lines) == sorted(CELLS)
    for ax in (diff, norm):
        assert ax.get_yscale() == "log"
        assert sorted(g for line in ax.lines if (g := line.get_gid()) in CELLS) == sorted(CELLS[1:])
    bug = next(c for c in report.cells if c.id == CELLS[3])
    on = {"loss": diff, "grad_norm": norm}[bug.caught_by]
    assert [line.get_gid() for line in on.lines if line.get_gid().endswith(DIVERGENCE)] == [CELLS[3] + DIVERGENCE]
    (marker,) = [line for line in on.lines if line.get_gid().endswith(DIVERGENCE)]
    assert list(marker.get_xdata()) == [bug.first_divergent_step]
    colours = {line.get_gid(): line.get_color() for line in diff.lines}
    assert colours[CELLS[1]] == colours[CELLS[2]] == MATCHING and colours[CELLS[3]] != MATCHING
    assert [t.get_text() for t in diff.get_legend().get_texts()][0].startswith("tolerance, as applied: ")
    assert CELLS[3] + " (diverge)" in [t.get_text() for t in loss.get_legend().get_texts()]
    assert not any(CELLS[1] in t.get_text() for ax in (loss, diff, norm) for t in ax.get_legend().get_texts())
    # the loss tolerance as it was applied at each step (the constant widened by the floor)
    from gaeq.results.compare import tolerances_at

    base = traces.get(CELLS[0])
    applied = [tolerances_at(report.tolerances["fp32"], b, report.floors.get("fp32"))[0].value for b in base]
    (line,) = [line for line in diff.lines if line.get_gid() == "fp32:tolerance"]
    assert list(line.get_ydata()) == applied
    from matplotlib.image import imread

    pixels = imread(path)
    assert path.stat().st_size > 30_000 and pixels.shape[0] > 500 and pixels.shape[1] > 400
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50  # not a blank canvas


def test_report_command_rejudges_with_other_tolerances(finished_run, tmp_path):
    _, source, _ = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    runner = CliRunner()

    result = runner.invoke(app, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    first = json.loads((run_dir / "report.json").read_text())
    assert first["ok"] and first["summary"] == {"match": 2, "diverge": 1, "error": 0, "skipped": 2, "unjudged": 0}
    assert "![" in (run_dir / "report.md").read_text() and (run_dir / "overlay.png").exists()

    # Tolerances tighter than float summation noise: the accumulated cells now "diverge".
    result = runner.invoke(app, ["report", str(run_dir), "--atol", "0", "--rtol", "0", "--grad-rtol", "0"])
    assert result.exit_code == 1, result.output
    tight = json.loads((run_dir / "report.json").read_text())
    assert tight["tolerances"]["fp32"].items() >= {"loss_atol": 0.0, "loss_rtol": 0.0, "grad_norm_rtol": 0.0}.items()
    verdicts = {c["id"]: c["verdict"] for c in tight["cells"]}
    assert verdicts["torch-w1-mb2-ga8"] == "diverge" and verdicts["torch-w1-mb16-ga1"] == "match"
    hparams = accumulate(run_dir / "tb" / "torch-w1-mb2-ga8").PluginTagToContent("hparams")
    assert b"diverge" in hparams["_hparams_/session_start_info"]

    # A cell that never finished is an error on re-judging: exit 3.
    (run_dir / "cells" / "torch-w1-mb8-ga2" / "outcome.json").unlink()
    assert runner.invoke(app, ["report", str(run_dir)]).exit_code == 3


def test_report_command_on_a_non_run_directory_is_bad_input(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a gaeq run directory" in result.output


def test_the_tables_set_gaeqs_instruments_apart_from_the_splits_and_say_what_they_are(judged):
    """The twins and the detection limit's cell are runs of the reference's split, not the user's splits: every
    table shows them after the splits, in a section of their own, with one line on what each measures; report.md
    in a table of its own under that line. Their reasons are not printed as a split's."""
    import io

    from rich.console import Console

    from gaeq.closing import print_result
    from gaeq.results.render import INSTRUMENTS_CAPTION, render_markdown, sections, verdict_table

    matrix, run_dir, report, traces = judged
    judged_cells, instruments = sections(report)
    assert [c.id for c in instruments] == INSTRUMENTS
    assert set(CELLS) <= {c.id for c in judged_cells} and not set(INSTRUMENTS) & {c.id for c in judged_cells}
    table = verdict_table(report)
    assert table.caption == INSTRUMENTS_CAPTION and table.rows[len(judged_cells) - 1].end_section
    md = render_markdown(report)
    assert md.index(INSTRUMENTS_CAPTION) > max(md.index(f"| {c} |") for c in CELLS)
    assert md.index(INSTRUMENTS_CAPTION) < min(md.index(f"| {c} |") for c in INSTRUMENTS)

    from gaeq.api import RunResult

    out = io.StringIO()
    print_result(Console(file=out, width=300), RunResult(matrix=matrix, run_dir=run_dir, report=report, traces=traces))
    said = out.getvalue()
    assert "torch-w1-mb16-ga1-weight1e-02 (diverge)" not in said  # the limit's line says what it measured
    assert "torch-w1-mb4-ga4-bug_no_loss_division (diverge)" in said  # a split's reason is still said
    # an instrument's row says what it found in its own words, never an expectation beside a verdict
    limit = next(c for c in instruments if c.id == INSTRUMENTS[-1])
    row = next(line for line in said.splitlines() if INSTRUMENTS[-1] in line and "│ fp32" in line)  # (verdicts)
    found = "δ = 0.01 seen" if limit.verdict == "diverge" else "δ = 0.01 not seen: below this run's limit"
    assert found in row and "diverge" not in row and "match" not in row, row
    from dataclasses import replace

    hidden = replace(report, cells=[replace(c, verdict="match") if c.id == limit.id else c for c in report.cells])
    assert "δ = 0.01 not seen: below this run's limit" in render_markdown(hidden)


def test_a_grad_norm_with_nothing_to_compare_reads_skipped_not_nan():
    from types import SimpleNamespace

    from gaeq.results.render import _differs

    skipped = SimpleNamespace(divergence_steps={"skipped": 2, "loss": 3})  # one side skipped step 2's update
    assert _differs(float("nan"), skipped) == "skipped"
    assert _differs(1.5e-3, skipped) == "1.5e-03"
    # control: a nan no skipped step explains (a loss that blew up) is shown as what it is
    assert _differs(float("nan"), SimpleNamespace(divergence_steps={"loss": 3})) == "nan"
