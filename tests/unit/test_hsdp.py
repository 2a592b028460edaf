"""HSDP — FSDP2 on a 2-D (replicate × shard) mesh: the axis and what is bad input. Training it, and
its control (the norm summed over the replicas too), is in tests/integration/test_strategies.py."""

from __future__ import annotations

import pytest

from gaeq.matrix import MatrixError, matrix_from_dict
from tests.helpers import small_spec


def test_the_axis_is_fsdps_and_leaves_out_replicas_that_leave_no_shard_group():
    axes = {"trainer": ["torch", "fsdp"], "world_size": [2, 4], "hsdp_replicas": [1, 2], "micro_batch_size": [2]}
    ids = [c.id for c in matrix_from_dict(small_spec(axes=axes)).cells if c.world_size > 1]
    # world 2 with two replicas would shard over one rank each (DDP); torch has no shards to replicate
    assert ids == [
        "torch-w2-mb2-ga4",
        "torch-w4-mb2-ga2",
        "fsdp-w2-mb2-ga4",
        "fsdp-w4-mb2-ga2",
        "fsdp-w4-hsdp2-mb2-ga2",
    ]
    hsdp = next(c for c in matrix_from_dict(small_spec(axes=axes)).cells if c.hsdp_replicas == 2)
    assert (hsdp.data_parallel, hsdp.grad_accum_steps) == (4, 2)  # every rank sees its own samples


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ({"trainer": "torch"}, "hsdp_replicas is FSDP2's hybrid sharding: the fsdp trainer only"),
        ({"hsdp_replicas": 4}, "leaves one rank per shard group: that is DDP"),
        ({"hsdp_replicas": 3}, "world_size 4 is not divisible by hsdp_replicas 3"),
        ({"hsdp_replicas": 1, "bug": "hsdp_grad_norm_over_replicas"}, "needs hsdp_replicas ≥ 2, the cell has 1"),
    ],
)
def test_where_hsdp_is_bad_input(cell, message):
    base = {"trainer": "fsdp", "world_size": 4, "hsdp_replicas": 2, "micro_batch_size": 2}
    with pytest.raises(MatrixError, match=message):
        matrix_from_dict(small_spec(cells=[base | cell]))
