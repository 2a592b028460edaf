"""docs/your-setup.md, the "check your own script" how-to, as its reader follows it: every `gaeq check` command in
its bash blocks, run from the repository root as written (into a run directory of the test's), ends as the page
says — exit 0, its splits judged, the closing line printed."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import REPO
from tests.helpers import gaeq_here

pytestmark = pytest.mark.integration


def commands() -> list[list[str]]:
    """The `gaeq check …` commands of the page's ```bash blocks, as argument lists after `gaeq`."""
    page = (REPO / "docs" / "your-setup.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines() if line.strip().startswith("gaeq check")]
    return [shlex.split(line)[1:] for line in lines]


def test_the_howtos_commands_run_as_written(tmp_path, monkeypatch):
    found = commands()
    assert 1 <= len(found) <= 2, found  # the page's own promise: at most two, each run here
    monkeypatch.chdir(REPO)
    for k, args in enumerate(found):
        out = tmp_path / f"run{k}"
        at = args.index("--") if "--" in args else len(args)
        proc, report, _ = gaeq_here([*args[:at], "--out", str(out), *args[at:]], out)
        said = proc.stdout
        assert proc.returncode in (0, 1), said[-3000:]  # a planted mistake ends NOT OK (1), never an error (3)
        assert report["summary"]["error"] == 0 and ("OK:" in said or "NOT OK:" in said), said[-3000:]
        if "--baseline" in args and args[args.index("--baseline") + 1] == "none":
            assert "Weights: " in said and report["baseline"] is None
