"""Where the suite's time goes: seconds per test folder and the slowest tests, from one pytest run.

    python benchmarks/suite_time.py                  # runs the README's test command's pytest, then prints
    python benchmarks/suite_time.py --junit run.xml  # reads a run already made (pytest --junitxml=run.xml)
    python benchmarks/suite_time.py --serial         # each test's busy core-seconds too
    python benchmarks/suite_time.py --workers 0      # in one process (the README's command runs two workers)
    python benchmarks/suite_time.py --tiny           # two unit-test files in one process: numbers mean nothing

Each round of work adds tests; this prints the total by folder (tests/unit, tests/integration,
tests/notebooks) so that the next round sees the growth, and the 15 slowest tests with their phase time
(setup — a shared run a fixture makes — and call). The targets (README: the whole suite ≤ 8 minutes from a
fresh clone on 2 cores, the unit tests ≤ 60 s) are printed beside the totals, never asserted.

When it runs the suite itself it also measures the machine's **busy core-seconds** over the run (`/proc/stat`
read before and after — the whole machine's, so measure on a machine doing nothing else): the suite's work,
whose budget the README states, for wall time alone cannot say whether a slow run waits or works. `--serial`
loads this file into that pytest as a plugin, which reads `/proc/stat` around each test: each test's busy
core-seconds, the work to cut where the total is over (in one process: on workers side by side, one test's share
of the machine cannot be told apart). `--workers N` runs it on N xdist workers (2 by default, as the README does;
0: one process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (loaded as a plugin from its own folder)
from tests.conftest import busy_seconds, busy_ticks  # noqa: E402  the machine's busy ticks, as every pytest run reads them

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"all": 8 * 60.0, "not integration": 60.0, "busy": 900.0}
"""Seconds: the whole suite from a fresh clone, and `-m "not integration"` (the edit loop); busy core-seconds of
the whole suite (README, Tests)."""
TINY = ["tests/unit/test_placeholders.py", "tests/unit/test_links.py"]
BUSY_FILE = "GAEQ_SUITE_BUSY_FILE"
"""Where the plugin below appends each test's busy core-seconds (a JSON line per test)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest's hook, where this file is loaded as a plugin (`-p suite_time`): the machine's busy
    core-seconds over a test's setup, call and teardown, appended to the file BUSY_FILE names."""
    before = busy_ticks()
    yield
    seconds = busy_seconds(before, busy_ticks())
    if seconds is None or BUSY_FILE not in os.environ:
        return
    with open(os.environ[BUSY_FILE], "a") as out:
        out.write(json.dumps({"test": item.nodeid, "core_seconds": seconds}) + "\n")


def times(report: ET.Element) -> list[tuple[str, float]]:
    """(test file::name, seconds) of every test case in a JUnit XML report."""
    cases = []
    for case in report.iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        cases.append((f"{path}.py::{case.get('name')}", float(case.get("time", 0.0))))
    return cases


def outcome(report: ET.Element) -> str:
    """What the run came to, from its JUnit XML report: "660 passed, 1 skipped, 0 failed" — a time is worth
    something only beside it."""
    suite = next(report.iter("testsuite"))
    count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = count["failures"] + count["errors"]
    said = f"{count['tests'] - failed - count['skipped']} passed, {count['skipped']} skipped, {failed} failed"
    for case in report.iter("testcase"):  # which, and its first line: a failure is found again without a rerun
        for bad in (*case.iter("failure"), *case.iter("error")):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            first = (bad.get("message") or "").strip().splitlines() or [""]
            said += f"\n  failed: {name} — {first[0][:300]}"
    return said


def by_folder(cases: list[tuple[str, float]], busy: dict[str, float]) -> dict[str, tuple[int, float, float]]:
    """Folder → (tests, seconds, busy core-seconds)."""
    folders: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for name, seconds in cases:
        folders["/".join(name.split("/")[:2])].append((seconds, busy.get(name, 0.0)))
    return {f: (len(t), sum(s for s, _ in t), sum(b for _, b in t)) for f, t in sorted(folders.items())}


def read_busy(path: Path) -> dict[str, float]:
    """Test → busy core-seconds, as the plugin wrote them (none for a run read from --junit)."""
    if not path.exists():
        return {}
    return {r["test"]: r["core_seconds"] for r in map(json.loads, path.read_text().splitlines())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junit", type=Path, help="a pytest --junitxml report already made (wall time only)")
    parser.add_argument("--tiny", action="store_true", help="time two small unit-test files only")
    parser.add_argument("--serial", action="store_true", help="each test's busy core-seconds as well")
    parser.add_argument(
        "--workers", type=int, default=2, help="pytest-xdist workers (-n): 2, as the README's command; 0: one process"
    )
    args = parser.parse_args()
    workers = 0 if args.serial or args.tiny else args.workers  # (one test's busy core-seconds: one process)
    with tempfile.TemporaryDirectory() as tmp:
        junit, busy_file, ran, work = args.junit, Path(tmp) / "busy.jsonl", None, None
        if junit is None:
            junit = Path(tmp) / "suite.xml"
            chosen = TINY if args.tiny else []
            here = str(Path(__file__).resolve().parent)  # this file, loaded into that pytest as a plugin
            path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
            per_test = {BUSY_FILE: str(busy_file)} if args.serial else {}
            started, before = time.monotonic(), busy_ticks()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_time",
                 f"--junitxml={junit}", "-n", str(workers), *chosen],
                cwd=REPO,
                check=False,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path, **per_test},
            )  # fmt: skip
            wall, work = time.monotonic() - started, busy_seconds(before, busy_ticks())
            ran = f"pytest: exit {proc.returncode}, {wall:.0f} s from its start to its exit"
        report = ET.parse(junit).getroot()
        cases, busy, ended = times(report), read_busy(busy_file), outcome(report)
    if args.tiny:
        print("tiny run (--tiny): two unit-test files, to keep the code working — its numbers mean nothing")
    cores = len(os.sched_getaffinity(0))
    print(f"{'folder':<20} {'tests':>6} {'seconds':>9} {'core-s':>8}")
    for folder, (count, seconds, per_folder) in by_folder(cases, busy).items():
        print(f"{folder:<20} {count:>6} {seconds:>9.1f} {per_folder if busy else float('nan'):>8.0f}")
    total = sum(s for _, s in cases)
    unit = sum(s for n, s in cases if n.startswith("tests/unit/"))
    target = f"(target: ≤ {TARGETS['all']:.0f} s from a fresh clone, start to exit)"
    print(f"{'total':<20} {len(cases):>6} {total:>9.1f} {float('nan') if work is None else work:>8.0f}   {target}")
    print(f"{'unit tests':<20} {'':>6} {unit:>9.1f}   (target: ≤ {TARGETS['not integration']:.0f} s)")
    print(f"tests: {ended}" + (f"; {ran}" if ran else ""))
    if workers and args.junit is None:
        print("(seconds: each test's own, summed — workers side by side make the run's wall less)")
    if work is not None:
        print(
            f"busy core-seconds: {work:.0f} over the run — the machine's {cores} cores were busy {work / wall:.2f} of "
            f"{cores} on average (budget: {TARGETS['busy']:.0f}, README, Tests)"
        )
    print("slowest tests (setup + call; busy core-seconds where measured, --serial):")
    for name, seconds in sorted(cases, key=lambda c: -c[1])[:15]:
        print(f"  {seconds:7.1f}  {busy.get(name, float('nan')):6.0f}  {name}")


if __name__ == "__main__":
    main()
