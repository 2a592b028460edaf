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

from tests.helpers import REPO_ROOT, gaeq_run_here

pytestmark = pytest.mark.integration

CELLS = [
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2},  # the file's own stage: ZeRO-2
    {"trainer": "deepspeed", "world_size": 1, "micro_batch_size": 2, "zero_stage": 3},
    {"trainer": "torch", "world_size": 2, "micro_batch_size": 2, "variant": "clipped"},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 4, "zero_stage": 1, "variant": "clipped"},
    {"trainer": "torch", "micro_batch_size": 4, "variant": "clipped", "bug": "unmirrored_default_clipping"},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 2, "variant": "comm_bf16", "expect": "diverge"},
    {"trainer": "torch", "micro_batch_size": 2, "variant": "llama"},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 3, "variant": "llama"},
    {"trainer": "torch", "micro_batch_size": 2, "variant": "llama", "bug": "hf_num_items_per_micro_batch"},
    {"trainer": "torch", "micro_batch_size": 4, "variant": "gpt2_dropout", "expect": "diverge"},
]


def test_your_config_runs_as_written_and_matches_the_torch_mirror(tmp_path):
    spec = yaml.safe_load((REPO_ROOT / "experiments" / "your_config.yaml").read_text())
    config = json.loads((REPO_ROOT / "experiments" / "ds_config.json").read_text())
    # torch_adam: DeepSpeed builds torch's AdamW instead of FusedAdam, whose JIT build (~60 s once on a
    # fresh machine) the suite cannot afford; `gaeq run --matrix experiments/your_config.yaml` runs
    # FusedAdam (README: Check your own setup), and test_deepspeed_config.py checks its mirrored defaults.
    config["optimizer"]["params"]["torch_adam"] = True
    spec["problem"]["deepspeed_config"] = config
    spec.pop("axes")
    spec["cells"] = CELLS
    spec["variants"] = {k: v for k, v in spec["variants"].items() if k in ("clipped", "comm_bf16", "llama", "gpt2_dropout")}
    matrix = tmp_path / "your_config.yaml"
    matrix.write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(matrix, tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "overridden: train_batch_size: the file's 64 → 16 per cell" in proc.stdout

    cells = {c["id"]: c for c in report["cells"]}
    verdicts = {i: c["verdict"] for i, c in cells.items()}
    assert verdicts == {
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
    }, verdicts
    for i in ("deepspeed-z2-w2-mb2-ga4", "deepspeed-z3-w1-mb2-ga8", "deepspeed-z1-w2-mb4-ga2@clipped"):
        assert cells[i]["max_abs_loss_diff"] <= 1e-5, (i, cells[i]["max_abs_loss_diff"])  # measured ≤ 2.9e-6
        ran = cells[i]["ran"]  # the file ran: its optimizer, DeepSpeed's default clipping
        assert (ran["update_rule"], ran["gradient_clipping"]) == ("AdamW", 1.0), ran
    assert cells["torch-w1-mb16-ga1"]["ran"]["update_rule"] == "AdamW"

    def trace(cell_id):
        return [json.loads(line) for line in (tmp_path / "run" / "cells" / cell_id / "trace.jsonl").read_text().splitlines()]

    # DeepSpeed's own WarmupDecayLR (in the engine) and the torch mirror: the same lr at every step.
    ds, mine = trace("deepspeed-z2-w2-mb2-ga4"), trace("torch-w1-mb16-ga1")
    assert [r["lr"] for r in ds] == pytest.approx([r["lr"] for r in mine], abs=1e-12, rel=0)
    assert mine[0]["lr"] == mine[1]["lr"] == 0.0 and max(r["lr"] for r in mine) == 3e-3
    # The clipped variant's gradients are above DeepSpeed's default threshold at every step: the
    # default clips them, and only a mirror that clips too can match.
    assert min(r["grad_norm"] for r in trace("torch-w1-mb16-ga1@clipped")) > 1.0
    control = cells["torch-w1-mb4-ga4-bug_unmirrored_default_clipping@clipped"]
    assert control["max_abs_loss_diff"] > 1e-3 and control["first_divergent_step"] <= 3

    # A transformers Llama, its own loss given the global batch's token count: ZeRO-3 at world 2 and
    # GA 8 match (measured 4.5e-7); the model that trained is the one named, without dropout.
    for i in ("torch-w1-mb2-ga8@llama", "deepspeed-z3-w2-mb2-ga4@llama"):
        assert cells[i]["max_abs_loss_diff"] <= 1e-5, (i, cells[i]["max_abs_loss_diff"])
        assert (cells[i]["ran"]["model"], cells[i]["ran"]["dropout"]) == ("LlamaForCausalLM", {}), cells[i]["ran"]
    # The per-micro-batch count (transformers before its fix): GA × the gradient at once (rel 6.8).
    bug = cells["torch-w1-mb2-ga8-bug_hf_num_items_per_micro_batch@llama"]
    assert (bug["caught_by"], bug["first_divergent_step"]) == ("grad_norm", 0) and bug["max_rel_grad_norm_diff"] > 1, bug
    # GPT-2 with its config's default dropout: caught at step 0, and the reason names the knobs.
    dropout = cells["torch-w1-mb4-ga4@gpt2_dropout"]
    assert dropout["first_divergent_step"] == 0
    assert "the model's config has dropout (attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1)" in dropout["reason"], dropout["reason"]
