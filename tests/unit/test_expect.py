"""A cell's `expect`: the verdict alone (`diverge`), or what must catch it — `{verdict: diverge, caught_by,
step, holds}` — read at load (bad input one line naming the key), carried in the cell
(gaeq.matrix.cell.Expectation), and judged: a divergence caught by another metric, at another step, or
one that a held metric joins is not as expected, and the reason says why (gaeq.results.cell_report)."""

from __future__ import annotations

import pytest

from gaeq.matrix import Cell, MatrixError, matrix_from_dict
from gaeq.matrix.cell import Expectation
from gaeq.results.cell_report import CellReport
from gaeq.results.compare import Comparison, Verdict
from gaeq.results.render import COLUMNS
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore
from tests.helpers import run_in_process, small_spec

NO_DIVISION = {"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"}
CONTROL = "torch-w1-mb4-ga4-bug_no_loss_division"


def cells_of(expect, *, cell: dict | None = None, **more) -> dict[str, Cell]:
    spec = small_spec(cells=[(cell or NO_DIVISION) | {"expect": expect}], **more)
    return {c.id: c for c in matrix_from_dict(spec).cells}


def test_expect_is_a_verdict_or_a_mapping_and_the_cell_id_is_the_same():
    plain = cells_of("diverge")[CONTROL]
    caught = cells_of({"verdict": "diverge", "caught_by": "grad_norm", "step": 0, "holds": ["loss"]})[CONTROL]
    assert plain.expectation == Expectation(verdict="diverge") and plain.expect == "diverge"
    assert caught.expectation == Expectation(verdict="diverge", caught_by="grad_norm", step=0, holds=("loss",))
    assert (caught.expect, caught.id, str(caught.expectation)) == (
        "diverge",
        plain.id,
        "diverge:grad_norm@0 holds:loss",
    )
    assert caught.expectation.detail == {"caught_by": "grad_norm", "step": 0, "holds": ["loss"]}
    assert plain.expectation.detail is None and str(plain.expectation) == "diverge"
    defaults = {c.id: c.expectation for c in matrix_from_dict(small_spec(cells=[NO_DIVISION])).cells}
    assert (defaults[CONTROL], defaults["torch-w1-mb4-ga4"]) == (Expectation(verdict="diverge"), Expectation())


@pytest.mark.parametrize(
    ("expect", "message"),
    [
        ("maybe", r"^cells\.0\.expect\.verdict: Input should be 'match' or 'diverge', got 'maybe'$"),
        (3, r"^cells\.0\.expect: Value error, expect is match, diverge or a mapping"),
        ({"caught_by": "loss"}, r"^missing key 'cells\.0\.expect\.verdict'$"),
        ({"verdict": "diverge", "by": "loss"}, r"^unknown key 'cells\.0\.expect\.by'"),
        ({"verdict": "match", "caught_by": "loss"}, r"^cells\.0\.expect: .*caught_by .* only with verdict diverge"),
        ({"verdict": "match", "step": 0}, r"^cells\.0\.expect: .*step .* only with verdict diverge"),
        ({"verdict": "match", "holds": ["loss"]}, r"^cells\.0\.expect: .*holds .* only with verdict diverge"),
        ({"verdict": "diverge", "caught_by": "norm"}, r"^cells\.0\.expect\.caught_by: Input should be 'split'"),
        ({"verdict": "diverge", "step": -1}, r"^cells\.0\.expect\.step: Input should be greater than or equal to 0"),
        (
            {"verdict": "diverge", "caught_by": "grad_norm", "holds": ["grad_norm"]},
            r"^cells\.0\.expect: .*caught_by 'grad_norm' cannot also be in holds",
        ),
        ({"verdict": "diverge", "holds": ["loss", "loss"]}, r"holds names a metric twice"),
        (
            {"verdict": "diverge", "caught_by": "grad_norm", "holds": ["params"]},
            r"^expect names 'params', which the matrix does not compare \(track: loss, grad_norm\)$",
        ),
        ({"verdict": "diverge", "caught_by": "data"}, r"^expect names 'data', which only a script's probe records"),
        ({"verdict": "diverge", "step": 12}, r"^expect\.step 12 is past the last step \(11\)$"),
    ],
)
def test_a_bad_expectation_is_one_line_naming_the_key(expect, message):
    with pytest.raises(MatrixError, match=message) as caught:
        cells_of(expect)
    assert "\n" not in str(caught.value)


def test_a_tracked_metric_may_be_named_and_a_resumed_cell_expects_from_its_resume_step():
    tracked = cells_of(
        {"verdict": "diverge", "caught_by": "grad_norm", "holds": ["params"]}, track=["loss", "grad_norm", "params"]
    )
    assert tracked[CONTROL].expectation.holds == ("params",)
    resume = {"from": {"trainer": "torch", "micro_batch_size": 4}, "at_step": 4}
    early = {"micro_batch_size": 2, "drop": ["optimizer"], "expect": {"verdict": "diverge", "step": 3}}
    spec = small_spec(axes=None, cells=[{"trainer": "torch", "micro_batch_size": 4}], resume=[resume | {"to": [early]}])
    spec["resume"][0]["universal"] = False
    with pytest.raises(MatrixError, match=r"^expect\.step 3 comes before the resume \(at_step 4\)"):
        matrix_from_dict(spec)
    spec["resume"][0]["to"][0]["expect"]["step"] = 4
    resumed = [c for c in matrix_from_dict(spec).cells if c.resume]
    assert [(c.expectation, c.first_step) for c in resumed] == [(Expectation(verdict="diverge", step=4), 4)]


