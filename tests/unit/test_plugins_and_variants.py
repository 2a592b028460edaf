"""Plugins (model/data/loss by import path) and problem variants within one matrix."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gaeq.cli import app
from gaeq.matrix import MatrixError, load_matrix
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore
from tests.helpers import run_in_process, small_spec

runner = CliRunner()


def plugin_spec(model_import: str, **args) -> dict:
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [2, 4]},
        cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"}],
    )
    spec["problem"]["model"] = {"import": model_import, "args": args}
    spec["problem"]["loss"] = "mse"
    return spec


def test_a_model_from_a_test_module_trains_and_is_judged(write_matrix, tmp_path):
    matrix = load_matrix(write_matrix(plugin_spec("tests.plugin_models:two_layer", width=16)))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    verdicts = {c.id: (c.verdict, c.max_abs_loss_diff) for c in report.cells}
    assert verdicts["torch-w1-mb2-ga8"][0] == "match" and 0 < verdicts["torch-w1-mb2-ga8"][1] < 1e-6
    assert verdicts["torch-w1-mb4-ga4-bug_no_loss_division"][0] == "diverge"
    assert report.ok


@pytest.mark.parametrize(
    ("model_import", "message"),
    [
        (
            "tests.no_such_module:build",
            "model plugin 'tests.no_such_module:build': cannot import tests.no_such_module (ModuleNotFoundError",
        ),
        (
            "tests.plugin_models:missing",
            "model plugin 'tests.plugin_models:missing': tests.plugin_models has no function 'missing'",
        ),
        (
            "tests.plugin_models:not_a_module",
            "model plugin 'tests.plugin_models:not_a_module' returned str, not a torch.nn.Module",
        ),
    ],
)
@pytest.mark.parametrize("command", ["validate", "run"])
def test_plugin_errors_are_bad_input_before_any_process(write_matrix, tmp_path, model_import, message, command):
    path = write_matrix(plugin_spec(model_import))
    out = tmp_path / "run"
    args = ["validate", str(path)] if command == "validate" else ["run", "--matrix", str(path), "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not out.exists()  # nothing started


def test_a_loss_plugin_that_returns_no_scalar_is_rejected(write_matrix, tmp_path):
    spec = plugin_spec("tests.plugin_models:two_layer")
    spec["problem"]["loss"] = {"import": "torch.nn.functional:mse_loss"}  # fine: returns a scalar mean
    assert runner.invoke(app, ["validate", str(write_matrix(spec))]).exit_code == 0
    spec["problem"]["loss"] = {"import": "torch:sub"}  # elementwise: not a scalar
    result = runner.invoke(app, ["validate", str(write_matrix(spec, "bad.yaml"))])
    assert result.exit_code == 2
    assert "must return a scalar tensor with a gradient" in result.output


def test_variants_get_their_own_problem_and_baseline(write_matrix):
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4], "variant": ["base", "sgd"]},
        variants={
            "sgd": {"problem": {"optimizer": {"name": "sgd", "lr": 0.05}}},
            "ds": {"problem": {"dtype": "ds_bf16"}, "baseline": {"trainer": "deepspeed", "zero_stage": 1}},
            "gpt": {"problem": {"model": {"kind": "gpt"}, "data": {"kind": "tokens"}, "loss": "cross_entropy"}},
        },
        cells=[
            {"variant": "ds", "trainer": "deepspeed", "micro_batch_size": 2, "zero_stage": 2},
            {"variant": "gpt", "trainer": "deepspeed", "micro_batch_size": 4},
        ],
    )
    m = load_matrix(write_matrix(spec))
    assert m.baselines == {
        "fp32": "torch-w1-mb16-ga1",
        "fp32@sgd": "torch-w1-mb16-ga1@sgd",
        "ds_bf16@ds": "deepspeed-z1-w1-mb16-ga1-ds_bf16@ds",
        "fp32@gpt": "torch-w1-mb16-ga1@gpt",
    }
    assert m.problems["sgd"].optimizer.name == "sgd" and m.problems["sgd"].optimizer.lr == 0.05
    assert m.problems["sgd"].gradient_clipping == m.problems["base"].gradient_clipping == 1.0
    assert m.problems["gpt"].model.kind == "gpt" and m.problems["gpt"].data.kind == "tokens"
    assert {c.id for c in m.cells} >= {
        "torch-w1-mb4-ga4@sgd",
        "deepspeed-z2-w1-mb2-ga8-ds_bf16@ds",
        "deepspeed-z0-w1-mb4-ga4@gpt",
    }


def test_a_variant_that_switches_plugin_starts_from_fresh_args(write_matrix):
    """Switching `import` (like switching `kind`) drops the base plugin's args: `norm` belongs to
    tests.plugin_models:normed, and two_layer would be called with an unexpected keyword."""
    spec = plugin_spec("tests.plugin_models:normed", norm="none", width=12)
    spec["variants"] = {
        "other": {"problem": {"model": {"import": "tests.plugin_models:two_layer", "args": {"width": 6}}}},
        "wider": {"problem": {"model": {"args": {"width": 20}}}},  # same plugin: its args merge
    }
    spec["cells"] = [{"variant": v, "trainer": "torch", "micro_batch_size": 4} for v in ("other", "wider")]
    m = load_matrix(write_matrix(spec))
    assert m.problems["other"].model.args == {"width": 6}
    assert m.problems["wider"].model.args == {"norm": "none", "width": 20}
    result = CliRunner().invoke(app, ["validate", str(write_matrix(spec))])  # builds and runs every problem
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("variants", "cells", "message"),
    [
        ({}, [{"variant": "nope", "trainer": "torch", "micro_batch_size": 4}], "unknown variant 'nope'"),
        ({"x": {"problem": {"optimizer": {"lr": -1}}}}, [], r"variants\.x\.problem: optimizer\.lr"),
        ({"x": {"problem": {"model": {"kind": "gpt"}}}}, [], "model gpt trains on data kind tokens"),
        ({}, [{"trainer": "torch", "micro_batch_size": 4, "dtype": "ds_bf16"}], "DeepSpeed cells at ZeRO ≥ 1 only"),
    ],
)
def test_variant_errors_name_the_problem(write_matrix, variants, cells, message):
    with pytest.raises(MatrixError, match=message):
        load_matrix(write_matrix(small_spec(variants=variants, cells=cells)))
