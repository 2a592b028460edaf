"""Vocabulary-parallel cross-entropy (experiments/loss_parallel.yaml): gaeq's GPT with its head split by
vocabulary under tensor parallelism, the loss on the shards through torch's loss_parallel, trains the same
optimisation as one process on the whole batch at tp 2 with dp 1 and 2, GA 1–4; each rank's softmax over
its own slice of the vocabulary (torchtitan#3412's shape) is caught at step 0."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok

pytestmark = pytest.mark.integration


def test_vocabulary_parallel_loss_matches_and_a_shard_local_softmax_is_caught(tmp_path):
    proc, report, _ = gaeq_run_here(REPO / "experiments" / "loss_parallel.yaml", tmp_path / "run")
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    split = [c for c in cells.values() if c["tensor_parallel"] == 2 and not c["bug"]]
    assert len(split) == 4 and {c["world_size"] for c in split} == {2, 4}
    for c in split:
        assert c["verdict"] == "match", c["reason"]
        assert c["ran"]["loss_parallel"] is True and c["ran"]["tensor_parallel"] == 2  # the logits really sharded
    assert cells["torch-w1-mb16-ga1"]["ran"]["loss_parallel"] is False  # one process: nothing to shard
    planted = cells["torch-w2-tp2-mb4-ga4-bug_loss_parallel_shard_softmax"]
    assert (planted["verdict"], planted["first_divergent_step"]) == ("diverge", 0), planted["reason"]
    assert planted["max_abs_loss_diff"] > 1.0  # each slice's softmax: the loss far above the baseline's