GRAD_NORM_THEN_LOSS = Comparison(
    verdict=Verdict.DIVERGE,
    max_abs_loss_diff=2e-3,
    max_rel_grad_norm_diff=3.0,
    max_abs_grad_diff=None,
    max_abs_param_diff=None,
    first_divergent_step=0,
    caught_by="grad_norm",
    divergence_steps={"skipped": None, "loss": 3, "grad_norm": 0, "lr": None},
    reason="grad norm diverged at step 0",
)
"""What no_loss_division under AdamW looks like: the grad norm GA × at step 0, the loss at step 3."""


def judged(comparison: Comparison = GRAD_NORM_THEN_LOSS, **expect) -> CellReport:
    cell = Cell(
        trainer="torch", world_size=1, micro_batch_size=4, train_batch_size=16, expectation=Expectation(**expect)
    )
    return CellReport(cell=cell, verdict=comparison.verdict, reason=comparison.reason, comparison=comparison)


@pytest.mark.parametrize(
    ("expect", "unmet"),
    [
        ({"verdict": "diverge"}, None),
        ({"verdict": "diverge", "caught_by": "grad_norm"}, None),
        ({"verdict": "diverge", "caught_by": "grad_norm", "step": 0}, None),
        ({"verdict": "diverge", "step": 0, "holds": ["lr"]}, None),
        (
            {"verdict": "diverge", "caught_by": "loss"},
            "expected to be caught by loss: it was caught by grad_norm at step 0 (loss diverged at step 3)",
        ),
        (
            {"verdict": "diverge", "caught_by": "lr", "step": 0},
            "expected to be caught by lr at step 0: it was caught by grad_norm at step 0 (lr never diverged)",
        ),
        (
            {"verdict": "diverge", "caught_by": "grad_norm", "step": 1},
            "expected to be caught by grad_norm at step 1: grad_norm first diverged at step 0",
        ),
        ({"verdict": "diverge", "step": 2}, "expected to first diverge at step 2: it first diverged at step 0"),
        (
            {"verdict": "diverge", "caught_by": "grad_norm", "step": 0, "holds": ["loss"]},
            "expected to be caught by grad_norm at step 0, and loss to hold: loss diverged at step 3",
        ),
        (
            {"verdict": "diverge", "caught_by": "params", "holds": ["grads"]},
            "expected to be caught by params, and grads to hold: params was not compared; grads was not compared",
        ),
    ],
)
def test_a_divergence_is_as_expected_only_when_caught_as_expected(expect, unmet):
    report = judged(**expect)
    assert (report.unmet, report.as_expected) == (unmet, unmet is None)
    assert (report.to_json()["expect"], report.to_json()["expect_detail"]) == ("diverge", Expectation(**expect).detail)


def test_the_expect_column_is_short_and_a_match_or_an_error_is_judged_by_its_verdict_alone():
    column = next(col for col in COLUMNS if col.name == "expect")
    report = judged(verdict="diverge", caught_by="grad_norm", step=0, holds=["loss"])
    assert (column.get(report), column.get(judged(verdict="diverge"))) == ("diverge:grad_norm@0 holds:loss", "diverge")
    matched = Comparison(
        **vars(GRAD_NORM_THEN_LOSS) | {"verdict": Verdict.MATCH, "caught_by": None, "first_divergent_step": None}
    )
    assert not judged(matched, verdict="diverge", caught_by="grad_norm").as_expected  # it did not diverge at all
    assert judged(matched, verdict="match").as_expected and judged(matched, verdict="match").unmet is None


def test_a_planted_control_is_as_expected_when_its_norm_catches_it_and_not_when_its_loss_must_hold(tmp_path):
    """no_loss_division under AdamW (small_spec: GA 4, clipping at 1.0): the grad norm is GA × at step 0,
    the loss follows later. One training run, judged under two expectations of the same cell, as `gaeq
    report` re-judges a run — the second a control that must fail."""
    caught = {"verdict": "diverge", "caught_by": "grad_norm", "step": 0}
    first = matrix_from_dict(small_spec(cells=[NO_DIVISION | {"expect": caught}]))
    outcomes = run_in_process(first, tmp_path)
    traces = TraceStore(tmp_path)
    report = {c.id: c for c in judge(first, outcomes, traces).cells}[CONTROL]
    base, cell = traces.get("torch-w1-mb16-ga1"), traces.get(CONTROL)
    assert cell[0].grad_norm == pytest.approx(4 * base[0].grad_norm, rel=1e-5)  # GA × the norm, at step 0
    # AdamW is blind to a constant scale, clipping makes it vary: the loss leaves at step 2 (2.2e-4, 100 × its tol)
    assert report.divergence_steps == {"skipped": None, "loss": 2, "grad_norm": 0, "lr": None}, report.reason
    assert (report.caught_by, report.first_divergent_step) == ("grad_norm", 0)
    assert report.max_rel_grad_norm_diff == pytest.approx(3.0, rel=1e-2) and report.max_abs_loss_diff > 1e-3
    assert report.as_expected and "expected" not in report.reason

    held = matrix_from_dict(small_spec(cells=[NO_DIVISION | {"expect": caught | {"holds": ["loss"]}}]))
    assert [c.id for c in held.cells] == [c.id for c in first.cells]
    control = judge(held, outcomes, traces)
    failed = {c.id: c for c in control.cells}[CONTROL]
    assert (failed.verdict, failed.as_expected, control.ok, control.exit_code) == ("diverge", False, False, 1)
    said = "expected to be caught by grad_norm at step 0, and loss to hold: loss diverged at step 2"
    assert failed.unmet == said and failed.reason.endswith(f" — {said}")
