"""experiments/your_config.yaml, the user's-own-config experiment: its DeepSpeed cells run
ds_config.json as it is (WarmupDecayLR, ZeRO-2 tuning, no gradient_clipping) and match
the torch mirror; the mirror of DeepSpeed's default clipping is what makes the clipped variant
match (its control, which does not mirror it, diverges); bf16 communication is caught. Your model:
a transformers Llama with its own loss matches at ZeRO-3 and world 2; the per-micro-batch
num_items_in_batch is caught; GPT-2's default dropout diverges with a reason that says so."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import REPO_ROOT, gaeq_run_here, not_ok

pytestmark = pytest.mark.integration

CELLS = [
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2},  # the file's own stage: ZeRO-2
    {"trainer": "deepspeed", "world_size": 1, "micro_batch_size": 2, "zero_stage": 3},
    {"trainer": "torch", "world_size": 2, "micro_batch_size": 2, "variant": "clipped"},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 4, "zero_stage": 1, "variant": "clipped"},
    {"trainer": "torch", "micro_batch_size": 4, "variant": "clipped", "bug": "unmirrored_default_clipping"},
    {
        "trainer": "deepspeed",
        "world_size": 2,
        "micro_batch_size": 2,
        "zero_stage": 2,
        "variant": "comm_bf16",
        "expect": "diverge",
    },
    {"trainer": "torch", "micro_batch_size": 2, "variant": "llama"},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 3, "variant": "llama"},
    {"trainer": "torch", "micro_batch_size": 2, "variant": "llama", "bug": "hf_num_items_per_micro_batch"},
    {"trainer": "torch", "micro_batch_size": 4, "variant": "gpt2_dropout", "expect": "diverge"},
]


VERDICTS = {
    "torch-w1-mb16-ga1": "match",
    "deepspeed-z2-w2-mb2-ga4": "match",
    "deepspeed-z3-w1-mb2-ga8": "match",
    "torch-w1-mb16-ga1@clipped": "match",
    "torch-w2-mb2-ga4@clipped": "match",
    "deepspeed-z1-w2-mb4-ga2@clipped": "match",
    "torch-w1-mb4-ga4-bug_unmirrored_default_clipping@clipped": "diverge",
    "torch-w1-mb16-ga1@comm_bf16": "match",
    "deepspeed-z2-w2-mb2-ga4@comm_bf16": "diverge",
    "torch-w1-mb16-ga1@llama": "match",
    "torch-w1-mb2-ga8@llama": "match",
    "deepspeed-z3-w2-mb2-ga4@llama": "match",
    "torch-w1-mb2-ga8-bug_hf_num_items_per_micro_batch@llama": "diverge",
    "torch-w1-mb16-ga1@gpt2_dropout": "match",
    "torch-w1-mb4-ga4@gpt2_dropout": "diverge",
}
"""CELLS (and each group's baseline) and the verdict each must get."""


@pytest.fixture(scope="module")
def your_config_run(tmp_path_factory):
    """The experiment's cells, run once for the module's claims."""
    tmp_path = tmp_path_factory.mktemp("your_config")
    spec = yaml.safe_load((REPO_ROOT / "experiments" / "your_config.yaml").read_text())
    config = json.loads((REPO_ROOT / "experiments" / "ds_config.json").read_text())
    # torch_adam: DeepSpeed builds torch's AdamW instead of FusedAdam, whose JIT build (about a minute, once
    # on a fresh machine) the suite cannot afford; `gaeq run --matrix experiments/your_config.yaml` runs
    # FusedAdam (docs/your-setup.md), and test_deepspeed_config.py checks its mirrored defaults.
    config["optimizer"]["params"]["torch_adam"] = True
    spec["problem"]["deepspeed_config"] = config
    spec.pop("axes")
    spec["cells"] = CELLS
    spec["variants"] = {
        k: v for k, v in spec["variants"].items() if k in ("clipped", "comm_bf16", "llama", "gpt2_dropout")
    }
    matrix = tmp_path / "your_config.yaml"
    matrix.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    proc, report, _ = gaeq_run_here(matrix, out)
    cells = {c["id"]: c for c in report.get("cells", [])}

    def trace(cell_id):
        return [json.loads(line) for line in (out / "cells" / cell_id / "trace.jsonl").read_text().splitlines()]

    return proc, cells, trace


def test_the_run_exits_0_and_says_what_it_overrode(your_config_run):
    proc, report, _ = your_config_run
    assert proc.returncode == 0, not_ok(proc, report)
    said = "overridden: train_batch_size: the file's 64 → 16 in the splits (the matrix's train_batch_size, what every "
    assert said in proc.stdout


def test_every_cell_gets_its_verdict(your_config_run):
    _, cells, _ = your_config_run
    assert {i: c["verdict"] for i, c in cells.items() if c["role"] in ("baseline", "cell")} == VERDICTS


@pytest.mark.parametrize(
    "cell_id", ["deepspeed-z2-w2-mb2-ga4", "deepspeed-z3-w1-mb2-ga8", "deepspeed-z1-w2-mb4-ga2@clipped"]
)
def test_the_file_ran_as_written_and_matches_the_mirror(your_config_run, cell_id):
    """Its optimizer, DeepSpeed's default clipping; measured max |Δloss| ≤ 2.9e-6."""
    _, cells, _ = your_config_run
    assert cells[cell_id]["max_abs_loss_diff"] <= 1e-5, cells[cell_id]["max_abs_loss_diff"]
    ran = cells[cell_id]["ran"]
    assert (ran["update_rule"], ran["gradient_clipping"]) == ("AdamW", 1.0), ran
    assert cells["torch-w1-mb16-ga1"]["ran"]["update_rule"] == "AdamW"


def test_deepspeeds_own_schedule_and_the_mirror_give_the_same_lr_at_every_step(your_config_run):
    """WarmupDecayLR in the engine; gaeq's mirror of it in the torch cell."""
    _, _, trace = your_config_run
    ds, mine = trace("deepspeed-z2-w2-mb2-ga4"), trace("torch-w1-mb16-ga1")
    assert [r["lr"] for r in ds] == pytest.approx([r["lr"] for r in mine], abs=1e-12, rel=0)
    assert mine[0]["lr"] == mine[1]["lr"] == 0.0 and max(r["lr"] for r in mine) == 3e-3


def test_only_a_mirror_of_the_default_clipping_matches(your_config_run):
    """The clipped variant's gradients are above DeepSpeed's default threshold at every step: the
    default clips them, and only a mirror that clips too can match (its control does not)."""
    _, cells, trace = your_config_run
    assert min(r["grad_norm"] for r in trace("torch-w1-mb16-ga1@clipped")) > 1.0
    control = cells["torch-w1-mb4-ga4-bug_unmirrored_default_clipping@clipped"]
    assert control["max_abs_loss_diff"] > 1e-3 and control["first_divergent_step"] <= 3


@pytest.mark.parametrize("cell_id", ["torch-w1-mb2-ga8@llama", "deepspeed-z3-w2-mb2-ga4@llama"])
def test_a_transformers_llama_with_its_own_loss_matches(your_config_run, cell_id):
    """Its own loss given the global batch's token count: ZeRO-3 at world 2 and GA 8 match (measured
    4.5e-7); the model that trained is the one named, without dropout."""
    _, cells, _ = your_config_run
    assert cells[cell_id]["max_abs_loss_diff"] <= 1e-5, cells[cell_id]["max_abs_loss_diff"]
    assert (cells[cell_id]["ran"]["model"], cells[cell_id]["ran"]["dropout"]) == ("LlamaForCausalLM", {}), cells[
        cell_id
    ]["ran"]


def test_the_per_micro_batch_token_count_is_caught_at_step_0(your_config_run):
    """transformers before its fix: GA × the gradient at once (rel 6.8)."""
    _, cells, _ = your_config_run
    bug = cells["torch-w1-mb2-ga8-bug_hf_num_items_per_micro_batch@llama"]
    assert (bug["caught_by"], bug["first_divergent_step"]) == ("grad_norm", 0) and bug["max_rel_grad_norm_diff"] > 1, (
        bug
    )


def test_gpt2s_default_dropout_diverges_with_a_reason_that_names_it(your_config_run):
    _, cells, _ = your_config_run
    dropout = cells["torch-w1-mb4-ga4@gpt2_dropout"]
    assert dropout["first_divergent_step"] == 0
    assert "the model's config has dropout (attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1)" in dropout["reason"], (
        dropout["reason"]
    )


def test_dropout_from_the_global_rng_sets_no_floor_and_the_report_says_why(your_config_run):
    """The gpt2_dropout group's twins reorder their rows: the global RNG's masks land on other samples, a
    change no rounding makes — their drift is rejected, and the group is judged by the constants alone."""
    proc, cells, _ = your_config_run
    twins = [c for i, c in cells.items() if c["role"] == "floor" and i.endswith("@gpt2_dropout")]
    assert len(twins) == 2 and all(c["max_abs_loss_diff"] > 1e-3 for c in twins), twins
    assert "Noise floor fp32@gpt2_dropout: none — its twins" in proc.stdout and "judged by the constants" in proc.stdout


def test_a_teams_config_run_says_what_it_trains_with_and_what_it_did_not_test(tmp_path):
    """experiments/your_team_config.yaml (#75) at world 1 and 2: before it starts, the run says the lr its
    WarmupDecayLR trains at (up to 1e-3, not the optimizer's 3e-4; steps 0 and 1 at lr 0) and its bf16 reduction,
    and what it overrides — the splits' values apart from the reference's; after, what it did not test: a clip
    (1.0) that never acted, the steps its reference trained at lr 0. (torch_adam, as above: no FusedAdam build.)"""
    spec = yaml.safe_load((REPO_ROOT / "experiments" / "your_team_config.yaml").read_text())
    config = json.loads((REPO_ROOT / "experiments" / "ds_config_team.json").read_text())
    config["optimizer"]["params"]["torch_adam"] = True
    spec["problem"] |= {"deepspeed_config": config, "steps": 6}
    spec["axes"] |= {"world_size": [2], "micro_batch_size": [4]}
    (tmp_path / "team.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "team.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    out = proc.stdout.replace("\n", " ")
    assert (
        "trains with: scheduler = WarmupDecayLR: risk — your lr 0.0003 is not used: WarmupDecayLR's warmup_max_lr"
        in out
    )
    assert "trains with: communication_data_type = absent → bf16 (bf16 is enabled): risk" in out
    assert "overridden: train_micro_batch_size_per_gpu: the file's 4 → 32 in the reference" in out
    assert "Clipping ds_bf16: gradient_clipping 1 never acted — grad norms" in out
    assert "Schedule ds_bf16: the reference trains at lr 0 at steps 0, 1: no weight moves there" in out
    split = next(c for c in report["cells"] if c["id"] == "deepspeed-z2-w2-mb4-ga4-ds_bf16")
    assert split["verdict"] == "match" and split["ran"]["communication_dtype"] == "bfloat16", split["ran"]
