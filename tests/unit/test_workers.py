"""The suite on two xdist workers (tests/workers.py): each on a core of its own, with what it starts; and the
units of work it is handed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO
from tests.workers import scope_of

PINNED = """
import json, os, sys
from gaeq.runtime.lanes import plan_lanes
from tests.workers import pin_to_a_core
pin_to_a_core(json.loads(sys.argv[1]))
child = os.fork()  # what the worker starts: its fork server, ranks, gaeq children
if child == 0:
    os._exit(len(os.sched_getaffinity(0)))
_, status = os.waitpid(child, 0)
cores = sorted(os.sched_getaffinity(0))
print(json.dumps({"cores": cores, "child": os.waitstatus_to_exitcode(status),
                  "lanes": len(plan_lanes(world_size=1, cells=4, cores=cores))}))
"""


def pinned(workerinput: dict) -> dict:
    """What a worker given `workerinput` (xdist's) runs on, in a child (this process keeps its cores)."""
    proc = subprocess.run([sys.executable, "-c", PINNED, json.dumps(workerinput)], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=True)  # fmt: skip
    return json.loads(proc.stdout)


def test_each_of_two_workers_runs_on_a_core_of_its_own_with_what_it_starts():
    cores = sorted(os.sched_getaffinity(0))
    first, second = (pinned({"workerid": f"gw{i}", "workercount": 2}) for i in (0, 1))
    if len(cores) >= 2:
        assert (first["cores"], second["cores"]) == ([cores[0]], [cores[1]])
        assert first["child"] == second["child"] == 1 and first["lanes"] == second["lanes"] == 1
    else:  # more workers than cores: they share what there is
        assert first["cores"] == second["cores"] == cores


def test_the_control_one_process_keeps_every_core():
    cores = sorted(os.sched_getaffinity(0))
    alone = pinned({"workerid": "gw0", "workercount": 1})
    assert alone["cores"] == cores and alone["child"] == len(cores)


def test_a_unit_of_work_is_a_file_or_the_shared_run_its_tests_are_grouped_with():
    assert scope_of("tests/unit/test_a.py::test_x[1]") == "tests/unit/test_a.py"
    assert scope_of("tests/integration/test_zero.py::test_y@default_run") == "default_run"
    assert scope_of("tests/unit/test_a.py::test_x[a@b]") == "tests/unit/test_a.py"  # an @ in a parameter's value
