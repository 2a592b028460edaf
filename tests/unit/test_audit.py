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
    (  # WarmupLR's log warmup from warmup_min_lr 0: its first two steps train at lr 0
        ADAMW | {"scheduler": {"type": "WarmupLR"}, "zero_optimization": {"stage": 3, "overlap_comm": True}},
        {"scheduler": "risk", "zero_optimization.stage": "fine", "zero_optimization.overlap_comm": "fine"},
    ),
    (
        ADAMW | {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_num_steps": 4}}},
        {"scheduler": "fine"},
    ),
    (ADAMW | {"scheduler": {"type": "Nope"}}, {"scheduler.type": "risk", "scheduler": "breaks"}),
    (ADAMW | {"scheduler": {"type": "OneCycle", "params": {"bogus": 1}}}, {"scheduler": "breaks"}),
    (ADAMW | {"bf16": {"enabled": True}}, {"bf16.enabled": "fine", "communication_data_type": "risk"}),
    (ADAMW | {"bf16": {"enabled": True}, "communication_data_type": "fp32"}, {"communication_data_type": "fine"}),
]


@pytest.mark.parametrize(("config", "expected"), TABLE)
def test_audit_lines_for_a_table_of_configs(config, expected):
    found = {f.key: f.effect for f in audit(config)}
    assert {k: found.get(k) for k in expected} == expected, [f.line for f in audit(config)]
    assert "data_types.grad_accum_dtype" not in found or "bf16" in json.dumps(
        config
    )  # no finding about what is not there
    assert "communication_data_type" not in found or "bf16" in json.dumps(config) or "fp16" in json.dumps(config)


def test_every_breaks_or_risk_is_shown_by_an_experiment_cell_that_exists_and_expects_it():
    refused = ("cannot mirror", "DeepSpeed refuses it")  # gaeq's or DeepSpeed's own refusal, said: no run to show
    findings = [f for config, _ in TABLE for f in audit(config) if f.effect != "fine"]
    findings = [f for f in findings if not any(r in f.why for r in refused)]
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


TEAM = json.loads((REPO_ROOT / "experiments" / "ds_config_team.json").read_text())


def test_a_teams_config_is_said_to_train_at_the_lr_deepspeed_gives_it_not_the_optimizers():
    """ZeRO-2, bf16, AdamW at 3e-4, WarmupDecayLR with no warmup_max_lr (#75): DeepSpeed's own scheduler object
    trains it at up to 1e-3 on a log warmup whose first two steps run at lr 0 — a risk, said with the default that
    sets it; its gradients reduced in bf16; nothing said of a torch side it has none of, nor a split it changes."""
    found = {f.key: f for f in audit(TEAM)}
    schedule = found["scheduler"]
    assert (schedule.value, schedule.effect) == ("WarmupDecayLR", "risk")
    assert schedule.why.startswith(
        "your lr 0.0003 is not used: WarmupDecayLR's warmup_max_lr defaults to 0.001 — it trains at up to 0.001 (step "
        "11); steps 0, 1 train at lr 0: no update — DeepSpeed's own WarmupDecayLR"
    ), schedule.why
    assert "warmup_type 'log'" in schedule.why
    assert found["optimizer.params"].value == (
        "AdamW: lr 0.0003, betas [0.9, 0.95], eps 1e-08 (DeepSpeed's default), weight_decay 0.1"
    )
    assert found["communication_data_type"].effect == "risk" and found["bf16.enabled"].effect == "fine"
    assert found["train_batch_size"].why.startswith("what every split holds fixed")
    assert found["gradient_accumulation_steps"].why.startswith("what a split changes")
    assert not any("mirrored on the torch side" in f.why for f in found.values())


@pytest.mark.parametrize(
    ("name", "params", "defaults"),
    [
        ("WarmupLR", {}, {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log"}),
        ("WarmupDecayLR", {"total_num_steps": 40},
         {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"}),
        ("WarmupCosineLR", {"total_num_steps": 40},
         {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "warmup_type": "log"}),
        ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3},
         {"decay_lr_rate": 0.0, "cycle_first_step_size": 2000, "cycle_momentum": True, "cycle_min_mom": 0.8,
          "cycle_max_mom": 0.9}),
    ],
)  # fmt: skip
def test_the_defaults_the_audit_says_are_deepspeeds_own_and_its_curve_is_its_schedulers(name, params, defaults):
    """Each scheduler's defaults as the audit says them, against DeepSpeed's scheduler objects: a DeepSpeed upgrade
    that changes one fails here (and the audit's words must follow). The three gaeq mirrors on the torch side
    (gaeq.problem.mirror.DeepSpeedSchedule) give the lr DeepSpeed's own object does, step by step."""
    import torch

    from gaeq.problem.mirror import DeepSpeedSchedule
    from gaeq.problem.schedule import lr_curve

    config = ADAMW | {"scheduler": {"type": name, "params": params}}
    curve = lr_curve(config, steps=60)
    assert {k: curve.defaults[k] for k in defaults} == defaults
    from deepspeed.runtime import lr_schedules

    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=1e-3)
    own = getattr(lr_schedules, name)(optimizer, **params)
    lrs = []
    for _ in range(60):
        lrs.append(optimizer.param_groups[0]["lr"])
        own.step()
    assert list(curve.lrs) == lrs
    if name != "OneCycle":
        mirrored = DeepSpeedSchedule(torch.optim.AdamW([weight], lr=1e-3), name, params)
        assert [mirrored.lr_at(s - 1) for s in range(60)] == pytest.approx(lrs, rel=1e-12, abs=0)
    else:  # OneCycle moves Adam's beta1 too: the audit says it
        finding = next(f for f in audit(config) if f.key == "scheduler")
        assert finding.effect == "risk" and "it moves the momentum (Adam's beta1) from 0.8" in finding.why
