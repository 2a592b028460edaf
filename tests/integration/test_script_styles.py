"""Scripts written in the styles people write them, not in the examples' (experiments/scripts/:
ds_loss_module.py, trainer_padded.py, accelerate_padded.py): a loss module called after the model,
collators that pad each batch to its longest — on the left and on the right —, ``model(**batch)``, a
prepared scheduler that accelerate steps once per process, DeepSpeed's engine and the Trainer's own
loop. Each experiment's split at GA 8 (world 1) and GA 2 (world 2) matches its baseline, and each
mistake is caught at its level. (The experiments' whole files run in docs/your-setup.md.)"""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok

pytestmark = pytest.mark.integration

CLEAN = [{"world_size": 1, "micro_batch_size": 2}, {"world_size": 2, "micro_batch_size": 4}]  # GA 8, GA 2 at B 16


def run(tmp_path, experiment: str, cells: list[dict], *, args: list[str] = (), noise_floor: bool = False) -> dict:
    """`experiment` at 3 steps and B = 16, its script and launcher as they are, with `cells` (and
    `args` added to the script's own in every cell, the baseline's too); the dtype's own tolerances
    unless `noise_floor` (a twin measures this script's rounding)."""
    spec = yaml.safe_load((REPO / "experiments" / experiment).read_text())
    for key in ("path", "deepspeed_config"):
        if key in spec["script"]:
            spec["script"][key] = str(REPO / "experiments" / spec["script"][key])
    spec["script"]["files"] = [str(REPO / "experiments" / f) for f in spec["script"].get("files", [])]
    spec["script"]["args"] += list(args)
    spec |= {"steps": 3, "train_batch_size": 16, "noise_floor": noise_floor, "detection_limit": noise_floor}
    spec.setdefault("floor_twins", 2)  # the experiment's own where it says
    spec["cells"] = cells
    spec.pop("axes", None)
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "mine.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    return cells_by_id(report)


def caught(cell: dict) -> tuple[str, int]:
    return cell["caught_by"], cell["first_divergent_step"]


def test_a_deepspeed_script_with_a_loss_module(tmp_path):
    """nn.CrossEntropyLoss() after the engine: its inputs (logits, labels) are not the samples."""
    bugs = [
        {"world_size": 2, "micro_batch_size": 4, "args": ["--bug", "no_distributed_sampler"], "expect": "diverge"},
        {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "criterion_sum"], "expect": "diverge"},
    ]
    cells = run(tmp_path, "your_ds_loss_module_script.yaml", CLEAN + bugs)
    assert {i: c["verdict"] for i, c in cells.items() if "bug" not in i} == dict.fromkeys(
        ("script-w1-mb16-ga1", "script-w1-mb2-ga8", "script-w2-mb4-ga2"), "match"
    )
    assert cells["script-w1-mb2-ga8"]["ran"]["micro_batch_rows"] == [2]  # the model's rows, not the loss module's
    sampler = cells["script-w2-mb4-ga2-args_bug_no_distributed_sampler"]
    assert caught(sampler) == ("data", 0) and "seen twice" in sampler["reason"]
    assert caught(cells["script-w1-mb4-ga4-args_bug_criterion_sum"]) == ("loss", 0)
    assert cells["script-w2-mb4-ga2"]["comm_bytes_per_step"] > 0 and cells["script-w2-mb4-ga2"]["peak_mem_bytes"] > 0


def test_a_trainer_script_padding_each_batch_left_and_right(tmp_path):
    """DataCollatorForSeq2Seq pads each micro-batch to its longest: a sample is the same whatever its padding."""
    left = [cell | {"args": ["--padding_side", "left"]} for cell in CLEAN]
    bug = {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "model_without_loss_kwargs"], "expect": "diverge"}
    cells = run(tmp_path, "your_trainer_padded_script.yaml", [*CLEAN, *left, bug])
    assert [c["verdict"] for i, c in cells.items() if "bug" not in i] == ["match"] * 5
    assert all(c["not_checked"] == {} for c in cells.values())
    assert caught(cells["script-w1-mb4-ga4-args_bug_model_without_loss_kwargs"]) == ("loss", 0)
    # the Trainer's mean of micro-batch means (transformers#34242), named from the split's own targets' weights
    assert cells["script-w1-mb4-ga4-args_bug_model_without_loss_kwargs"]["weights"]["shape"] == "micro_batch_means"
    assert [c["weights"]["shape"] for i, c in cells.items() if "bug" not in i] == ["mean"] * 5


