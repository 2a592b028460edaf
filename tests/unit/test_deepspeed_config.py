"""A user's own DeepSpeed config: the torch side mirrors what DeepSpeed builds from it (schedules
equal DeepSpeed's own classes at every step; defaults read from DeepSpeed), gaeq overrides only the
split and says so, and what cannot be mirrored is bad input naming the key."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from deepspeed.runtime import lr_schedules
from typer.testing import CliRunner

from gaeq.cli import app
from gaeq.matrix import MatrixError, matrix_from_dict
from gaeq.problem.dsconfig import cell_config, mirror
from gaeq.problem.mirror import DeepSpeedSchedule, mirrored_optimizer
from gaeq.problem.optim import gradient_clipping
from gaeq.problem.spec import ProblemSpec
from tests.helpers import judged, small_spec

CONFIG = {
    "train_batch_size": 64,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 4, "total_num_steps": 30}},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
}


def with_config(config=CONFIG, **axes) -> dict:
    spec = small_spec(axes={"trainer": ["torch", "deepspeed"], **axes})
    for key in ("optimizer", "schedule", "gradient_clipping"):
        del spec["problem"][key]
    spec["problem"]["deepspeed_config"] = config
    return spec


SCHEDULES = [
    ("WarmupLR", {}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 30}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_type": "linear", "warmup_min_lr": 1e-5}),
    ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 12}),  # decay never starts, then floors at 0
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_num_steps": 5}),
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 25,
            "warmup_num_steps": 3,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
    ),
    (None, {}),
]


@pytest.mark.parametrize(("name", "params"), SCHEDULES)
def test_mirrored_schedules_equal_deepspeeds_lr_at_every_step(name, params):
    """The torch trainer's schedule is re-derived, not imported: it must equal DeepSpeed's own class
    (as its engine steps it: once after every optimizer step) to 1e-12 at every step, warmup included."""
    mine = DeepSpeedSchedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), name, params)
    theirs_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    theirs = getattr(lr_schedules, name)(theirs_opt, **params) if name else None
    for _ in range(40):
        want = theirs_opt.param_groups[0]["lr"]
        assert mine.get_last_lr()[0] == pytest.approx(want, abs=1e-12, rel=0)
        mine.step()
        if theirs:
            theirs.step()
    state = mine.state_dict()  # a resumed torch cell continues where the schedule was
    again = DeepSpeedSchedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3), name, params)
    again.load_state_dict(state)
    assert again.get_last_lr() == mine.get_last_lr()


def test_mirrored_adam_takes_deepspeeds_defaults_not_torchs():
    """DeepSpeed's FusedAdam defaults to weight_decay 0 (torch.optim.AdamW: 0.01), and DeepSpeed's
    "Adam" is AdamW unless adam_w_mode is false: read from DeepSpeed, mirrored."""
    params = [torch.zeros(2, requires_grad=True)]
    adamw = mirrored_optimizer(params, mirror({"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}).optimizer)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["weight_decay"] == 0.0 and adamw.defaults["lr"] == 1e-2
    adam = mirrored_optimizer(
        params, mirror({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.1}}}).optimizer
    )
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.1
    plain = mirrored_optimizer(
        params, mirror({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer
    )
    assert type(plain) is torch.optim.Adam
    torch_adam = mirrored_optimizer(
        params, mirror({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}).optimizer
    )
    assert torch_adam.defaults["weight_decay"] == 0.01  # DeepSpeed builds torch's own class: torch's default
    sgd = mirrored_optimizer(
        params, mirror({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}).optimizer
    )
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9


def test_absent_clipping_is_deepspeeds_default_read_from_deepspeed():
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    absent = ProblemSpec(train_batch_size=8, deepspeed_config={"optimizer": {"type": "AdamW"}})
    given = ProblemSpec(train_batch_size=8, deepspeed_config={"optimizer": {"type": "AdamW"}, "gradient_clipping": 0.0})
    assert gradient_clipping(absent) == GRADIENT_CLIPPING_DEFAULT == 1.0
    assert gradient_clipping(given) == 0.0


def test_each_cell_runs_the_file_with_only_its_split_written_in_and_the_overrides_are_named():
    config, changed = cell_config(
        CONFIG,
        train_batch_size=16,
        micro_batch_size=2,
        grad_accum_steps=4,
        zero_stage=3,
        offload="none",
        load_universal=False,
    )
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (16, 2, 4)
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert {
        k: v
        for k, v in config.items()
        if k
        not in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
            "zero_optimization",
        )
    } == {
        k: v for k, v in CONFIG.items() if k not in ("train_batch_size", "zero_optimization")
    }  # nothing else touched: no clipping, no precision, no bucket sizes written
    assert [(o.key, o.file_value, o.cell_value) for o in changed] == [
        ("train_batch_size", 64, 16),
        ("zero_optimization.stage", 2, 3),
    ]
    assert CONFIG["train_batch_size"] == 64  # the user's mapping itself is left alone


def test_without_a_zero_stage_axis_the_files_stage_is_the_cells_and_a_path_is_read_relative_to_the_matrix(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    (tmp_path / "m.yaml").write_text(json.dumps(with_config("ds.json")))
    from gaeq.matrix import load_matrix

    m = load_matrix(tmp_path / "m.yaml")
    assert sorted(c.id for c in judged(m.cells)) == ["deepspeed-z2-w1-mb4-ga4", "torch-w1-mb16-ga1", "torch-w1-mb4-ga4"]
    assert m.source["problem"]["deepspeed_config"] == CONFIG  # the run directory's copy holds what ran
    stages = matrix_from_dict(with_config(zero_stage=[1, 3]))
    assert sorted(c.zero_stage for c in stages.cells if c.trainer == "deepspeed") == [1, 3]


BAD = [
    ({"optimizer": {"type": "Lamb"}}, "deepspeed_config.optimizer.type: 'Lamb'"),
    (
        {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
        "deepspeed_config.optimizer.params.max_grad_norm",
    ),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "deepspeed_config.optimizer.params.lr: 'auto'"),
    (
        {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "OneCycle", "params": {}}},
        "deepspeed_config.scheduler.type: 'OneCycle'",
    ),
    (
        {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR", "params": {}}},
        "total_num_steps: DeepSpeed's WarmupDecayLR requires it",
    ),
    ({"scheduler": {"type": "WarmupLR"}}, "deepspeed_config.optimizer: absent"),
    (
        {"optimizer": {"type": "AdamW"}, "zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
        "offload_optimizer.device: 'nvme'",
    ),
]


@pytest.mark.parametrize(("config", "named"), BAD)
def test_a_key_the_torch_side_cannot_mirror_is_bad_input_naming_it(tmp_path, config, named):
    path = tmp_path / "m.yaml"
    path.write_text(json.dumps(with_config(config)))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and named in result.output and "Traceback" not in result.output, result.output


def test_the_optimisation_comes_from_the_file_alone_and_the_dtype_from_its_precision_section():
    spec = with_config()
    spec["problem"]["gradient_clipping"] = 1.0
    with pytest.raises(MatrixError, match="problem.gradient_clipping and deepspeed_config.gradient_clipping both"):
        matrix_from_dict(spec)
    bf16 = copy.deepcopy(CONFIG) | {"bf16": {"enabled": True}}
    with pytest.raises(MatrixError, match="deepspeed_config enables bf16.*set dtype: ds_bf16"):
        matrix_from_dict(with_config(bf16))
    with pytest.raises(
        MatrixError, match="ds_bf16 is DeepSpeed's bf16 section, which deepspeed_config does not enable"
    ):
        matrix_from_dict(
            with_config(dtype=["ds_bf16"], zero_stage=[1]) | {"baseline": {"trainer": "deepspeed", "zero_stage": 1}}
        )
    # a bf16 config's DeepSpeed cells beside gaeq's default reference (torch): the baseline at fault, named with its fix
    team = with_config(bf16, trainer=["deepspeed"], dtype=["ds_bf16"], zero_stage=[2])
    with pytest.raises(MatrixError, match=r"^the baseline of group .*\(torch, world 1 × micro 16\): .*ds_bf16.* give "
                       r"the group a baseline that can run it, e.g. `baseline: \{trainer: deepspeed"):  # fmt: skip
        matrix_from_dict(team)
    assert matrix_from_dict(team | {"baseline": {"trainer": "deepspeed", "zero_stage": 2}}).baselines
    with pytest.raises(
        MatrixError, match="bug 'unmirrored_default_clipping' exists only in a problem with a deepspeed_config"
    ):
        matrix_from_dict(
            small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "unmirrored_default_clipping"}])
        )
