"""A policy-gradient loss (GRPO / DAPO's token-level mean, gaeq/problem/completions.py and loss.py), in
this process at world 1: the data a sample's advantage comes from, the objective, its normaliser over
the global batch's completion tokens matching at every split, and the reported normalisers — each a
control that must diverge, by the factor its mistake predicts. Process groups and DeepSpeed:
tests/integration/test_rl.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gaeq.bugs import GENERATION_STEPS
from gaeq.matrix import MatrixError, load_matrix, matrix_from_dict
from gaeq.problem.completions import ADVANTAGE, LABEL, CompletionData
from gaeq.problem.data import IGNORE_INDEX
from gaeq.problem.loss import cross_entropy_sum, policy_gradient_sum
from gaeq.problem.spec import ProblemSpec, TokensSpec
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore
from tests.helpers import run_in_process, small_spec

COMPLETIONS = {"prompt_len": 4, "group_size": 4}
DATA = {"kind": "tokens", "vocab_size": 16, "seq_len": 12, "min_len": 6, "completions": COMPLETIONS}


def rl_spec(**more) -> dict:
    spec = small_spec(**more)
    spec["problem"].update(
        model={"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16}, data=DATA, loss="policy_gradient", steps=3
    )
    spec["problem"]["train_batch_size"] = 16
    return spec


def test_a_samples_targets_are_its_completion_and_its_groups_advantage_whatever_the_batch():
    data = CompletionData(TokensSpec(**DATA), seed=3)
    inputs, targets = data.batch(list(range(8)))
    labels, advantages = targets[..., LABEL], targets[..., ADVANTAGE]
    lengths = data.lengths(range(8))
    for row, n in enumerate(lengths):  # the prompt's 4 tokens predict nothing; the completion's n − 4 do
        assert (labels[row, :3] == IGNORE_INDEX).all() and (labels[row, 3 : n - 1] != IGNORE_INDEX).all()
        assert (labels[row, n - 1 :] == IGNORE_INDEX).all() and (advantages[row] == advantages[row, 0]).all()
    assert int((labels != IGNORE_INDEX).sum()) == data.total_loss_elements(range(8)) == int((lengths - 4).sum())
    assert (inputs[0, :4] == inputs[3, :4]).all() and not (inputs[3, :4] == inputs[4, :4]).all()  # a group's prompt
    per_group = advantages[:, 0].view(2, 4)  # GRPO: each group's rewards normalised, so mean 0 and std ~1
    assert per_group.mean(dim=1).abs().max() < 1e-12 and (per_group.std(dim=1) - 1).abs().max() < 1e-3
    # a sample's advantage is its group's, wherever it is fetched: alone, or with other groups
    alone = [data.batch([i])[1][0, 0, ADVANTAGE].item() for i in (5, 1, 6)]
    assert alone == pytest.approx(data.batch([5, 1, 6])[1][:, 0, ADVANTAGE].tolist(), abs=0)
    assert alone == pytest.approx(advantages[[5, 1, 6], 0].tolist(), abs=0)


def test_the_objective_is_minus_advantage_times_log_probability_over_completion_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    labels = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX, 3], [IGNORE_INDEX] * 4 + [6], [0, 1, 2, 3, 4]])
    advantages = torch.tensor([0.5, -2.0, 1.5], dtype=torch.float64)
    targets = torch.stack([labels.double(), advantages[:, None].expand(3, 5)], dim=-1)
    log_p = F.log_softmax(logits, dim=-1)
    expected = sum(
        -advantages[r].item() * log_p[r, t, labels[r, t]].item()
        for r in range(3)
        for t in range(5)
        if labels[r, t] >= 0
    )
    assert policy_gradient_sum(logits, targets).item() == pytest.approx(expected, rel=1e-6)
    ones = torch.stack([labels.double(), torch.ones(3, 5, dtype=torch.float64)], dim=-1)  # advantage 1: the NLL
    assert policy_gradient_sum(logits, ones).item() == pytest.approx(cross_entropy_sum(logits, labels).item(), rel=1e-6)


def test_the_global_token_mean_matches_every_split_and_each_reported_normaliser_diverges_by_its_factor(
    write_matrix, tmp_path
):
    """GA 8 and GA 4 match the baseline; ÷ GA twice is GA× too weak (its step-0 grad norm × 1/4 exactly);
    the generation batch's tokens scale step 0 by its share of them; a micro-batch's own mean
    (mean_of_means: open-instruct#1137, verl#6957) weighs its tokens by its count."""
    cells = [
        {"trainer": "torch", "micro_batch_size": 4, "bug": "pg_divided_by_ga_twice"},
        {"trainer": "torch", "micro_batch_size": 16, "bug": "pg_normalised_over_generation"},
        {"trainer": "torch", "micro_batch_size": 2, "bug": "mean_of_means"},
    ]
    axes = {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [2, 4]}
    matrix = load_matrix(write_matrix(rl_spec(axes=axes, cells=cells)))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    cells = {c.id: c for c in report.cells}
    for cell_id in ("torch-w1-mb2-ga8", "torch-w1-mb4-ga4"):
        assert cells[cell_id].verdict == "match" and cells[cell_id].max_abs_loss_diff < 1e-6, cells[cell_id].reason
    store = TraceStore(tmp_path)
    norm = lambda cell_id: store.get(cell_id)[0].grad_norm  # noqa: E731 — the step-0 grad norm
    base = norm("torch-w1-mb16-ga1")
    assert norm("torch-w1-mb4-ga4-bug_pg_divided_by_ga_twice") == pytest.approx(base / 4, rel=1e-5)
    data = CompletionData(TokensSpec(**DATA), seed=matrix.problem.seed)
    tokens = [data.total_loss_elements(range(s * 16, (s + 1) * 16)) for s in range(GENERATION_STEPS)]
    share = tokens[0] / sum(tokens)
    assert norm("torch-w1-mb16-ga1-bug_pg_normalised_over_generation") == pytest.approx(base * share, rel=1e-5)
    for cell_id in cells:
        if "bug" in cell_id:
            assert (cells[cell_id].verdict, cells[cell_id].first_divergent_step) == ("diverge", 0), cell_id


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss": "cross_entropy"}, "needs data.completions"),
        ({"data": DATA | {"completions": None}}, "it needs data.completions"),
        ({"data": DATA | {"packed": True}}, "not packed data"),
        ({"data": DATA | {"min_len": 4}}, "min_len ≥ prompt_len \\+ 1 = 5"),
    ],
)
def test_a_policy_gradient_problem_that_cannot_be_is_bad_input(change, message):
    problem = rl_spec()["problem"] | change
    with pytest.raises(ValueError, match=message):
        ProblemSpec.model_validate(problem)


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ({"micro_batch_size": 16, "bug": "pg_divided_by_ga_twice"}, "needs GA ≥ 2: at GA 1 it is no mistake"),
        ({"micro_batch_size": 4, "bug": "pg_tokens_per_rank"}, "needs world_size ≥ 2"),
        ({"trainer": "hf", "micro_batch_size": 4}, "not a policy gradient's"),
    ],
)
def test_a_control_that_could_not_fail_or_a_trainer_that_cannot_count_is_refused(cell, message):
    spec = rl_spec(axes=None, cells=[{"trainer": "torch"} | cell])
    with pytest.raises(MatrixError, match=message):
        matrix_from_dict(spec)


def test_a_policy_gradient_bug_needs_the_policy_gradient_loss():
    spec = small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "pg_normalised_over_generation"}])
    with pytest.raises(MatrixError, match="exists only with loss policy_gradient"):
        matrix_from_dict(spec)


def test_rewards_are_a_function_of_the_completion_alone():
    data = CompletionData(TokensSpec(**DATA), seed=0)
    walks, _ = data.rows(range(4))
    lengths = data.lengths(range(4))
    expected = [np.mean(walks[r, 4 : lengths[r]] < 8) for r in range(4)]
    assert data.rewards(range(4)) == pytest.approx(expected, abs=0)