def test_targets_that_depend_on_the_padding_are_caught_by_the_numbers_not_the_data(tmp_path):
    """labels = input_ids under left padding: each row shorter than its batch's longest "predicts" its
    first token from a pad, so the targets depend on the split. Every cell runs it, the baseline too:
    the samples are the same (the mask removes the padding), the objective is not."""
    cells = run(
        tmp_path,
        "your_trainer_padded_script.yaml",
        [{"world_size": 1, "micro_batch_size": 2, "expect": "diverge"}],
        args=["--padding_side", "left", "--bug", "bos_is_target"],
    )
    split = cells["script-w1-mb2-ga8"]
    assert split["verdict"] == "diverge" and split["caught_by"] in ("loss", "grad_norm"), split["reason"]
    assert split["divergence_steps"]["data"] is None


def test_an_accelerate_script_with_a_scheduler_sized_for_its_processes(tmp_path):
    """run_clm_no_trainer's style: pad_sequence per batch, model(**batch), a prepared scheduler sized
    × num_processes (accelerate steps it once per process: the lr is the baseline's); not sized, the
    lr runs ahead, and the reason says what advanced it."""
    bugs = [
        {"world_size": 2, "micro_batch_size": 4, "args": ["--bug", "scheduler_not_sized"], "expect": "diverge"},
        {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "mean_of_means"], "expect": "diverge"},
    ]
    cells = run(tmp_path, "your_accelerate_padded_script.yaml", CLEAN + bugs)
    assert [c["verdict"] for i, c in cells.items() if "bug" not in i] == ["match"] * 3
    assert cells["script-w2-mb4-ga2"]["divergence_steps"]["events"] is None  # one scheduler call a step
    unsized = cells["script-w2-mb4-ga2-args_bug_scheduler_not_sized"]
    assert (
        caught(unsized) == ("lr", 1)
        and "AcceleratedScheduler, which stepped the scheduler it wraps 2×" in (unsized["reason"])
    )
    assert caught(cells["script-w1-mb4-ga4-args_bug_mean_of_means"]) == ("loss", 0)
    assert cells["script-w1-mb4-ga4-args_bug_mean_of_means"]["weights"]["shape"] == "micro_batch_means"
    assert cells["script-w2-mb4-ga2-args_bug_scheduler_not_sized"]["weights"]["shape"] == "mean"  # the lr's, not its


def test_a_ddp_script_with_torchs_muon(tmp_path):
    """torch.optim.Muon over a bias-free MLP: each rank orthogonalises each of its 3 matrices once a step,
    as the one-rank baseline (the probe counts them: gaeq/newton_schulz.py); its bf16 Newton–Schulz turns
    rounding into rare flips of 1e-5, which the script's six twins measure on its baseline's split (the
    constants alone, or two twins that saw no flip, call GA 8 a divergence); stepping after every
    micro-batch is another split."""
    import json

    bug = {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "step_every_micro_batch"], "expect": "diverge"}
    cells = run(tmp_path, "your_muon_script.yaml", CLEAN + [bug], noise_floor=True)  # bf16 rounding: measured
    assert {
        i: c["verdict"] for i, c in cells.items() if "bug" not in i and c["role"] in ("baseline", "cell")
    } == dict.fromkeys(("script-w1-mb16-ga1", "script-w1-mb2-ga8", "script-w2-mb4-ga2"), "match")
    assert sum(c["role"] == "floor" for c in cells.values()) == 6
    for cell_id, ranks in (("script-w1-mb16-ga1", [3]), ("script-w2-mb4-ga2", [3, 3])):
        probe = json.loads((tmp_path / "run" / "cells" / cell_id / "probe.json").read_text())
        assert [step["newton_schulz"] for step in probe["steps"]] == [ranks] * 3
        assert [step["newton_schulz_early"] for step in probe["steps"]] == [[0] * len(ranks)] * 3  # all after
    assert caught(cells["script-w1-mb4-ga4-args_bug_step_every_micro_batch"]) == ("split", 0)


