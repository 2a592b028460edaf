"""The README's quick start stays true: two commands, the second one is what CI runs."""

from __future__ import annotations

import re

from tests.conftest import REPO


def quick_start_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    run, test = quick_start_commands()
    assert run.startswith("pip install torch==2.13.0 ") and run.endswith("gaeq run --matrix experiments/ga.yaml")
    assert test.startswith("pip install torch==2.13.0 ") and "pytest" in test
    ci = (REPO / ".ci" / "run").read_text()
    assert test in ci.splitlines()
    assert ci.index("pip install torch==2.13.0") < ci.index('pip install -e ".[test]"')
