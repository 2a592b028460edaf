"""The BatchPlan: every split of a step sees exactly the same samples."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from gaeq.problem.data import BatchPlan, RegressionData
from gaeq.problem.spec import RegressionSpec

B = 24


def splits(batch: int):
    for micro, world in itertools.product(range(1, batch + 1), range(1, 5)):
        if batch % (micro * world) == 0:
            yield micro, world


@pytest.mark.parametrize("num_samples", [None, 40])
def test_every_split_covers_each_sample_of_the_step_exactly_once(num_samples):
    reference = None
    for micro, world in splits(B):
        plan = BatchPlan(
            train_batch_size=B, micro_batch_size=micro, data_parallel=world, num_samples=num_samples, seed=3
        )
        assert plan.grad_accum_steps == B // (micro * world)
        for step in range(4):
            seen = [
                i
                for k in range(plan.grad_accum_steps)
                for r in range(world)
                for i in plan.sample_indices(step=step, micro_step=k, rank=r)
            ]
            assert len(seen) == B
            if num_samples is None:
                assert sorted(seen) == list(range(step * B, (step + 1) * B))
            step_samples = sorted(seen)
            if reference is None:
                reference = {}
            assert reference.setdefault(step, step_samples) == step_samples


def test_layout_is_micro_step_major_then_rank():
    plan = BatchPlan(train_batch_size=8, micro_batch_size=2, data_parallel=2)
    assert list(plan.positions(step=1, micro_step=0, rank=0)) == [8, 9]
    assert list(plan.positions(step=1, micro_step=0, rank=1)) == [10, 11]
    assert list(plan.positions(step=1, micro_step=1, rank=0)) == [12, 13]


def test_finite_dataset_walks_a_fresh_permutation_each_epoch():
    plan = BatchPlan(train_batch_size=4, micro_batch_size=4, data_parallel=1, num_samples=8, seed=1)
    epochs = [[plan.sample_at(p) for p in range(e * 8, (e + 1) * 8)] for e in range(3)]
    assert all(sorted(e) == list(range(8)) for e in epochs)
    assert epochs[0] != epochs[1]
    other_seed = BatchPlan(train_batch_size=4, micro_batch_size=4, data_parallel=1, num_samples=8, seed=2)
    assert [other_seed.sample_at(p) for p in range(8)] != epochs[0]


def test_indivisible_plan_is_rejected_with_numbers():
    with pytest.raises(ValueError, match="train_batch_size 10 is not divisible by micro_batch_size 4 × world_size 1"):
        BatchPlan(train_batch_size=10, micro_batch_size=4, data_parallel=1)


def test_a_sample_is_a_pure_function_of_seed_and_index():
    data = RegressionData(RegressionSpec(), seed=5)
    again = RegressionData(RegressionSpec(), seed=5)
    x1, y1 = data.batch([3, 17, 2])
    x2, y2 = again.batch([17])
    torch.testing.assert_close(x1[1:2], x2, rtol=0, atol=0)
    torch.testing.assert_close(y1[1:2], y2, rtol=0, atol=0)
    x3, _ = RegressionData(RegressionSpec(), seed=6).batch([17])
    assert not np.allclose(x2.numpy(), x3.numpy())


def test_runs_of_positions_map_like_single_positions_across_epochs():
    plan = BatchPlan(train_batch_size=8, micro_batch_size=2, data_parallel=2, num_samples=6, seed=3)
    for start, stop in [(0, 6), (4, 9), (5, 20), (7, 8), (12, 12)]:
        assert plan.samples_at(range(start, stop)) == [plan.sample_at(p) for p in range(start, stop)]
    endless = BatchPlan(train_batch_size=8, micro_batch_size=2, data_parallel=2)
    assert endless.samples_at(range(3, 9)) == list(range(3, 9))


def test_masked_samples_have_no_valid_label_and_count_nothing():
    from gaeq.problem.data import IGNORE_INDEX, TokenData
    from gaeq.problem.spec import TokensSpec

    data = TokenData(TokensSpec(vocab_size=16, seq_len=8, min_len=9, masked_every=4), seed=0)
    _, labels = data.batch(list(range(8)))
    masked = [i for i in range(8) if (labels[i] == IGNORE_INDEX).all()]
    assert masked == [3, 7]  # every fourth sample, by index
    assert [data.loss_elements(i) for i in range(8)] == [8, 8, 8, 0, 8, 8, 8, 0]
    assert data.total_loss_elements(range(8)) == 48


def test_packs_hold_whole_documents_and_no_target_crosses_into_the_next():
    from gaeq.problem.data import IGNORE_INDEX, TokenData
    from gaeq.problem.spec import TokensSpec

    data = TokenData(TokensSpec(vocab_size=16, seq_len=24, min_len=3, packed=True), seed=0)
    inputs, labels = data.batch(list(range(32)))
    documents = data.documents(range(32))
    rows, starts = data.rows(range(32))
    assert ((documents > 0).sum(axis=1) >= 2).all()  # several documents per pack
    assert (documents.sum(axis=1) <= 25).all()  # each fits in seq_len + 1 tokens
    counts = (labels != IGNORE_INDEX).sum(dim=1).tolist()
    assert counts == [data.loss_elements(i) for i in range(32)]  # a pack of k documents: its tokens − k targets
    assert counts == (documents.sum(axis=1) - (documents > 0).sum(axis=1)).tolist()
    assert len(set(counts)) > 3  # packs differ in their valid tokens (what makes per-pack weighting wrong)
    for row in range(32):
        valid = labels[row] != IGNORE_INDEX
        assert (labels[row][valid] == torch.from_numpy(rows[row, 1:])[valid]).all()  # the next token …
        assert not torch.from_numpy(starts[row, 1:])[valid].any()  # … never the first of the next document
    again_inputs, again_labels = data.batch([5])  # a pack is a pure function of (seed, index)
    assert torch.equal(again_inputs[0], inputs[5]) and torch.equal(again_labels[0], labels[5])


def test_a_short_step_ends_each_epoch_and_every_split_sees_its_samples_once():
    """epoch_end short_step: 120 samples in steps of 32 → 32, 32, 32, 24 per epoch, each epoch's
    samples seen once, the last step in fewer micro-steps (a rank's last micro-batch may be short)."""
    for micro, world in [(32, 1), (4, 1), (5, 1), (4, 2), (2, 4), (3, 2)]:
        if 32 % (micro * world):
            continue
        plan = BatchPlan(
            train_batch_size=32, micro_batch_size=micro, data_parallel=world, num_samples=120, short_steps=True, seed=1
        )
        assert plan.first_short_step() == (None if plan.micro_steps(3) == plan.grad_accum_steps else 3)
        for epoch in range(2):
            seen = []
            for step in range(4 * epoch, 4 * epoch + 4):
                full = step % 4 != 3
                assert plan.micro_steps(step) == (plan.grad_accum_steps if full else -(-24 // (micro * world)))
                assert len(plan.step_positions(step)) == (32 if full else 24)
                batches = [
                    plan.sample_indices(step=step, micro_step=k, rank=r)
                    for k in range(plan.micro_steps(step))
                    for r in range(world)
                ]
                assert all(batches)  # no rank ever gets an empty micro-batch
                seen += [i for batch in batches for i in batch]
            assert sorted(seen) == list(range(120))


def test_a_short_step_that_cannot_split_evenly_over_ranks_is_refused_with_numbers():
    with pytest.raises(ValueError, match=r"120 mod train_batch_size 32 = 24 samples: not divisible by .* 16 × .* 2"):
        BatchPlan(train_batch_size=32, micro_batch_size=16, data_parallel=2, num_samples=120, short_steps=True)
    BatchPlan(train_batch_size=32, micro_batch_size=16, data_parallel=1, num_samples=120, short_steps=True)  # short


def test_per_pack_means_weigh_tokens_by_their_pack():
    """The planted bug's reduction: the token mean when every pack has as many targets, not otherwise."""
    from gaeq.problem.loss import cross_entropy_row_means, cross_entropy_sum

    logits = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 2, 3, -100, -100, -100], [4, 0, 1, 2, -100, -100]])
    equal = torch.tensor([[1, 2, 3, -100, -100, -100], [4, 0, 1, -100, -100, -100]])
    torch.testing.assert_close(cross_entropy_row_means(logits, equal) / 2, cross_entropy_sum(logits, equal) / 6)
    assert abs(cross_entropy_row_means(logits, labels) / 2 - cross_entropy_sum(logits, labels) / 7) > 1e-3