def test_a_loop_in_lightnings_shape_with_step_closure_and_a_list_batch(tmp_path):
    """experiments/your_closure_script.yaml: the module's batch a list, the boundary's micro-batch inside
    `optimizer.step(closure)`, clipping in the closure (PyTorch Lightning's automatic optimisation with
    accumulate_grad_batches, written with torch alone). Before, every split was a false `diverge`: the list
    held no sample gaeq could see, and the norm was read before the closure ran (NaN at GA 1). Now the
    boundary is read after the closure: every split matches; zero_grad inside the closure is caught; and a
    module that returns its loss alone is weighed inside for the detection limit."""
    bug = {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "zero_grad_in_closure"], "expect": "diverge"}
    cells = run(tmp_path, "your_closure_script.yaml", CLEAN + [bug], noise_floor=True)
    for cell_id in ("script-w1-mb2-ga8", "script-w2-mb4-ga2"):
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]["reason"]
        assert cells[cell_id]["ran"]["micro_batch_rows"] == [int(cell_id.split("-mb")[1].split("-")[0])]
    base = cells["script-w1-mb16-ga1"]
    assert base["ran"]["micro_steps"] == [1]  # the closure's backward counted in its step
    planted = cells["script-w1-mb4-ga4-args_bug_zero_grad_in_closure"]
    assert planted["verdict"] == "diverge" and planted["divergence_steps"]["grad_norm"] == 0, planted
    weighed = cells["script-w1-mb16-ga1-weight1e-02"]  # the model returns its loss: weighed inside it
    assert weighed["max_rel_grad_norm_diff"] > 1e-3, weighed


def test_a_ddp_script_with_two_optimizers_a_step(tmp_path):
    """experiments/your_two_optimizer_script.yaml: torch's Muon for the hidden matrices and AdamW for the rest,
    both stepped once per optimizer step with no backward between them — one training step, one record with
    its real loss (before, each optimizer.step() was a step: every other record's loss was 0 and the script
    was stopped after half its steps). Every split matches within the twins' floor (bf16 Newton–Schulz); the
    AdamW half stepped after every micro-batch is another split, and the reason names what stepped."""
    import json

    bug = {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "adamw_every_micro_batch"], "expect": "diverge"}
    cells = run(tmp_path, "your_two_optimizer_script.yaml", CLEAN + [bug], noise_floor=True)
    for cell_id in ("script-w1-mb16-ga1", "script-w1-mb2-ga8", "script-w2-mb4-ga2"):
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]["reason"]
    probe = json.loads((tmp_path / "run" / "cells" / "script-w1-mb16-ga1" / "probe.json").read_text())
    assert [s["step"] for s in probe["steps"]] == [0, 1, 2] and all(s["objective"] > 0.5 for s in probe["steps"])
    # both optimizers in each step, the last one's too (the script is stopped once every optimizer of its
    # first step has stepped)
    assert [s["events"]["optimizer_step"] for s in probe["steps"]] == [2, 2, 2]
    assert all(s["backward"] == [1] for s in probe["steps"])
    assert all({"stepped:Muon", "stepped:AdamW"} <= set(s["events"]) for s in probe["steps"])
    planted = cells["script-w1-mb4-ga4-args_bug_adamw_every_micro_batch"]
    # (the 3 steps asked end before Muon's first: the reason names what the probe saw step)
    assert caught(planted) == ("split", 0) and planted["reason"].startswith(
        "AdamW stepped after every micro-batch (one backward call per step on each rank), where the cell accumulates 4"
    ), planted["reason"]


