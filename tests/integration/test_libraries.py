"""experiments/libraries.yaml: the libraries people train with against plain full-batch training.
accelerate's own loop and the transformers Trainer match at world 1 and 2, GA 1–6, on the GPT and on
a transformers Llama with its own loss; each library trap is caught where the note says, and the
report names the library versions it certifies."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import yaml

from gaeq.matrix.load import matrix_from_dict
from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok

pytestmark = pytest.mark.integration


# The experiment's library cells at GA 6, 3 and 1, both problems, and all its traps (the whole file
# runs in docs/concepts.md; here its corners, to keep the suite's time).
CELLS = [
    {"trainer": trainer, "world_size": world, "micro_batch_size": micro, "variant": variant}
    for trainer in ("accelerate", "hf")
    for world, micro, variant in ((1, 4, "base"), (2, 4, "base"), (2, 12, "base"), (2, 4, "llama"))
]


STEPS = 8
"""The experiment's 20 steps cut to 8 (past its 3 warm-up steps): each trap shows by then."""


def test_libraries_experiment(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "libraries.yaml").read_text())
    spec.pop("axes")
    spec["problem"]["steps"] = STEPS
    spec["cells"] = CELLS + spec["cells"]  # its traps and its hf_deepspeed cells included
    matrix, out = tmp_path / "libraries.yaml", tmp_path / "run"
    matrix.write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(matrix, out)
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    twins = [c for c in cells.values() if c["bug"] is None and c["expect"] == "match"]
    assert len(twins) == sum(c.bug is None and c.expect == "match" for c in matrix_from_dict(spec).cells)
    assert all(c["verdict"] == "match" for c in twins)
    for trainer in ("accelerate", "hf"):
        mine = [c for c in twins if c["trainer"] == trainer]
        assert {(c["world_size"], c["grad_accum_steps"]) for c in mine} == {(1, 6), (2, 3), (2, 1)}
        assert max(c["max_abs_loss_diff"] for c in mine) < 1e-5  # float rounding only
        assert cells[f"{trainer}-w2-mb4-ga3@llama"]["ran"]["model"] == "LlamaForCausalLM"
    for c in twins:
        ran = c["ran"]
        if c["trainer"] == "accelerate":  # its GA, DDP, its scheduler stepped by us once per step
            assert (ran["grad_accum_steps"], ran["ddp"], ran["scheduler_steps_with_optimizer"]) == (
                c["grad_accum_steps"],
                True,
                False,
            ), ran
        if c["trainer"] in (
            "hf",
            "hf_deepspeed",
        ):  # the Trainer's GA, num_items_in_batch to the model, tokens over ranks
            assert (
                ran["grad_accum_steps"],
                ran["model_accepts_loss_kwargs"],
                ran["average_tokens_across_devices"],
            ) == (c["grad_accum_steps"], c["variant"] != "token_classifier_fixed", True), ran
        if c["trainer"] == "hf_deepspeed":  # DeepSpeed's engine really ran, at the cell's stage
            assert (ran["engine"], ran["zero_stage"], c["max_abs_loss_diff"] < 1e-5) == (
                "DeepSpeedEngine",
                c["zero_stage"],
                True,
            ), c
    assert {c["zero_stage"] for c in twins if c["trainer"] == "hf_deepspeed"} == {1, 2, 3}
    # One intra-op thread in every cell, as gaeq set it: accelerate sets torch's threads to physical
    # cores ÷ local ranks unless OMP_NUM_THREADS says otherwise (2 on a world-1 lane's single core).
    assert {c["ran"]["intra_op_threads"] for c in cells.values()} == {1}

    def caught(cell_id):
        c = cells[cell_id]
        return c["verdict"], c["divergence_steps"]

    # accelerate's default scheduler stepping: world × too fast — the lr itself differs from step 1.
    verdict, steps = caught("accelerate-w2-mb4-ga3-bug_accelerate_scheduler_per_process")
    assert verdict == "diverge" and steps["lr"] == 1
    # ÷ GA by hand and again in accelerator.backward; the Trainer letting DeepSpeed ÷ GA again
    # (accelerate#3533): GA = 6 times too small a gradient.
    for cell_id in (
        "accelerate-w1-mb4-ga6-bug_accelerate_loss_divided_twice",
        "hf_deepspeed-z1-w1-mb4-ga6-bug_hf_deepspeed_loss_divided_twice",
    ):
        c = cells[cell_id]
        assert (c["caught_by"], c["first_divergent_step"]) == ("grad_norm", 0), c
        assert c["max_rel_grad_norm_diff"] == pytest.approx(5 / 6, rel=1e-3)
    for cell_id in (
        "accelerate-w2-mb4-ga3-bug_mean_of_means",
        "accelerate-w2-mb4-ga3-bug_hf_num_items_per_micro_batch@llama",
        "hf-w1-mb4-ga6-bug_hf_loss_per_micro_batch",  # the Trainer before num_items_in_batch: mean of micro means
        "hf-w2-mb4-ga3-bug_hf_loss_per_micro_batch@llama",
        "hf-w2-mb4-ga3-bug_hf_tokens_per_device",  # each rank's own token count
        "hf_deepspeed-z2-w2-mb4-ga3-bug_hf_tokens_per_device",
    ):
        c = cells[cell_id]
        assert (c["verdict"], c["caught_by"], c["first_divergent_step"]) == ("diverge", "grad_norm", 0), c

    # The pinned transformers itself: a model whose forward takes **kwargs but returns a mean (Llama's
    # token-classification head) — the Trainer skips its ÷ GA (and × processes): the grad norm GA × 2 at
    # world 2 (rel 5.0), GA at world 1; the model saying accepts_loss_kwargs = False matches.
    for cell_id, factor in (("hf-w1-mb4-ga6@token_classifier", 6), ("hf-w2-mb4-ga3@token_classifier", 6)):
        c = cells[cell_id]
        assert (c["verdict"], c["caught_by"], c["first_divergent_step"]) == ("diverge", "grad_norm", 0), c
        assert c["ran"]["model_accepts_loss_kwargs"] is True  # what the Trainer guessed from **kwargs
        assert abs(c["max_rel_grad_norm_diff"] - (factor - 1)) < 1e-2  # 5.000 at step 0, 5.002 later
    fixed = cells["hf-w2-mb4-ga3@token_classifier_fixed"]
    assert fixed["verdict"] == "match" and fixed["ran"]["model_accepts_loss_kwargs"] is False
    # each weighting mistake named from its split's own targets' weights (#68), every correct split a mean
    shapes = {i: c["weights"]["shape"] for i, c in cells.items() if c["role"] == "cell"}
    assert {i: s for i, s in shapes.items() if s != "mean"} == {
        "accelerate-w1-mb4-ga6-bug_accelerate_loss_divided_twice": "scaled",
        "hf_deepspeed-z1-w1-mb4-ga6-bug_hf_deepspeed_loss_divided_twice": "scaled",
        "accelerate-w2-mb4-ga3-bug_mean_of_means": "micro_batch_means",
        "accelerate-w2-mb4-ga3-bug_hf_num_items_per_micro_batch@llama": "micro_batch_means",
        "hf-w1-mb4-ga6-bug_hf_loss_per_micro_batch": "micro_batch_means",
        "hf-w2-mb4-ga3-bug_hf_loss_per_micro_batch@llama": "micro_batch_means",
        "hf-w2-mb4-ga3-bug_hf_tokens_per_device": "rank_means",
        "hf_deepspeed-z2-w2-mb4-ga3-bug_hf_tokens_per_device": "rank_means",
        "hf-w1-mb4-ga6@token_classifier": "scaled",
        "hf-w2-mb4-ga3@token_classifier": "scaled",
    }
    assert "× GA × world (6)" in cells["hf-w2-mb4-ga3@token_classifier"]["weights"]["line"]
    assert "÷ GA (6) twice" in cells["accelerate-w1-mb4-ga6-bug_accelerate_loss_divided_twice"]["weights"]["line"]

    versions = json.loads((out / "versions.json").read_text())
    assert versions["accelerate"] == metadata.version("accelerate") and versions["transformers"] == metadata.version(
        "transformers"
    )
    assert report["versions"] == versions
    assert f"accelerate {versions['accelerate']}" in (out / "report.md").read_text()
    assert f"Versions: torch {versions['torch']}" in proc.stdout
