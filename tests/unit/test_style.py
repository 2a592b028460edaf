"""One style for the whole repository, held by the suite: ruff's linter and formatter, configured
in pyproject.toml (line length 120, imports sorted), over every Python file but the notebooks."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO
from tests.processes import run


@pytest.mark.parametrize(
    "check",
    [["check", "--no-cache"], ["format", "--check", "--no-cache"]],
    ids=["lint", "format"],
)
def test_the_repository_is_ruff_clean(check):
    proc = run([sys.executable, "-m", "ruff", *check, str(REPO)], timeout=120, cwd=REPO)
    assert proc.returncode == 0, (
        f"`ruff {' '.join(check)}` (fix: ruff check --fix . && ruff format .):\n{proc.stdout}{proc.stderr}"
    )


def test_the_control_a_long_line_is_found(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(f"x = {'1 + ' * 60}1\n")
    proc = run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)],
        timeout=120,
    )
    assert proc.returncode == 1 and "E501" in proc.stdout, proc.stdout + proc.stderr
