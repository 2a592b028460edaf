"""The library trainers at world size 1, in this process. accelerate's own accumulation
(accumulate(), backward() dividing by GA, clip_grad_norm_ on sync steps) and the transformers Trainer
(num_items_in_batch) match the full batch and the manual trainer; dividing by GA by hand as well, and
the Trainer without num_items_in_batch, are caught; the libraries' process-wide state is reset
between cells (each cell runs its own GA); what the Trainer cannot be set to exactly is bad input."""

from __future__ import annotations

import pytest

from gaeq.matrix import MatrixError, load_matrix, matrix_from_dict
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore
from tests.helpers import run_in_process, small_spec

pytest.importorskip("accelerate")
pytest.importorskip("transformers")


def test_accelerate_accumulation_matches_and_the_double_division_is_caught(write_matrix, tmp_path):
    spec = small_spec(
        axes={"trainer": ["torch", "accelerate"], "world_size": [1], "micro_batch_size": [2, 8]},
        cells=[
            {"trainer": "accelerate", "micro_batch_size": 2, "bug": "accelerate_loss_divided_twice"},
            {"trainer": "accelerate", "micro_batch_size": 4, "dtype": "bf16"},
            {"trainer": "torch", "micro_batch_size": 16, "dtype": "bf16"},
        ],
    )
    spec["problem"]["gradient_clipping"] = 0.5  # acts on every step: clip_grad_norm_ must see the whole sum
    matrix = load_matrix(write_matrix(spec))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    by_id = {c.id: c for c in report.cells}
    for cell_id in ("accelerate-w1-mb2-ga8", "accelerate-w1-mb8-ga2", "torch-w1-mb2-ga8"):
        cell = by_id[cell_id]
        assert cell.verdict == "match", (cell_id, cell.reason)
        assert 0 < cell.max_abs_loss_diff < 1e-6
        if cell.trainer == "accelerate":
            assert (
                cell.ran["grad_accum_steps"] == cell.grad_accum_steps
                and cell.ran["micro_steps"] == cell.grad_accum_steps
            )
            assert (cell.ran["mixed_precision"], cell.ran["scheduler_steps_with_optimizer"]) == ("no", False)
    bf16 = by_id["accelerate-w1-mb4-ga4-bf16"]  # accelerate's own autocast: bf16 really ran
    assert bf16.verdict == "match" and (bf16.ran["mixed_precision"], bf16.ran["compute_dtype"]) == ("bf16", "bfloat16")
    control = by_id["accelerate-w1-mb2-ga8-bug_accelerate_loss_divided_twice"]
    # ÷ GA twice: the gradient is GA = 8 times too small, so rel Δ grad norm = 1 - 1/8 at step 0.
    assert (control.verdict, control.caught_by, control.first_divergent_step) == ("diverge", "grad_norm", 0)
    assert control.reason.startswith("grad norm diverged at step 0: rel 8.75e-01"), control.reason


def test_accelerate_cells_are_fp32_or_bf16_and_its_scheduler_trap_needs_two_ranks():
    with pytest.raises(MatrixError, match="the accelerate trainer runs fp32 and bf16 .*not fp16"):
        matrix_from_dict(small_spec(cells=[{"trainer": "accelerate", "micro_batch_size": 4, "dtype": "fp16"}]))
    with pytest.raises(MatrixError, match="zero_stage is a DeepSpeed setting; the accelerate cell w1 mb4 sets it"):
        matrix_from_dict(small_spec(cells=[{"trainer": "accelerate", "micro_batch_size": 4, "zero_stage": 1}]))
    with pytest.raises(
        MatrixError, match="bug 'accelerate_scheduler_per_process' needs world_size ≥ 2, the cell has 1"
    ):
        matrix_from_dict(
            small_spec(
                cells=[{"trainer": "accelerate", "micro_batch_size": 4, "bug": "accelerate_scheduler_per_process"}]
            )
        )


