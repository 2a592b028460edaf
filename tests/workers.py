"""The suite on two pytest-xdist workers (`python -m pytest -n 2`, the README's command): what one worker keeps
together, and the core it runs on.

Each worker runs on a core of its own, with everything it starts (:func:`pin_to_a_core`): two one-core machines.
Unpinned, the two workers' process groups and lanes shared both cores and waited on each other's ranks: more work
than one process did (docs/tests.md measures both).

A unit of work is a test file — its module fixtures made once — except that the files that share a session's
run (a fixture of tests/conftest.py in SHARED_RUNS) go to one worker together, which trains that run once.
Units are handed out in collection order (the DeepSpeed op's first build, then the integration tests, the
slowest, then the notebooks and the unit tests, which fill the gaps at the end), never reordered by size.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

SHARED_RUNS = ("notebooks_run", "default_run", "your_script_run", "universal_run")
"""Session fixtures that train (tests/conftest.py): every test file that uses one runs on the worker that made it."""


def group_sharing_files(items: Sequence[pytest.Item]) -> None:
    """Mark every test of a file that uses a shared run with that run's group (xdist's `xdist_group`, which
    `--dist loadgroup` appends to its node id): the whole file, so that its module fixtures stay whole too."""
    group_of: dict[object, str] = {}
    for item in items:
        shared = next((name for name in SHARED_RUNS if name in getattr(item, "fixturenames", ())), None)
        if shared is not None:
            group_of.setdefault(item.path, shared)
    for item in items:
        if item.path in group_of:
            item.add_marker(pytest.mark.xdist_group(group_of[item.path]))


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its group (`…::test@group`), else its file."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # (a parameter's value may hold an @)
        return nodeid.rsplit("@", 1)[-1]
    return nodeid.split("::", 1)[0]


def scheduler(config: pytest.Config, log: object):
    """xdist's scheduler by scope, with :func:`scope_of` for its scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFileOrSharedRun(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ByFileOrSharedRun(config, log)


def is_controller(config: pytest.Config) -> bool:
    """Whether this process hands tests to xdist workers (and runs none itself)."""
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def pin_to_a_core(workerinput: dict) -> None:
    """An xdist worker and everything it starts run on one core of their own (`gwN` on the Nth, where there are as
    many): two workers are two one-core machines, whose process groups never wait on each other's ranks. gaeq
    plans its lanes and ranks from this affinity."""
    cores = sorted(os.sched_getaffinity(0))
    workers = int(workerinput.get("workercount", 1))
    if workers > 1 and len(cores) >= workers:
        index = int(workerinput["workerid"].removeprefix("gw"))
        os.sched_setaffinity(0, {cores[index]})
