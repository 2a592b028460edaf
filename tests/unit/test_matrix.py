"""The matrix schema: what a user may write, what gets expanded, and the errors they see."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from gaeq.cli import app
from gaeq.matrix import MatrixError, load_matrix
from tests.helpers import judged, small_spec

runner = CliRunner()


def test_ga_is_derived_and_cells_are_named(write_matrix):
    spec = small_spec(
        axes={"trainer": ["torch", "deepspeed"], "world_size": [1, 2], "micro_batch_size": [2, 8], "zero_stage": [0, 3]}
    )
    m = load_matrix(write_matrix(spec))
    by_id = {c.id: c for c in m.cells}
    # 1 baseline + torch 2×2 + deepspeed 2×2×2
    assert len(judged(m.cells)) == 1 + 4 + 8
    assert m.baselines == {"fp32": "torch-w1-mb16-ga1"}
    assert by_id["deepspeed-z3-w2-mb2-ga4"].grad_accum_steps == 4  # 16 / (2 × 2)
    assert by_id["torch-w1-mb8-ga2"].grad_accum_steps == 2
    assert by_id["torch-w2-mb8-ga1"].zero_stage is None
    assert all(c.expect == "match" for c in judged(m.cells))


def test_baseline_in_the_axes_is_not_duplicated(write_matrix):
    m = load_matrix(write_matrix(small_spec(axes={"micro_batch_size": [16, 4]})))
    assert [c.id for c in judged(m.cells)] == ["torch-w1-mb16-ga1", "torch-w1-mb4-ga4"]


def test_unknown_key_is_named(write_matrix):
    spec = small_spec()
    spec["problem"]["optimiser"] = {"name": "sgd"}
    with pytest.raises(MatrixError, match=r"unknown key 'problem\.optimiser'"):
        load_matrix(write_matrix(spec))


def test_bad_type_is_named(write_matrix):
    spec = small_spec()
    spec["problem"]["steps"] = "many"
    with pytest.raises(MatrixError, match=r"problem\.steps: .*integer.*'many'"):
        load_matrix(write_matrix(spec))


def test_missing_key_is_named(write_matrix):
    spec = small_spec()
    del spec["problem"]["train_batch_size"]
    with pytest.raises(MatrixError, match=r"missing key 'problem\.train_batch_size'"):
        load_matrix(write_matrix(spec))


def test_indivisible_split_names_the_numbers(write_matrix):
    with pytest.raises(MatrixError, match=r"train_batch_size 16 is not divisible by micro_batch_size 3 × world_size 2"):
        load_matrix(write_matrix(small_spec(axes={"world_size": [2], "micro_batch_size": [3]})))


def test_indivisible_split_can_be_skipped_with_a_reason(write_matrix):
    m = load_matrix(
        write_matrix(small_spec(axes={"world_size": [1, 3], "micro_batch_size": [4]}, on_indivisible="skip"))
    )
    skipped = [c for c in m.cells if c.skip_reason]
    assert [c.id for c in skipped] == ["torch-w3-mb4-gaNA"]
    assert "not divisible by micro_batch_size 4 × world_size 3" in skipped[0].skip_reason
    assert skipped[0] not in m.runnable()


def test_zero_stage_is_deepspeed_only(write_matrix):
    spec = small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "zero_stage": 2}])
    with pytest.raises(MatrixError, match="zero_stage is a DeepSpeed setting"):
        load_matrix(write_matrix(spec))


def test_bug_cells_default_to_diverge_and_unknown_bugs_are_rejected(write_matrix):
    m = load_matrix(
        write_matrix(small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"}]))
    )
    control = m.cells[-1]
    assert (control.id, control.expect) == ("torch-w1-mb4-ga4-bug_no_loss_division", "diverge")
    with pytest.raises(MatrixError, match="unknown bug 'nope'"):
        load_matrix(write_matrix(small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "nope"}])))
    with pytest.raises(MatrixError, match="exists only in the torch trainer"):
        load_matrix(
            write_matrix(small_spec(cells=[{"trainer": "deepspeed", "micro_batch_size": 4, "bug": "no_loss_division"}]))
        )


def test_each_dtype_group_gets_its_baseline(write_matrix):
    m = load_matrix(write_matrix(small_spec(axes={"micro_batch_size": [4], "dtype": ["fp32", "bf16"]})))
    assert m.baselines == {"fp32": "torch-w1-mb16-ga1", "bf16": "torch-w1-mb16-ga1-bf16"}


def test_not_a_mapping_and_not_yaml(tmp_path):
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(MatrixError, match="top level must be a mapping"):
        load_matrix(listing)
    junk = tmp_path / "junk.yaml"
    junk.write_text("a: [1, 2\n")
    with pytest.raises(MatrixError, match="not valid YAML"):
        load_matrix(junk)
    with pytest.raises(MatrixError, match="no such file"):
        load_matrix(tmp_path / "absent.yaml")


@pytest.mark.parametrize("command", [["validate"], ["run", "--matrix"]])
def test_cli_bad_input_exits_2_with_one_line(write_matrix, command):
    spec = small_spec()
    spec["axes"]["micro_batch_sizes"] = [4]
    result = runner.invoke(app, [*command, str(write_matrix(spec))])
    assert result.exit_code == 2
    assert "unknown key 'axes.micro_batch_sizes'" in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_validate_prints_cells_without_training(write_matrix, tmp_path):
    spec = small_spec(
        axes={"trainer": ["torch", "deepspeed"], "world_size": [1, 2], "micro_batch_size": [4], "zero_stage": [2]}
    )
    result = runner.invoke(app, ["validate", str(write_matrix(spec))])
    assert result.exit_code == 0, result.output
    for cell_id in ("torch-w1-mb16-ga1", "torch-w2-mb4-ga2", "deepspeed-z2-w1-mb4-ga4", "deepspeed-z2-w2-mb4-ga2"):
        assert cell_id in result.output
    assert "baseline" in result.output
    assert not (tmp_path / "runs").exists()


def test_shipped_experiments_validate():
    from tests.conftest import REPO

    m = load_matrix(REPO / "experiments" / "ga.yaml")
    matches = [c for c in m.cells if c.expect == "match"]
    assert len(matches) >= 16
    assert {c.trainer for c in matches} == {"torch", "deepspeed"}
    assert {c.zero_stage for c in matches if c.trainer == "deepspeed"} == {0, 1, 2, 3}
    assert {c.world_size for c in matches} == {1, 2}
    assert len({c.micro_batch_size for c in matches} - {m.problem.train_batch_size}) >= 3
    assert m.problem.train_batch_size == 32 and m.problem.steps >= 50
    assert any(c.bug == "no_loss_division" and c.expect == "diverge" for c in m.cells)


@pytest.mark.parametrize("name", ["ga.yaml", "pitfalls.yaml", "plugins.yaml"])
def test_every_shipped_experiment_builds(name):
    from tests.conftest import REPO

    result = runner.invoke(app, ["validate", str(REPO / "experiments" / name)])
    assert result.exit_code == 0, result.output


def test_default_matrix_has_token_normalised_gpt_cells():
    from tests.conftest import REPO

    m = load_matrix(REPO / "experiments" / "ga.yaml")
    gpt = [c for c in judged(m.cells) if c.variant == "gpt"]
    assert m.problems["gpt"].loss == "cross_entropy" and m.problems["gpt"].data.kind == "tokens"
    assert {c.trainer for c in gpt} == {"torch", "deepspeed"} and all(c.expect == "match" for c in gpt)
    assert {c.zero_stage for c in gpt if c.trainer == "deepspeed"} == {0, 1, 2, 3}


def test_nvme_offload_is_zero3_and_skipped_with_the_command_where_libaio_is_missing(write_matrix, monkeypatch):
    axes = {
        "trainer": ["deepspeed"],
        "world_size": [2],
        "micro_batch_size": [4],
        "zero_stage": [1, 3],
        "offload": ["nvme"],
    }
    monkeypatch.setattr("gaeq.accelerator.nvme_unsupported_reason", lambda: None)
    cells = {c.id: c for c in load_matrix(write_matrix(small_spec(axes=axes))).cells}
    assert cells["deepspeed-z3-nvmeoff-w2-mb4-ga2"].skip_reason is None
    # DeepSpeed's ZeRO-1/2 take device nvme for cpu: such a cell would be labelled what it is not
    assert "nvme offload needs ZeRO-3" in cells["deepspeed-z1-nvmeoff-w2-mb4-ga2"].skip_reason

    monkeypatch.setattr("gaeq.accelerator.nvme_unsupported_reason", lambda: "no libaio: apt-get install libaio-dev")
    cells = {c.id: c for c in load_matrix(write_matrix(small_spec(axes=axes))).cells}
    assert cells["deepspeed-z3-nvmeoff-w2-mb4-ga2"].skip_reason == "no libaio: apt-get install libaio-dev"


def test_the_swap_folder_is_kept_only_when_asked(write_matrix, monkeypatch):
    monkeypatch.setattr("gaeq.accelerator.nvme_unsupported_reason", lambda: None)
    cell = {"trainer": "deepspeed", "world_size": 1, "micro_batch_size": 4, "zero_stage": 3, "offload": "nvme"}
    kept = load_matrix(write_matrix(small_spec(axes=None, cells=[cell], keep_nvme_swap=True))).cells[-1]
    assert (
        kept.keep_nvme_swap
        and not load_matrix(write_matrix(small_spec(axes=None, cells=[cell]))).cells[-1].keep_nvme_swap
    )


def mlp_nvme_matrix(write_matrix, *, hidden: int, depth: int, worlds: list[int]):
    """An MLP 16 → hidden (× depth) → 4 whose nvme cells run at `worlds`, checked as `gaeq run` checks it."""
    import gaeq

    spec = small_spec(
        axes={
            "trainer": ["deepspeed"],
            "world_size": worlds,
            "micro_batch_size": [2],
            "zero_stage": [3],
            "offload": ["nvme"],
        }
    )
    spec["problem"]["model"] = {"kind": "mlp", "hidden": hidden, "depth": depth}
    spec["problem"]["data"] = {"kind": "regression", "in_features": 16, "out_features": 4}
    return {c.world_size: c for c in gaeq.load(write_matrix(spec)).cells if c.offload == "nvme"}


def test_an_nvme_cell_that_would_swap_nothing_is_skipped_before_training_with_the_reason(write_matrix, monkeypatch):
    """DeepSpeed swaps a tensor from 1 MiB on, and ZeRO-3 hands its swappers partitions: a 640-wide MLP's
    640×640 weight swaps whole at world 1 (1.6 MB) and not in halves at world 2 (0.8 MB; the rank's
    optimizer partition 0.85 MB). Decided from the built model before any process starts."""
    monkeypatch.setattr("gaeq.accelerator.nvme_unsupported_reason", lambda: None)
    cells = mlp_nvme_matrix(write_matrix, hidden=640, depth=2, worlds=[1, 2])
    assert cells[1].skip_reason is None
    assert cells[2].skip_reason == (
        "nvme offload would swap nothing: DeepSpeed swaps a tensor only from 1,048,576 bytes on, and at world 2 "
        "ZeRO-3's largest parameter partition is 819,200 bytes, the rank's optimizer state partition 847,368 — "
        "everything would stay in memory (a wider model swaps)"
    )


@pytest.mark.parametrize(("hidden", "swaps"), [(512, True), (500, False)])
def test_the_optimizer_partition_alone_decides_at_the_threshold(write_matrix, monkeypatch, hidden, swaps):
    """At world 2, three hidden layers: every parameter's slice is under 1 MiB, the rank's fp32 optimizer
    partition is 1,072,136 bytes at width 512 (it swapped: the cell matched) and 1,023,008 at width 500
    (trained anyway, it wrote no file: LabelMismatch swapped_to_nvme) — the rule is exact on both sides."""
    monkeypatch.setattr("gaeq.accelerator.nvme_unsupported_reason", lambda: None)
    cell = mlp_nvme_matrix(write_matrix, hidden=hidden, depth=3, worlds=[2])[2]
    assert (cell.skip_reason is None) == swaps, cell.skip_reason


def epochs_spec(*cells: dict, num_samples: int | None = 40, steps: int = 12, **problem) -> dict:
    spec = small_spec(axes=None, cells=list(cells))
    spec["problem"]["data"]["num_samples"] = num_samples
    spec["problem"].update(epoch_end="short_step", steps=steps, **problem)
    return spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            epochs_spec({"trainer": "accelerate", "micro_batch_size": 4}),
            "epoch_end short_step runs in the torch, deepspeed, fsdp trainers, not accelerate",
        ),
        (epochs_spec({"trainer": "torch", "world_size": 2, "micro_batch_size": 8}), "40 mod train_batch_size 16 = 8"),
        (epochs_spec({"trainer": "torch", "micro_batch_size": 4}, num_samples=None), "set data.num_samples"),
        (epochs_spec({"trainer": "torch", "micro_batch_size": 4}, num_samples=16), "must exceed train_batch_size 16"),
        (
            epochs_spec(
                {"trainer": "torch", "micro_batch_size": 4, "bug": "partial_last_window"},
                steps=2,
                schedule={"name": "constant"},
            ),
            "exists only at an epoch's short last step",  # 40 samples: the short step is step 2, never reached
        ),
        (
            small_spec(
                cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "packed_sequences_weighted_per_pack"}]
            ),
            "exists only in packed token data",
        ),
    ],
)
def test_where_short_steps_and_their_bugs_are_bad_input(write_matrix, spec, message):
    with pytest.raises((MatrixError, ValueError), match=message):
        load_matrix(write_matrix(spec))


def test_the_partial_window_bug_needs_the_run_to_reach_a_short_step(write_matrix):
    matrix = load_matrix(
        write_matrix(epochs_spec({"trainer": "torch", "micro_batch_size": 4, "bug": "partial_last_window"}, steps=3))
    )
    assert matrix.cells[-1].bug == "partial_last_window"


def test_a_short_step_is_measured_against_its_label(write_matrix, tmp_path):
    """40 samples, B 16: steps of 16, 16, 8 — the third in 2 micro-steps of 4, not 4. `ran` says so,
    and a label that promised otherwise would fail the cell (the control, on Provenance itself)."""
    from gaeq.trainers.provenance import LabelMismatch, Provenance
    from tests.helpers import run_in_process

    matrix = load_matrix(write_matrix(epochs_spec({"trainer": "torch", "micro_batch_size": 4}, steps=4)))
    outcomes = run_in_process(matrix, tmp_path)
    ran = outcomes["torch-w1-mb4-ga4"].ran
    assert (ran["micro_steps"], ran["short_step_micro_steps"]) == (4, 2)
    assert "short_step_micro_steps" not in outcomes["torch-w1-mb16-ga1"].ran  # the baseline: 1 micro-batch, of 8

    cell = matrix.cells[-1]
    ran = Provenance(cell, promised={"short_step_micro_steps": 3}, world_size=1, tensor_parallel=1)
    layer = torch.nn.Linear(8, 2)
    for forwards in (4, 2):
        for _ in range(forwards):
            with ran.forward(inputs := torch.zeros(4, 8)):
                layer(inputs)
        if forwards == 2:
            with pytest.raises(LabelMismatch, match="short_step_micro_steps: label 3, ran 2"):
                ran.step_done()
        else:
            ran.step_done()


def test_resume_experiments_keep_epochs_running_on(write_matrix):
    spec = epochs_spec({"trainer": "torch", "micro_batch_size": 4})
    spec["resume"] = [
        {
            "from": {"trainer": "torch", "micro_batch_size": 4},
            "at_step": 3,
            "universal": False,
            "to": [{"micro_batch_size": 8}],
        }
    ]
    with pytest.raises(MatrixError, match="resume experiments with epoch_end short_step: not offered"):
        load_matrix(write_matrix(spec))


def test_the_compile_axis_is_the_compiling_trainers_and_its_bug_only_the_compiled_paths(write_matrix):
    """Compiled cells carry it in their id; trainers that run their model eager collapse the axis; a
    mistake of the compiled path is bad input in an eager cell, and compile with a model split over ranks
    is not offered."""
    from gaeq.matrix import MatrixError, load_matrix

    axes = {"trainer": ["torch", "deepspeed", "fsdp"], "world_size": [1], "micro_batch_size": [4], "compile": [True]}
    m = load_matrix(write_matrix(small_spec(axes=axes)))
    ids = {c.id for c in m.cells if c.role.value == "cell"}
    assert {"torch-w1-mb4-ga4-compiled", "deepspeed-z0-w1-mb4-ga4-compiled", "fsdp-w1-mb4-ga4"} <= ids
    eager_bug = {"trainer": "torch", "world_size": 1, "micro_batch_size": 4, "bug": "compiled_guards_skipped"}
    with pytest.raises(MatrixError, match="exists only in a compiled cell"):
        load_matrix(write_matrix(small_spec(cells=[eager_bug])))
    split = {"trainer": "torch", "world_size": 2, "tensor_parallel": 2, "micro_batch_size": 4, "compile": True}
    with pytest.raises(MatrixError, match="compile with a model split over ranks"):
        gpt = {"model": {"kind": "gpt"}, "data": {"kind": "tokens"}, "loss": "cross_entropy"}
        load_matrix(write_matrix(small_spec(cells=[split], problem=gpt)))
    fsdp = {"trainer": "fsdp", "world_size": 1, "micro_batch_size": 4, "compile": True}
    with pytest.raises(MatrixError, match="the fsdp trainer runs its model eager"):
        load_matrix(write_matrix(small_spec(cells=[fsdp])))