def test_a_script_driven_by_a_config_file(tmp_path):
    """experiments/your_config_file_script.yaml: the split in a JSON config the script reads (picotron's
    way), each cell's copy filled by gaeq (script.files) — every split matches, and a loss never ÷ GA,
    set on the command line beside the config, is caught at step 0 (the objective GA ×)."""
    bug = {"world_size": 1, "micro_batch_size": 4, "args": ["--bug", "loss_not_divided"], "expect": "diverge"}
    cells = run(tmp_path, "your_config_file_script.yaml", CLEAN + [bug])
    for cell_id in ("script-w1-mb2-ga8", "script-w2-mb4-ga2"):
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]["reason"]
    assert cells["script-w2-mb4-ga2"]["ran"]["micro_steps"] == [2]  # the config's GA, as the probe saw it
    assert caught(cells["script-w1-mb4-ga4-args_bug_loss_not_divided"]) == ("loss", 0)  # GA × the objective


def test_a_trainer_script_packing_each_micro_batch_into_one_row(tmp_path):
    """The Trainer script with --padding_free (TRL's padding_free: DataCollatorWithFlattening packs each
    micro-batch into one row, position_ids restarting at each sequence, no attention mask on purpose): each
    sequence is a sample, so the split is the cell's and the data the baseline's — before, every split was a
    false `diverge` ("it ran micro-batches of 1"), the baseline's too."""
    cells = run(tmp_path, "your_trainer_padded_script.yaml", CLEAN, args=["--padding_free"])
    for cell_id, rows in (("script-w1-mb16-ga1", 16), ("script-w1-mb2-ga8", 2), ("script-w2-mb4-ga2", 4)):
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]["reason"]
        assert cells[cell_id]["ran"]["micro_batch_rows"] == [rows]  # sequences, read from the packed row
        assert cells[cell_id]["not_checked"] == {}  # the data was checked: sequences exactly delimited


def test_packing_switched_on_against_a_padded_baseline_trains_the_same_and_positions_running_on_are_caught(tmp_path):
    """experiments/your_packing_script.yaml (TRL's padding_free against the padded full batch; the labels a copy
    of the ids): the packed splits' rows differ from the baseline's — each sequence's first label -100, a
    seq_idx — but what the loss learns from is the same: `match`, the reason saying how the layout differs. A
    packer whose position ids run on across the row (the sequences attend to each other) differs in the
    samples trained: data, at step 0, at world 1 and 2."""
    spec = yaml.safe_load((REPO / "experiments" / "your_packing_script.yaml").read_text())
    cells = run(tmp_path, "your_packing_script.yaml", [{"world_size": 1, "micro_batch_size": 2}, *spec["cells"]])
    for cell_id in ("script-w1-mb4-ga4-args_padding_free_seq_idx", "script-w2-mb4-ga2-args_padding_free_seq_idx"):
        packed = cells[cell_id]
        assert packed["verdict"] == "match" and packed["not_checked"] == {}, packed["reason"]
        assert packed["reason"] == (
            "laid out otherwise than the baseline — packed by position_ids, seq_idx, the baseline padded right "
            "(attention_mask) —: the same samples, each trained on the same targets, in every step"
        )
    assert cells["script-w1-mb2-ga8"]["verdict"] == "match" and cells["script-w1-mb2-ga8"]["reason"] == ""
    for cell_id in [i for i in cells if "run_on" in i]:
        run_on = cells[cell_id]
        assert caught(run_on) == ("data", 0), run_on["reason"]
        assert (
            "your model was given packed rows by position_ids, seq_idx (they disagree: position_ids starts 1"
            in (run_on["reason"])
            and "a sampler" not in run_on["reason"]
        )


