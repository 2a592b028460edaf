"""The notebooks as a user runs them: each executed top to bottom by nbclient in a fresh kernel of its own,
with no gaeq environment variable set — the lines a user runs are the lines tested."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
KERNEL_STARTS = 3
"""Tries at starting a notebook's kernel. With five started at once on 2 cores, one died before it
replied to kernel_info (seen once in a full run; jupyter_client picks each kernel's ports by binding and
releasing them, so concurrent starts can collide): it had run nothing, so it is started again."""
CELL_TIMEOUT_S = 300
"""Each cell's limit: the first DeepSpeed start on a fresh machine JIT-builds an op (tens of seconds)."""


@dataclass(frozen=True)
class Executed:
    notebook: nbformat.NotebookNode | None
    """The executed notebook, with its outputs (None: it failed)."""
    error: Exception | None
    """What stopped it (CellExecutionError names the failing cell)."""
    seconds: float


def execute(path: Path) -> Executed:
    started = time.perf_counter()
    for start in range(KERNEL_STARTS):
        nb = nbformat.read(path, as_version=4)
        resources = {"metadata": {"path": str(path.parent)}}  # run from notebooks/, as Jupyter does
        client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources=resources)
        try:
            client.execute()
        except RuntimeError as exc:
            if "before replying to kernel_info" in str(exc) and start + 1 < KERNEL_STARTS:
                continue  # the kernel never started: no cell ran
            return Executed(None, exc, time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - reported by the notebook's own test
            return Executed(None, exc, time.perf_counter() - started)
        return Executed(nb, None, time.perf_counter() - started)
    raise AssertionError("unreachable")


def execute_all(tmpdir: Path) -> dict[str, Executed]:
    """Every notebook, side by side (notebook 2's world-2 DeepSpeed group overlaps the others' imports and
    judging: faster than one after another, docs/tests.md), in kernels that see no gaeq environment variable
    and write their temporary run directories under `tmpdir`."""
    saved = dict(os.environ)
    try:
        for name in [k for k in os.environ if k.startswith("GAEQ_")]:
            del os.environ[name]  # (a kernel inherits this process's environment when it starts)
        os.environ["TMPDIR"] = str(tmpdir)
        with ThreadPoolExecutor(len(NOTEBOOKS)) as pool:
            return dict(zip((p.stem for p in NOTEBOOKS), pool.map(execute, NOTEBOOKS)))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_of(tmpdir: Path, notebook: str) -> Path:
    """The run directory `notebook` made under `tmpdir` (its `tempfile.mkdtemp(prefix="gaeq-nbN-")`)."""
    number = int(notebook.split("_")[0])
    found = sorted(tmpdir.glob(f"gaeq-nb{number}-*"))
    assert len(found) == 1, f"{notebook} made {len(found)} run directories in {tmpdir}: {found}"
    return found[0]
