"""The Python API the notebooks and the CLI share: load, judge/open a run, read it back."""

from __future__ import annotations

import pytest
import yaml

import gaeq
from gaeq import api
from tests.helpers import run_in_process, small_spec

SPEC = small_spec(
    axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4, 16]},
    cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"}],
)
BUG = "torch-w1-mb4-ga4-bug_no_loss_division"


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("api")
    m = gaeq.load(SPEC)
    (run_dir / api.MATRIX_FILE).write_text(yaml.safe_dump(m.source))
    return api.judge_run(m, run_dir, run_in_process(m, run_dir))


def test_load_takes_a_dict_or_a_file_and_says_what_is_wrong(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    assert [c.id for c in gaeq.load(SPEC).cells] == [c.id for c in gaeq.load(path).cells]
    with pytest.raises(gaeq.MatrixError, match="micro_batch_size"):
        gaeq.load({**SPEC, "axes": {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [0]}})
    with pytest.raises(gaeq.MatrixError, match="mapping"):
        api.matrix_from_dict([1, 2])


def test_a_judged_run_reads_back(result):
    assert result.verdicts() == {"torch-w1-mb16-ga1": "match", "torch-w1-mb4-ga4": "match", BUG: "diverge"}
    assert result.ok and result.exit_code == 0
    assert result.baseline(BUG) == "torch-w1-mb16-ga1"
    steps, norms = result.curve(BUG, "grad_norm")
    _, base = result.curve("torch-w1-mb16-ga1", "grad_norm")
    assert steps == list(range(12)) and norms[0] == pytest.approx(4 * base[0], rel=1e-6)
    assert {row["id"] for row in result.rows()} == set(result.verdicts()) | set(result.instruments())
    assert result.instruments() == {  # the baseline's split, nudged twice and weighed: gaeq's, not the matrix's
        "torch-w1-mb16-ga1-floor0": "floor",
        "torch-w1-mb16-ga1-floor1": "floor",
        "torch-w1-mb16-ga1-weight1e-02": "sensitivity",
    }
    assert result.cell(BUG).caught_by == "grad_norm"
    with pytest.raises(KeyError, match="no cell"):
        result.cell("nope")
    for name in ("report.json", "report.md", "overlay.png"):
        assert (result.run_dir / name).is_file()


def test_plot_can_show_a_subset_with_its_baseline(result):
    fig = result.plot(cells=[BUG])
    gids = {line.get_gid() for ax in fig.axes for line in ax.get_lines()}
    assert {"torch-w1-mb16-ga1", BUG} <= gids and "torch-w1-mb4-ga4" not in gids
    with pytest.raises(KeyError):
        result.plot(cells=["nope"])


def test_open_run_rejudges_with_other_tolerances(result):
    strict = gaeq.open_run(result.run_dir, loss_atol=0.0, loss_rtol=0.0, grad_norm_rtol=0.0)
    assert strict.verdicts()["torch-w1-mb4-ga4"] == "diverge" and strict.exit_code == 1
    again = gaeq.open_run(result.run_dir)
    assert again.verdicts() == result.verdicts()
    with pytest.raises(TypeError, match="unknown tolerance"):
        gaeq.open_run(result.run_dir, atol=1.0)
    with pytest.raises(gaeq.MatrixError, match="not a gaeq run"):
        gaeq.open_run(result.run_dir / "cells")


def test_run_refuses_a_directory_that_holds_a_run(result):
    with pytest.raises(FileExistsError, match="already holds a run"):
        gaeq.run(SPEC, out=result.run_dir)
