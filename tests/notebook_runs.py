"""The teaching notebooks executed once per session, with nbclient.

The ones that keep to one core — notebook 1 trains world-1 cells, notebooks 3 and 4 re-judge the
suite's own runs of experiments/universal.yaml and pitfalls.yaml instead of training them again —
start as soon as the unit tests do (tests/unit/conftest.py): those run in this process on one core,
and the kernels take the other. The notebook tests run last (tests/conftest.py) and collect them;
notebook 2 runs a world-2 DeepSpeed group (both cores) and is executed then, alone.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
SHARED = {"03_changing_world_size": ("universal_run", "GAEQ_UNIVERSAL_RUN"), "04_pitfalls": ("pitfalls_run", "GAEQ_PITFALLS_RUN")}
"""notebook → (the session fixture whose run it re-judges, the variable that hands it over)"""
ALONE = ("02_deepspeed_and_zero",)
"""Notebooks that use both cores: executed after the others, on their own."""


class _Client(NotebookClient):
    """nbclient's client, saying when its kernel process has been launched."""

    launched: threading.Event

    async def async_start_new_kernel(self, **kwargs) -> None:
        try:
            await super().async_start_new_kernel(**kwargs)
        finally:
            self.launched.set()


def execute(path: Path, env: dict[str, str] | None = None, launched: threading.Event | None = None):
    """The executed notebook, or the exception (CellExecutionError names the failing cell).
    `launched` is set once the kernel's process has been started (or failed to)."""
    nb = nbformat.read(path, as_version=4)
    # Each cell gets 5 minutes: the first DeepSpeed start on a fresh machine JIT-builds an op (~30 s).
    client = _Client(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.launched = launched or threading.Event()
    try:
        client.execute(env={**os.environ, **(env or {})})  # the kernel's environment
    except Exception as exc:  # noqa: BLE001 - reported by the notebook's own test
        return exc
    finally:
        client.launched.set()
    return nb


def start_side_by_side(shared_runs: dict[str, Path]) -> tuple[ThreadPoolExecutor, dict[str, Future]]:
    """Start the one-core notebooks, each in a kernel of its own; `shared_runs`: variable → run
    directory. Returns once their kernels' processes exist — a test may then forbid starting
    processes (tests/unit/test_bad_input.py) — with the pool (shut it down to wait for them) and a
    future per notebook."""
    side_by_side = [p for p in NOTEBOOKS if p.stem not in ALONE]
    pool = ThreadPoolExecutor(len(side_by_side), thread_name_prefix="notebook")
    env = {variable: str(run) for variable, run in shared_runs.items()}
    launched = {p.stem: threading.Event() for p in side_by_side}
    futures = {p.stem: pool.submit(execute, p, env, launched[p.stem]) for p in side_by_side}
    for stem, event in launched.items():
        if not event.wait(timeout=120):
            raise TimeoutError(f"the kernel of notebook {stem} did not start within 120 s")
    return pool, futures
