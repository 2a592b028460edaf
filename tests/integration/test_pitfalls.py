"""The pitfall catalogue in CI: every planted bug is caught, every twin matches."""

from __future__ import annotations

import pytest

from gaeq.matrix import load_matrix
from gaeq.results.trace import read_trace
from tests.conftest import REPO
from tests.helpers import cells_by_id

pytestmark = pytest.mark.integration


def test_every_planted_bug_is_caught_and_every_twin_matches(pitfalls_run):
    """The catalogue as notebook 4 trains it (tests/conftest.py: pitfalls_run): the file's cells, as they are."""
    report, out = pitfalls_run
    assert report["ok"] is True
    ids = {c.id for c in load_matrix(REPO / "experiments" / "pitfalls.yaml").cells}
    assert {c["id"] for c in report["cells"]} == ids
    cells = cells_by_id(report)
    steps = {cell_id: c["divergence_steps"] for cell_id, c in cells.items()}

    def caught(cell_id: str, **expected: int) -> None:
        assert cells[cell_id]["verdict"] == "diverge", cells[cell_id]
        for metric, step in expected.items():
            assert steps[cell_id][metric] == step, (cell_id, steps[cell_id])

    # missing ÷ GA: SGD's loss shows it after the first update; AdamW's grad norm at once.
    caught("torch-w1-mb4-ga8-bug_no_loss_division@sgd", loss=1, grad_norm=0)
    caught("torch-w1-mb4-ga8-bug_no_loss_division", grad_norm=0)
    caught("torch-w2-mb4-ga4-bug_clip_every_micro_step@tight_clip", grad_norm=0)
    caught("torch-w2-mb2-ga8-bug_scheduler_every_micro_step", lr=1, loss=1)
    caught("torch-w1-mb4-ga8-bug_mean_of_means@gpt", grad_norm=0)
    caught("deepspeed-z2-w2-mb4-ga4-bug_mean_of_means@gpt", grad_norm=0)
    # ÷ world twice (verl#5366): the pre-clip norm halves at step 0; the loss never leaves its tolerance
    caught("torch-w2-mb4-ga4-bug_tokens_all_reduced_then_ddp_averaged@gpt", grad_norm=0, loss=None)
    # empty micro-batches counted (NeMo-RL#212): a quarter of them empty, the norm a quarter short, the loss unmoved
    caught("torch-w1-mb1-ga32-bug_empty_micro_batch_counted@masked", grad_norm=0, loss=None)
    # packs weighted equally (ms-swift#10144): wrong at any split, the step-0 loss off by 3e-4 of itself only
    caught("torch-w1-mb4-ga8-bug_packed_sequences_weighted_per_pack@packed", grad_norm=0, loss=0)
    # the epoch's short last window still ÷ GA (Lightning#19987): at the first epoch's end (step 3), its norm × 3/4
    caught("torch-w2-mb4-ga4-bug_partial_last_window@epochs", grad_norm=3, loss=4)
    caught("deepspeed-z2-w2-mb4-ga4-bug_partial_last_window@epochs", grad_norm=3, loss=4)
    short, twin = (
        [r.grad_norm for r in read_trace(out / "cells" / f"torch-w2-mb4-ga4{bug}@epochs")]
        for bug in ("-bug_partial_last_window", "")
    )
    assert short[:3] == pytest.approx(twin[:3], rel=1e-6) and short[3] / twin[3] == pytest.approx(3 / 4, rel=1e-6)
    for twin in ("torch-w2-mb4-ga4@epochs", "deepspeed-z2-w2-mb4-ga4@epochs"):
        assert cells[twin]["ran"]["short_step_micro_steps"] == 3  # measured, as its label says
    # … and the reason says what that step held (from the trace's sample counts)
    assert "step 3 held 24 samples, not 32" in cells["torch-w2-mb4-ga4-bug_partial_last_window@epochs"]["reason"]
    caught("torch-w1-mb8-ga4@batchnorm", loss=0)
    caught("deepspeed-z1-w2-mb4-ga4@batchnorm", loss=0)
    caught("torch-w1-mb8-ga4@dropout_global", loss=0)
    assert cells["deepspeed-z0-w1-mb4-ga8-bug_deepspeed_default_clipping@unclipped"]["caught_by"] == "loss"
    caught("deepspeed-z0-w1-mb4-ga8-bug_deepspeed_default_clipping@unclipped")
    # the pinned DeepSpeed itself (open-instruct#1498): GA 1 in the config, GA backwards per step by hand —
    # at ZeRO-1/2 only the last micro-batch reaches the step, a quarter of the gradient at GA 4
    for stage in (1, 2):
        caught(f"deepspeed-z{stage}-acc_manual-w2-mb4-ga4", grad_norm=0)
        assert cells[f"deepspeed-z{stage}-acc_manual-w2-mb4-ga4"]["ran"]["grad_accum_steps"] == 1  # what it told
    # … with CPU offload (DeepSpeed#7981, #7967) the gradients are carried from step to step: the norm grows
    caught("deepspeed-z1-cpuoff-acc_manual-w2-mb4-ga4", grad_norm=0)
    carried = [r.grad_norm for r in read_trace(out / "cells" / "deepspeed-z1-cpuoff-acc_manual-w2-mb4-ga4")]
    assert all(later > earlier for earlier, later in zip(carried[:8], carried[1:8])), carried[:8]

    twins = [
        "torch-w1-mb4-ga8@sgd",
        "torch-w1-mb4-ga8",
        "torch-w2-mb4-ga4@tight_clip",
        "torch-w2-mb2-ga8",
        "torch-w1-mb4-ga8@gpt",
        "deepspeed-z2-w2-mb4-ga4@gpt",
        "torch-w2-mb4-ga4@gpt",
        "torch-w1-mb1-ga32@masked",
        "torch-w1-mb4-ga8@packed",
        "torch-w2-mb4-ga4@epochs",
        "deepspeed-z2-w2-mb4-ga4@epochs",
        "torch-w1-mb8-ga4@layernorm",
        "deepspeed-z1-w2-mb4-ga4@layernorm",
        "torch-w1-mb8-ga4@dropout_indexed",
        "deepspeed-z3-w2-mb4-ga4@dropout_indexed",
        "deepspeed-z0-w1-mb4-ga8@unclipped",
        "deepspeed-z1-w1-mb2-ga16-ds_bf16@bf16_accum",
        # DeepSpeed's remedies for the manual loop, and ZeRO-0, where re-averaging averages is harmless
        "deepspeed-z1-acc_manual_with_boundary-w2-mb4-ga4",
        "deepspeed-z1-acc_manual_unmanaged-w2-mb4-ga4",
        "deepspeed-z0-acc_manual-w2-mb4-ga4",
        "deepspeed-z1-cpuoff-acc_manual_with_boundary-w2-mb4-ga4",
    ]
    for cell_id in twins:
        assert cells[cell_id]["verdict"] == "match", cells[cell_id]
    # the weighting mistakes named from their split's own targets' weights (#68), every token-LM twin a mean
    shapes = {i: c["weights"]["shape"] for i, c in cells.items() if c.get("weights")}
    assert {i: shapes[i] for i in shapes if "bug_" in i and shapes[i] != "unread"} == {
        "torch-w1-mb4-ga8-bug_mean_of_means@gpt": "micro_batch_means",
        "deepspeed-z2-w2-mb4-ga4-bug_mean_of_means@gpt": "micro_batch_means",
        "torch-w2-mb4-ga4-bug_tokens_all_reduced_then_ddp_averaged@gpt": "scaled",  # sum 0.5
        "torch-w1-mb1-ga32-bug_empty_micro_batch_counted@masked": "scaled",  # sum 0.75
        "torch-w1-mb4-ga8-bug_packed_sequences_weighted_per_pack@packed": "sequence_means",
    }
    assert all(shapes[t] == "mean" for t in twins if "@gpt" in t or "@masked" in t or "@packed" in t)
    assert "sum to 0.75 at step 0" in cells["torch-w1-mb1-ga32-bug_empty_micro_batch_counted@masked"]["weights"]["line"]
    # bf16 accumulation over GA 16 stays inside the bf16 noise at this scale (see pitfalls.yaml).
    bf16 = cells["deepspeed-z1-w1-mb2-ga16-ds_bf16-bug_grad_accum_bf16@bf16_accum"]
    assert bf16["verdict"] == "match" and 1e-6 < bf16["max_abs_loss_diff"] < 1e-3
    assert "grad_norm@0 loss@1" in (out / "report.md").read_text()  # the caught column
