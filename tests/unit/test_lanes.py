"""Lanes: how many process groups of one world size run side by side, on which cores."""

from __future__ import annotations

import threading

import pytest

from gaeq.runtime.lanes import CellPool, plan_lanes


@pytest.mark.parametrize(
    "world_size, cells, cores, limit, lanes",
    [
        (1, 20, [0, 1], None, [(0,), (1,)]),  # this machine's default matrix: two world-1 groups
        (2, 20, [0, 1], None, [(0, 1)]),  # world 2 fills 2 cores: one group
        (1, 1, [0, 1], None, [(0, 1)]),  # one cell: one group, every core
        (1, 3, [0, 1, 2, 3], None, [(0,), (1,), (2,)]),  # no more lanes than cells
        (2, 8, [0, 1, 2, 3, 4], None, [(0, 1), (2, 3)]),  # a core left over stays free
        (1, 20, [0, 1, 2, 3], 2, [(0, 1), (2, 3)]),  # --lanes 2: two groups, two cores each
        (1, 20, [0, 1], 1, [(0, 1)]),  # --lanes 1: one after another, as before lanes
        (4, 8, [0, 1], None, [(0, 1)]),  # more ranks than cores: one group shares them all
        (1, 20, [3, 5], None, [(3,), (5,)]),  # the cores the run may use, not 0..n-1
    ],
)
def test_lanes_never_share_a_core_and_use_what_the_cores_hold(world_size, cells, cores, limit, lanes):
    planned = plan_lanes(world_size=world_size, cells=cells, cores=cores, limit=limit)
    assert planned == lanes
    used = [core for lane in planned for core in lane]
    assert len(used) == len(set(used))  # disjoint
    if len(planned) > 1:
        assert all(len(lane) >= world_size for lane in planned)  # each rank a core of its own


def test_the_pool_hands_every_cell_once_in_order_across_threads():
    pool = CellPool(list(range(1000)))
    taken: list[list[int]] = [[], []]

    def lane(i: int) -> None:
        while (cell := pool.take()) is not None:
            taken[i].append(cell)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken[0] + taken[1]) == list(range(1000))
    assert all(t == sorted(t) for t in taken)  # each lane in matrix order
    assert not pool and pool.take() is None


def test_a_group_that_cannot_start_takes_what_is_left_of_the_pool():
    pool = CellPool(["a", "b", "c"])
    assert pool.take() == "a"
    assert pool.take_all() == ["b", "c"]
    assert not pool and pool.take_all() == []
