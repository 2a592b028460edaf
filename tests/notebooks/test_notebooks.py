"""The teaching notebooks run top to bottom on a CPU and their asserts hold (executed with nbclient)."""

from __future__ import annotations

import json

import nbformat
import pytest

from tests.conftest import REPO
from tests.notebook_runs import ALONE, NOTEBOOKS, execute


def test_there_are_four_notebooks_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    assert len(NOTEBOOKS) == 4
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.name}" in readme, f"README does not link {nb.name}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_outputs_are_stripped_in_git(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: strip the outputs"


@pytest.fixture(scope="session")
def executed(notebooks_running):
    """Every notebook executed once for the session: the one-core ones side by side (started with
    the unit tests when those run), then the rest, alone."""
    return {stem: future.result() for stem, future in notebooks_running.items()} | {p.stem: execute(p) for p in NOTEBOOKS if p.stem in ALONE}


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_asserts_hold(path, tmp_path, executed):
    nb = executed[path.stem]
    if isinstance(nb, Exception):
        raise nb  # the failing cell, its traceback
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} shows no plot"
    (tmp_path / path.name).write_text(nbformat.writes(nb))  # the executed copy, for a look after a failure