def test_the_transformers_trainer_matches_and_without_num_items_it_is_the_mean_of_micro_means(write_matrix, tmp_path):
    spec = small_spec(
        axes={"trainer": ["torch", "hf"], "world_size": [1], "micro_batch_size": [2, 8]},
        cells=[{"trainer": "hf", "micro_batch_size": 2, "bug": "hf_loss_per_micro_batch"}],
    )
    spec["problem"] |= {
        "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
        "data": {"kind": "tokens", "vocab_size": 16, "seq_len": 12},
        "loss": "cross_entropy",
        # the Trainer's warmup (lr 0 at step 0), which every cell of the matrix follows
        "schedule": {
            "name": "warmup_cosine",
            "warmup_steps": 3,
            "warmup_convention": "transformers",
            "min_lr_ratio": 0.1,
        },
    }  # weight decay 0.01 on every parameter: the Trainer's default would spare biases and norms
    matrix = load_matrix(write_matrix(spec))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    by_id = {c.id: c for c in report.cells}
    for cell_id in ("hf-w1-mb2-ga8", "hf-w1-mb8-ga2"):
        cell = by_id[cell_id]
        assert cell.verdict == "match", (cell_id, cell.reason)
        assert 0 < cell.max_abs_loss_diff < 1e-6
        assert (cell.ran["model_accepts_loss_kwargs"], cell.ran["micro_steps"]) == (True, cell.grad_accum_steps)
    control = by_id["hf-w1-mb2-ga8-bug_hf_loss_per_micro_batch"]
    assert (control.verdict, control.caught_by, control.first_divergent_step) == ("diverge", "grad_norm", 0), (
        control.reason
    )
    assert control.ran["model_accepts_loss_kwargs"] is False


