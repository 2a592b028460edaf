"""Lanes: process groups of one world size side by side, each on cores of its own, taking their
cells from one pool (gaeq/runtime/launch.py runs them)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from gaeq.matrix import Cell


def plan_lanes(*, world_size: int, cells: int, cores: Sequence[int], limit: int | None = None) -> list[tuple[int, ...]]:
    """The cores of each group of `world_size` that runs side by side with the others: as many
    groups as the cores hold without two sharing one (⌊cores ÷ world size⌋), no more than there are
    `cells` (nor than `limit`), each with an equal slice of the cores. One group gets every core
    (a world size above the core count shares them, as ranks always did)."""
    lanes = max(1, min(len(cores) // world_size, cells, limit or len(cores)))
    if lanes == 1:
        return [tuple(cores)]
    per = len(cores) // lanes
    return [tuple(cores[i * per : (i + 1) * per]) for i in range(lanes)]


class CellPool:
    """The cells of one world size not yet handed to a group. Each group takes the next one (in
    matrix order) when it becomes free, so lanes stay balanced however long their cells take."""

    def __init__(self, cells: Sequence[Cell]) -> None:
        self._cells = deque(cells)
        self._lock = threading.Lock()

    def take(self) -> Cell | None:
        with self._lock:
            return self._cells.popleft() if self._cells else None

    def take_all(self) -> list[Cell]:
        with self._lock:
            cells, self._cells = list(self._cells), deque()
            return cells

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._cells)