def test_a_pytorch_lightning_script(tmp_path):
    """experiments/your_lightning_script.yaml: a real PyTorch Lightning Trainer (accumulate_grad_batches,
    gradient_clip_val, strategy="ddp" on two devices), unchanged. On one device every split matches — the
    closure and the list batch read where they are (before: every split a false `diverge`, the baseline's too).
    On two, Lightning swaps the script's sequential DataLoader for a shuffling DistributedSampler: other
    samples from step 0, caught as data first, as the matrix expects."""
    shuffled = {
        "world_size": 2,
        "micro_batch_size": 4,
        "expect": {"verdict": "diverge", "caught_by": "data", "step": 0},
    }
    splits = [{"world_size": 1, "micro_batch_size": 2}, {"world_size": 1, "micro_batch_size": 4}, shuffled]
    cells = run(tmp_path, "your_lightning_script.yaml", splits)
    for cell_id in ("script-w1-mb16-ga1", "script-w1-mb2-ga8", "script-w1-mb4-ga4"):
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]["reason"]
    sampled = cells["script-w2-mb4-ga2"]
    assert (sampled["verdict"], sampled["caught_by"], sampled["first_divergent_step"]) == ("diverge", "data", 0)
    assert "samples missing" in sampled["reason"]


def test_a_clip_written_by_hand_on_more_ranks_matches_the_clip_call_of_the_reference_and_a_wrong_one_is_caught(
    tmp_path,
):
    """torchtitan's style: on several ranks the script clips by its own total norm (`g.mul_(clamp(max / norm))`),
    on one it calls clip_grad_norm_ — the same arithmetic, the same update. The probe sees the gradients change in
    place after the last backward by no call it patches, so that split's norm (read after the clip) is not
    compared with the reference's (read before): said, the update and the loss judge — and match. The control, in
    every split: each tensor clipped by its own norm, caught by the update it makes. (Adam's first update is nearly
    the gradient's sign whatever its scale: step 0 moves it by about the tolerance, 1e-05, step 1 by far.)"""
    args = ["--clip_by_hand", "beyond_world_1"]
    cells = [{"world_size": 2, "micro_batch_size": 4}]
    cells += [
        {"world_size": 2, "micro_batch_size": 4, "args": ["--bug", "clip_each_tensor_by_hand"], "expect": "diverge"}
    ]
    said = run(tmp_path, "your_script.yaml", cells, args=args)
    clean, planted = said["script-w2-mb4-ga2"], said["script-w2-mb4-ga2-args_bug_clip_each_tensor_by_hand"]
    assert clean["verdict"] == "match" and clean["not_checked"]["grad_norm"].startswith(
        "from optimizer step 0 this split's gradients changed in place after its last backward by no call gaeq patches"
    )
    assert clean["divergence_steps"]["events"] is None  # a hand clip is a change before the step, as a call is
    assert planted["verdict"] == "diverge" and planted["caught_by"] == "update" and planted["first_divergent_step"] <= 1


def test_a_clip_by_hand_that_acts_only_where_it_clips_matches_the_reference_that_calls_clip_grad_norm(tmp_path):
    """Megatron-LM's clip on FSDP2's shards: the whole model's norm summed over the ranks, the shards scaled only
    where it clips, through `.data` (its fused kernel moves no version counter). The reference calls
    `clip_grads_with_norm_` every step; the split clips at step 0 only (its norm ~1.08 against 1.0), so steps 1 and
    2 show no clip of its: once against none is no divergence of itself — the update and the loss judge, and match.
    Its control, each rank clipping by its own shards' norm at world 2, is caught by the update it makes."""
    megatron = ["--clip", "1.0", "--clip_by_hand", "--clip_as", "megatron"]
    cells = [{"world_size": 1, "micro_batch_size": 4, "args": megatron}]
    cells += [{"world_size": 2, "micro_batch_size": 4, "args": [*megatron, "--bug", "clip_by_hand_per_shard"],
               "expect": "diverge"}]  # fmt: skip
    said = run(tmp_path, "your_fsdp2_script.yaml", cells, args=["--clip", "1.0"])
    clean = said["script-w1-mb4-ga4-args_clip_1.0_clip_by_hand_clip_as_megatron"]
    planted = said["script-w2-mb4-ga2-args_clip_1.0_clip_by_hand_clip_as_megatron_bug_clip_by_hand_per_shard"]
    assert clean["verdict"] == "match" and clean["divergence_steps"]["events"] is None, clean["reason"]
    assert clean["not_checked"]["grad_norm"].startswith("from optimizer step 0 this split's gradients changed in place")
    assert (planted["verdict"], planted["caught_by"]) == ("diverge", "update"), planted["reason"]
