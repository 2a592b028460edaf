"""Where the suite's time goes: seconds per test folder and the slowest tests, from one pytest run.

    python benchmarks/suite_time.py                  # runs the README's test command's pytest, then prints
    python benchmarks/suite_time.py --junit run.xml  # reads a run already made (pytest --junitxml=run.xml)
    python benchmarks/suite_time.py --tiny           # a few unit tests: keeps the code working, numbers mean nothing

Each round of work adds tests; this prints the total by folder (tests/unit, tests/integration,
tests/notebooks) so that the next round sees the growth, and the 15 slowest tests with their phase time
(setup — a shared run a fixture makes — and call). The targets (README: the whole suite ≤ 8 minutes from a
fresh clone on 2 cores, the unit tests ≤ 60 s) are printed beside the totals, never asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"all": 8 * 60.0, "not integration": 60.0}
"""Seconds: the whole suite from a fresh clone, and `-m "not integration"` (the edit loop)."""
TINY = ["tests/unit/test_placeholders.py", "tests/unit/test_links.py"]


def times(junit: Path) -> list[tuple[str, float]]:
    """(test file::name, seconds) of every test case in a JUnit XML report."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        cases.append((f"{path}.py::{case.get('name')}", float(case.get("time", 0.0))))
    return cases


def by_folder(cases: list[tuple[str, float]]) -> dict[str, tuple[int, float]]:
    folders: dict[str, list[float]] = defaultdict(list)
    for name, seconds in cases:
        folders["/".join(name.split("/")[:2])].append(seconds)
    return {f: (len(s), sum(s)) for f, s in sorted(folders.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junit", type=Path, help="a pytest --junitxml report already made")
    parser.add_argument("--tiny", action="store_true", help="time two small unit-test files only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        junit = args.junit
        if junit is None:
            junit = Path(tmp) / "suite.xml"
            chosen = TINY if args.tiny else []
            subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *chosen],
                cwd=REPO,
                check=False,
                stdout=subprocess.DEVNULL,
            )
        cases = times(junit)
    if args.tiny:
        print("tiny run (--tiny): two unit-test files, to keep the code working — its numbers mean nothing")
    total = sum(s for _, s in cases)
    print(f"{'folder':<20} {'tests':>6} {'seconds':>9}")
    for folder, (count, seconds) in by_folder(cases).items():
        print(f"{folder:<20} {count:>6} {seconds:>9.1f}")
    unit = sum(s for n, s in cases if n.startswith("tests/unit/"))
    print(f"{'total':<20} {len(cases):>6} {total:>9.1f}   (target: ≤ {TARGETS['all']:.0f} s from a fresh clone)")
    print(f"{'unit tests':<20} {'':>6} {unit:>9.1f}   (target: ≤ {TARGETS['not integration']:.0f} s)")
    print("slowest tests (setup + call):")
    for name, seconds in sorted(cases, key=lambda c: -c[1])[:15]:
        print(f"  {seconds:7.1f}  {name}")


if __name__ == "__main__":
    main()
