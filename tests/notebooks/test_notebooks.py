"""The teaching notebooks run top to bottom on a CPU and their asserts hold (executed with nbclient)."""

from __future__ import annotations

import json

import nbformat
import pytest

from tests.conftest import REPO
from tests.kernels import NOTEBOOKS
from tests.processes import inheriting


def test_there_are_five_notebooks_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    assert len(NOTEBOOKS) == 5
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.name}" in readme, f"README does not link {nb.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_outputs_are_stripped_in_git(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: strip the outputs"


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_asserts_hold(path, tmp_path, notebooks_run):
    """As its reader runs it: top to bottom in a fresh kernel, no gaeq environment variable, its own runs."""
    executed, _ = notebooks_run
    ran = executed[path.stem]
    if ran.error is not None:
        raise ran.error  # the failing cell, its traceback
    images = [o for c in ran.notebook.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} shows no plot"
    (tmp_path / path.name).write_text(nbformat.writes(ran.notebook))  # the executed copy, for a look after a failure


@pytest.mark.integration
def test_the_notebooks_read_no_gaeq_variable_and_leave_nothing_running(notebooks_run):
    """No notebook reads a gaeq environment variable (their runs are their own: before, the suite handed three
    of them its runs, and the lines a reader runs were never tested), and their kernels and ranks are gone."""
    _, tmpdir = notebooks_run
    for nb in NOTEBOOKS:
        assert "GAEQ_" not in nb.read_text(), nb.name
    assert inheriting(f"TMPDIR={tmpdir}") == []
