"""experiments/muon.yaml through real process groups and DeepSpeed's engine at ZeRO 0–3: the pinned
DeepSpeed orthogonalises each matrix once a step at every stage (DeepSpeed#8441 and #8443 measured absent)
and its ZeRO-0 matches; at ZeRO ≥ 1 it reports — and with clipping on, clips by — the orthogonalised
update's norm (DeepSpeed#8439): the grad norm alone diverges unclipped, the loss too when clipped. The
whole file (22 cells) runs in docs/muon.md; here its world-2 corner on fewer steps. The world-1 controls
run in process: tests/unit/test_muon.py."""

from __future__ import annotations

import pytest

from gaeq.accelerator import FP16_ENV
from gaeq.matrix import load_matrix
from gaeq.trainers.muon import ONCE
from tests.helpers import REPO_ROOT, experiment_corner
from tests.processes import leftovers

pytestmark = pytest.mark.integration

NORM_ONLY = {"verdict": "diverge", "caught_by": "grad_norm", "step": 0, "holds": ["loss"]}
"""muon.yaml's unclipped ZeRO ≥ 1 cells: DeepSpeed#8439's norm, caught at step 0, the loss holding at every step."""
NORM_FIRST = {"verdict": "diverge", "caught_by": "grad_norm", "step": 0}
"""muon.yaml's clipped ZeRO ≥ 1 cells: the norm at step 0, the loss after it."""
CELLS = [
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 0},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 1, "expect": NORM_ONLY},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 1, "zero_stage": 3, "expect": NORM_ONLY},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 2, "variant": "clipped",
     "expect": NORM_FIRST},
]  # fmt: skip


@pytest.mark.parametrize("fp16", ["yes", "no"])
def test_deepspeeds_muon_orthogonalises_once_a_step_and_at_zero_1_to_3_measures_the_update(tmp_path, monkeypatch, fp16):
    """On either kind of CPU: DeepSpeed's Newton–Schulz runs in fp16 where the accelerator answers yes to
    fp16 (Intel with AMX/avx512_fp16), in fp32 where no — both forced here, whatever this CPU answers; the
    twins measure each one's rounding."""
    monkeypatch.setenv(FP16_ENV, fp16)
    cells, tag = experiment_corner("muon", CELLS, steps=4, tmp_path=tmp_path, noise_floor=True)  # exit 0: as expected
    said = {c.id: c.expectation for c in load_matrix(REPO_ROOT / "experiments" / "muon.yaml").cells}  # the same
    for cell in cells.values():  # never skipped (#8441), never per micro-batch (#8443), at any stage
        assert cell["ran"]["newton_schulz"] == ONCE, cell
        assert cell["ran"]["accelerator_fp16"].startswith(f"{fp16} (forced by {FP16_ENV}"), cell["ran"]
        assert cell["ran"]["newton_schulz_dtype"] == ("float16" if fp16 == "yes" else "float32")
    assert cells["deepspeed-z0-w2-mb2-ga4"]["verdict"] == "match"
    for cell_id in ("deepspeed-z1-w2-mb2-ga4", "deepspeed-z3-w2-mb1-ga8"):
        cell = cells[cell_id]  # the same optimisation, another norm: 29× the gradient's, at step 0
        assert (cell["caught_by"], cell["first_divergent_step"], cell["divergence_steps"]["loss"]) == (
            "grad_norm",
            0,
            None,
        ), cell
        assert cell["max_rel_grad_norm_diff"] > 10 and "DeepSpeed#8439" in cell["reason"]
        assert cell["expect_detail"] == said[cell_id].detail == {"caught_by": "grad_norm", "step": 0, "holds": ["loss"]}
    clipped = cells["deepspeed-z2-w2-mb2-ga4@clipped"]  # clipped by the update's norm: the loss leaves too
    assert clipped["divergence_steps"]["loss"] == 1 and clipped["max_abs_loss_diff"] > 1e-2, clipped
    assert (
        clipped["expect_detail"]
        == said["deepspeed-z3-w2-mb2-ga4@clipped"].detail
        == {"caught_by": "grad_norm", "step": 0, "holds": []}
    )
    assert leftovers(tag) == []
