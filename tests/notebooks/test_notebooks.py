"""The teaching notebooks run top to bottom on a CPU and their asserts hold (executed with nbclient)."""

from __future__ import annotations

import json

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


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


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_asserts_hold(path, tmp_path, request, monkeypatch):
    # Notebooks 3 and 4 re-judge the suite's own runs of experiments/universal.yaml and pitfalls.yaml
    # (they say so) instead of training them again.
    shared = {"03_changing_world_size": ("universal_run", "GAEQ_UNIVERSAL_RUN"), "04_pitfalls": ("pitfalls_run", "GAEQ_PITFALLS_RUN")}
    if path.stem in shared:
        fixture, variable = shared[path.stem]
        monkeypatch.setenv(variable, str(request.getfixturevalue(fixture)[3]))
    nb = nbformat.read(path, as_version=4)
    # Each cell gets 5 minutes: the first DeepSpeed start on a fresh machine JIT-builds an op (~30 s).
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name} shows no plot"
    (tmp_path / path.name).write_text(nbformat.writes(nb))  # the executed copy, for a look after a failure
