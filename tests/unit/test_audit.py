"""`gaeq audit`: one line per finding for a table of configs, exit codes 0/1/2, and every `breaks`
or `risk` claim backed by a cell of an experiment that exists and expects what the claim says."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from gaeq.audit import audit
from gaeq.cli import app
from gaeq.matrix import load_matrix
from tests.helpers import REPO_ROOT

ADAMW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
TABLE = [
    (
        ADAMW,
        {"gradient_clipping": "risk", "optimizer.params.weight_decay": "fine", "optimizer.params.torch_adam": "fine"},
    ),
    (ADAMW | {"gradient_clipping": 0.0}, {"gradient_clipping": "fine"}),
    (
        {**ADAMW, "train_batch_size": 64, "gradient_accumulation_steps": 4},
        {"train_batch_size": "fine", "gradient_accumulation_steps": "fine"},
    ),
    # GA 1 in the config: a loop accumulating by hand around it loses all but the last micro-batch (ZeRO-1/2)
    ({**ADAMW, "gradient_accumulation_steps": 1}, {"gradient_accumulation_steps": "risk"}),
    ({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1, "torch_adam": True}}}, {"optimizer.type": "fine"}),
    (ADAMW | {"fp16": {"enabled": True, "loss_scale": 0}}, {"fp16.loss_scale": "risk"}),
    (ADAMW | {"data_types": {"grad_accum_dtype": "bf16"}}, {"data_types.grad_accum_dtype": "risk"}),
    (ADAMW | {"bf16": {"enabled": True}}, {"data_types.grad_accum_dtype": "risk"}),
    (ADAMW | {"communication_data_type": "fp16"}, {"communication_data_type": "breaks"}),
    (
        ADAMW | {"prescale_gradients": True, "gradient_predivide_factor": 2.0},
        {"prescale_gradients": "risk", "gradient_predivide_factor": "risk"},
    ),
    (ADAMW | {"zero_allow_untested_optimizer": True}, {"zero_allow_untested_optimizer": "fine"}),
    ({"optimizer": {"type": "Lamb"}}, {"optimizer.type": "risk"}),
    (
        ADAMW | {"scheduler": {"type": "WarmupLR"}, "zero_optimization": {"stage": 3, "overlap_comm": True}},
        {"scheduler.type": "fine", "zero_optimization.stage": "fine", "zero_optimization.overlap_comm": "fine"},
    ),
]


@pytest.mark.parametrize(("config", "expected"), TABLE)
def test_audit_lines_for_a_table_of_configs(config, expected):
    found = {f.key: f.effect for f in audit(config)}
    assert {k: found.get(k) for k in expected} == expected, [f.line for f in audit(config)]
    assert "data_types.grad_accum_dtype" not in found or "bf16" in json.dumps(
        config
    )  # no finding about what is not there


def test_every_breaks_or_risk_is_shown_by_an_experiment_cell_that_exists_and_expects_it():
    findings = [f for config, _ in TABLE for f in audit(config) if f.effect != "fine" and "cannot mirror" not in f.why]
    assert {f.effect for f in findings} == {"breaks", "risk"}
    assert all(f.evidence for f in findings), "a breaks/risk finding without its evidence"
    matrices = {}
    for finding in findings:
        evidence = finding.evidence
        file, _, cell_id = evidence.partition(": ")
        matrices.setdefault(file, load_matrix(REPO_ROOT / file))
        cells = {c.id: c for c in matrices[file].cells}
        assert cell_id in cells, f"{finding.key}: {evidence} names no cell"
        if finding.effect == "breaks":  # a control that must diverge
            assert cells[cell_id].expect == "diverge", evidence


def test_gaeq_audit_exit_codes(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["audit", str(REPO_ROOT / "experiments" / "ds_config.json")])
    assert result.exit_code == 0, result.output
    assert "gradient_clipping = absent → DeepSpeed clips at 1.0: risk" in result.output
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(ADAMW | {"communication_data_type": "bf16"}))
    result = runner.invoke(app, ["audit", str(broken)])
    assert result.exit_code == 1 and "communication_data_type = 'bf16': breaks" in result.output
    (tmp_path / "junk.json").write_text("{not json")
    result = runner.invoke(app, ["audit", str(tmp_path / "junk.json")])
    assert result.exit_code == 2 and "not valid JSON" in result.output and "Traceback" not in result.output
