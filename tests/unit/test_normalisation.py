"""Token-normalised loss: every valid token of the global batch weighs the same, whatever the split."""

from __future__ import annotations

import itertools

import pytest
import torch

from gaeq.problem.data import IGNORE_INDEX, BatchPlan, TokenData
from gaeq.problem.loss import cross_entropy_sum, mean_of_means_count
from gaeq.problem.models import GPT, IndexedDropout, sample_keys
from gaeq.problem.spec import GPTSpec, TokensSpec

B = 16
DATA = TokenData(TokensSpec(vocab_size=16, seq_len=12, min_len=3), seed=11)


def splits():
    for micro, world in itertools.product([1, 2, 4, 8, 16], [1, 2, 4]):
        if B % (micro * world) == 0:
            yield micro, world


def token_weights(plan: BatchPlan, *, step: int, naive: bool) -> list[float]:
    """The weight each valid token of the step ends up with in the accumulated, rank-averaged gradient."""
    normaliser = sum(DATA.loss_elements(plan.sample_at(p)) for p in range(step * B, (step + 1) * B))
    weights = []
    for k, r in itertools.product(range(plan.grad_accum_steps), range(plan.data_parallel)):
        indices = plan.sample_indices(step=step, micro_step=k, rank=r)
        micro_elements = sum(DATA.loss_elements(i) for i in indices)
        num_items = normaliser
        if naive:
            num_items = mean_of_means_count(
                micro_elements=micro_elements, grad_accum_steps=plan.grad_accum_steps, data_parallel=plan.data_parallel
            )
        # The trainers backpropagate loss sum ÷ num_items × world; accumulation sums micro-steps
        # (weight × 1); data parallelism averages ranks (÷ world).
        weights += [plan.data_parallel / num_items / plan.data_parallel] * micro_elements
    return weights


@pytest.mark.parametrize("step", [0, 3])
def test_every_split_weighs_every_valid_token_equally(step):
    counts = {DATA.loss_elements(i) for i in range(step * B, (step + 1) * B)}
    assert len(counts) > 3  # the lengths really vary
    for micro, world in splits():
        plan = BatchPlan(train_batch_size=B, micro_batch_size=micro, data_parallel=world)
        weights = token_weights(plan, step=step, naive=False)
        assert sum(weights) == pytest.approx(1.0, abs=1e-12)
        assert max(weights) == pytest.approx(min(weights), rel=1e-12)


def test_control_mean_of_means_sums_to_one_but_weighs_tokens_unequally():
    skewed = 0
    for micro, world in splits():
        plan = BatchPlan(train_batch_size=B, micro_batch_size=micro, data_parallel=world)
        weights = token_weights(plan, step=0, naive=True)
        assert sum(weights) == pytest.approx(1.0, abs=1e-12)
        counts = {
            sum(DATA.loss_elements(i) for i in plan.sample_indices(step=0, micro_step=k, rank=r))
            for k, r in itertools.product(range(plan.grad_accum_steps), range(world))
        }
        # Equal weights exactly when every micro-batch holds as many tokens — never, here, once split.
        assert (max(weights) > min(weights) * (1 + 1e-9)) == (len(counts) > 1)
        skewed += len(counts) > 1
    assert skewed >= 10


def test_token_batches_pad_with_ignored_labels_and_count_valid_tokens():
    indices = list(range(8))
    inputs, labels = DATA.batch(indices)
    assert inputs.shape == labels.shape == (8, 12)
    for row, index in enumerate(indices):
        valid = int((labels[row] != IGNORE_INDEX).sum())
        assert valid == DATA.loss_elements(index) == DATA.length(index) - 1
        assert (labels[row, valid:] == IGNORE_INDEX).all()
        torch.testing.assert_close(inputs[row, 1:valid], labels[row, : valid - 1])  # labels are inputs shifted


def test_padding_never_changes_a_valid_position():
    torch.manual_seed(0)
    model = GPT(GPTSpec(), vocab_size=16, block_size=12, seed=0).eval()
    inputs, labels = DATA.batch([5])
    valid = int((labels != IGNORE_INDEX).sum())
    other = inputs.clone()
    other[0, valid:] = 7  # different padding tokens
    a, b = model(inputs), model(other)
    torch.testing.assert_close(a[0, :valid], b[0, :valid], rtol=0, atol=0)
    assert cross_entropy_sum(a, labels).item() == pytest.approx(cross_entropy_sum(b, labels).item(), abs=0)


def test_indexed_dropout_masks_follow_the_sample_not_the_batch():
    drop = IndexedDropout(0.5, seed=3, layer=1).train()
    x = torch.ones(4, 32)
    with sample_keys(range(100, 104)):
        together = drop(x)
    with sample_keys(range(102, 104)):
        apart = drop(x[:2])
    torch.testing.assert_close(together[2:], apart, rtol=0, atol=0)
    assert not torch.equal(together[0], together[1])  # different samples, different masks
    with pytest.raises(RuntimeError, match="sample positions"):
        drop(x)