@pytest.mark.parametrize("convention", ["transformers", "gaeq"])
def test_the_trainers_own_scheduler_gives_gaeqs_lr_at_every_step_under_its_warmup_convention(convention):
    """What the Trainer builds from TrainingArguments(lr_scheduler_type, warmup_steps, min_lr_rate) against
    gaeq's schedule: the same lr at every step under transformers' convention; gaeq's own (the control)
    is one warmup step ahead."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import get_scheduler

    from gaeq.problem.optim import lr_factor
    from gaeq.problem.spec import ScheduleSpec
    from gaeq.trainers.hf_trainer import SCHEDULES

    steps, lr = 20, 3e-3
    schedule = ScheduleSpec(name="warmup_cosine", warmup_steps=5, min_lr_ratio=0.1, warmup_convention=convention)
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    ours = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    trainer = get_scheduler(
        SCHEDULES[schedule.name],
        theirs,
        num_warmup_steps=schedule.warmup_steps,
        num_training_steps=steps,
        scheduler_specific_kwargs={"min_lr_rate": schedule.min_lr_ratio},
    )
    gaeq = LambdaLR(ours, lr_factor(schedule, steps=steps))
    differ = []
    for step in range(steps):
        if abs(trainer.get_last_lr()[0] - gaeq.get_last_lr()[0]) > 1e-12:
            differ.append(step)
        theirs.step(), ours.step(), trainer.step(), gaeq.step()
    assert differ == ([] if convention == "transformers" else list(range(schedule.warmup_steps)))


@pytest.mark.parametrize(
    ("problem", "why"),
    [
        ({}, "token data only"),
        (
            {
                "schedule": {"name": "warmup_cosine", "warmup_steps": 3},
                "model": {"kind": "gpt"},
                "data": {"kind": "tokens"},
                "loss": "cross_entropy",
            },
            "linear warmup starts at lr 0",
        ),
        (
            {
                "optimizer": {"name": "sgd", "lr": 0.1},
                "model": {"kind": "gpt"},
                "data": {"kind": "tokens"},
                "loss": "cross_entropy",
            },
            "its optimizer is AdamW",
        ),
    ],
)
def test_what_the_trainer_cannot_be_set_to_exactly_is_bad_input(problem, why):
    spec = small_spec(cells=[{"trainer": "hf", "micro_batch_size": 4}])
    spec["problem"] |= problem
    spec["problem"]["schedule"] = problem.get("schedule", {"name": "constant"})
    with pytest.raises(MatrixError, match=f"trainer hf / hf_deepspeed: .*{why}"):
        matrix_from_dict(spec)


def test_the_trainer_with_deepspeed_needs_zero_1_or_more():
    spec = small_spec(cells=[{"trainer": "hf_deepspeed", "micro_batch_size": 4, "zero_stage": 0}])
    spec["problem"] |= {
        "model": {"kind": "gpt"},
        "data": {"kind": "tokens"},
        "loss": "cross_entropy",
        "schedule": {"name": "constant"},
    }
    with pytest.raises(
        MatrixError,
        match="hf_deepspeed trainer needs ZeRO ≥ 1: at ZeRO-0 DeepSpeed's engine reports no global grad norm",
    ):
        matrix_from_dict(spec)


def test_without_the_hf_extra_a_library_trainer_says_how_to_install_it(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("accelerate", "transformers") else find_spec(name, *a),
    )
    for trainer, package in (("accelerate", "accelerate"), ("hf", "transformers")):
        with pytest.raises(MatrixError, match=f"trainer {trainer} needs {package}: pip install 'gaeq\\[hf\\]'"):
            matrix_from_dict(small_spec(cells=[{"trainer": trainer, "micro_batch_size": 4}]))


def test_fsdp_and_library_cells_are_fp32_or_bf16_and_write_no_checkpoints():
    with pytest.raises(MatrixError, match="the fsdp trainer runs fp32 and bf16 .*not fp16"):
        matrix_from_dict(small_spec(cells=[{"trainer": "fsdp", "micro_batch_size": 4, "dtype": "fp16"}]))
    spec = small_spec(
        resume=[
            {
                "from": {"trainer": "fsdp", "micro_batch_size": 4},
                "at_step": 4,
                "universal": False,
                "to": [{"world_size": 1, "micro_batch_size": 8}],
            }
        ]
    )
    with pytest.raises(
        MatrixError,
        match="checkpoints are written and resumed by the torch and deepspeed trainers; source fsdp-w1-mb4-ga4 is fsdp",
    ):
        matrix_from_dict(spec)


@pytest.mark.parametrize(("world", "sp", "micro"), [(1, 1, 2), (2, 1, 2), (2, 2, 4), (2, 2, 1), (4, 2, 2), (4, 4, 1)])
def test_the_trainers_loader_takes_each_steps_samples_where_the_plan_puts_them(world, sp, micro):
    """The Trainer's loader hands rank r batch k·world + r (accelerate's sharding); under sequence parallelism
    DeepSpeed's adapter runs the sp ranks' k-th batches one after the other on the whole group. Replaying
    that consumption over gaeq's dataset gives every (step, micro-step, data rank) the plan's samples — and,
    without sequence parallelism, the plan's positions in order."""
    from types import SimpleNamespace

    from gaeq.problem.data import BatchPlan
    from gaeq.trainers.hf_trainer import PositionDataset

    batch, steps, dp = 8, 3, world // sp
    plan = BatchPlan(train_batch_size=batch, micro_batch_size=micro, data_parallel=dp)
    task = SimpleNamespace(plan=plan, built=SimpleNamespace(dataset=SimpleNamespace(seq_len=8)))
    cell = SimpleNamespace(sequence_parallel=sp, world_size=world)
    data = PositionDataset(task, cell=cell, steps=steps, with_positions=False)
    ga = plan.grad_accum_steps
    loader = {r: [[data.position(b * micro + i) for i in range(micro)] for b in range(r, len(data) // micro, world)]
              for r in range(world)}  # fmt: skip
    for group in range(dp):  # the adapter of the sequence-parallel group of data rank `group`
        ranks = range(group * sp, (group + 1) * sp)
        iterations = [loader[r][k] for k in range(len(loader[ranks[0]])) for r in ranks]
        for i, rows in enumerate(iterations[: steps * ga]):
            step, micro_step = divmod(i, ga)
            assert rows == list(plan.positions(step=step, micro_step=micro_step, rank=group))
    if sp == 1:
        assert [data.position(i) for i in range(len(data))] == list(range(steps * batch))
