"""experiments/rl.yaml through real process groups and DeepSpeed: the policy-gradient loss normalised
by the global batch's completion tokens — counted over every rank — matches at world 2 in torch and
DeepSpeed; each rank's own count (TRL#3231) and ÷ GA twice (ms-swift#10117) under DeepSpeed diverge.
The whole file (16 cells, world 1–4, GA 1–16) runs in docs/rl.md; here its world-2 corner on fewer
steps. The world-1 controls run in process: tests/unit/test_policy_gradient.py."""

from __future__ import annotations

import pytest
import yaml

from gaeq.problem.completions import CompletionData
from gaeq.problem.data import BatchPlan
from gaeq.problem.spec import ProblemSpec
from tests.conftest import REPO
from tests.helpers import experiment_corner
from tests.processes import leftovers

pytestmark = pytest.mark.integration

CELLS = [
    {"trainer": "torch", "world_size": 2, "micro_batch_size": 2},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 1},
    {"trainer": "torch", "world_size": 2, "micro_batch_size": 4, "bug": "pg_tokens_per_rank"},
    {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": 2, "bug": "pg_divided_by_ga_twice"},
]


def test_the_policy_loss_over_the_global_batchs_tokens_matches_at_world_2_and_per_rank_counts_do_not(tmp_path):
    cells, tag = experiment_corner("rl", CELLS, steps=3, tmp_path=tmp_path)
    for cell_id in ("torch-w2-mb2-ga4", "deepspeed-z1-w2-mb2-ga4"):
        assert cells[cell_id]["verdict"] == "match" and cells[cell_id]["max_abs_loss_diff"] < 1e-6, cells[cell_id]
    # Each rank's own count: the ranks hold different token counts at step 0, and the gradient shows it first.
    problem = ProblemSpec.model_validate(yaml.safe_load((REPO / "experiments" / "rl.yaml").read_text())["problem"])
    data = CompletionData(problem.data, seed=problem.seed)
    plan = BatchPlan(train_batch_size=16, micro_batch_size=4, data_parallel=2)
    per_rank = [
        data.total_loss_elements([i for k in range(2) for i in plan.sample_indices(step=0, micro_step=k, rank=r)])
        for r in range(2)
    ]
    assert per_rank[0] != per_rank[1]  # else the control could not fail
    per_rank_bug = cells["torch-w2-mb4-ga2-bug_pg_tokens_per_rank"]
    assert (per_rank_bug["verdict"], per_rank_bug["first_divergent_step"]) == ("diverge", 0)
    assert per_rank_bug["caught_by"] == "grad_norm"
    twice = cells["deepspeed-z2-w2-mb2-ga4-bug_pg_divided_by_ga_twice"]  # DeepSpeed's engine ÷ GA, and the loss did
    assert (twice["verdict"], twice["first_divergent_step"]) == ("diverge", 0)
    assert twice["max_rel_grad_norm_diff"] == pytest.approx(0.75, abs=1e-5)  # GA 4: a quarter of the gradient
    assert leftovers(tag) == []
