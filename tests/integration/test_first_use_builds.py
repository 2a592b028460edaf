"""A DeepSpeed op's first use on a machine, as a newcomer meets it (gaeq/runtime/ops.py): a lock a killed
build left is named with the command that clears it, at once — never waited on —; after that command, a
second run started while a first build is alive waits for it (said, with the folder), then trains.

The build is the one this machine pays once anyway, into its own cache, where the comm op was never built
there (a fresh clone's first suite: every later DeepSpeed cell finds it). Where it was, the test's empty
cache is given the objects this machine compiled (`*.o`, ninja's files), not the library: DeepSpeed's
builder then runs as on first use, and ninja links the library — a real build, held open a few seconds by
a `ninja` first on its PATH that waits before it runs the real one (the second run must meet it alive;
a ~25 s compile would prove nothing more about gaeq, and cost a core)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from subprocess import PIPE

import pytest
import yaml

from gaeq.runtime.ops import COMM, STALE_AFTER_S, built_here, library
from tests.helpers import small_spec
from tests.processes import gaeq_command, leftovers, new_tag, run, running

pytestmark = [pytest.mark.integration, pytest.mark.first_use_build]


def test_a_dead_builds_lock_is_named_and_a_first_use_build_runs_before_any_cell(tmp_path):
    extensions = tmp_path / "torch_extensions"  # an empty cache: this machine's first use of the comm op
    folder = extensions / COMM.name
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # what a build killed mid-compile leaves: the lock, no library
    os.utime(folder / "lock", (time.time() - 2 * STALE_AFTER_S,) * 2)
    spec = small_spec(axes={"trainer": ["deepspeed"], "world_size": [1], "micro_batch_size": [8], "zero_stage": [1]})
    spec["problem"] |= {"steps": 3, "schedule": {"name": "constant"}}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec | {"noise_floor": False, "detection_limit": False}))
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)}
    tag = new_tag()
    try:
        started = time.perf_counter()
        stale = run(gaeq_command("run", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "a")),
                    timeout=120, tag=tag, env=env, stdout=PIPE, stderr=PIPE, text=True)  # fmt: skip
        said = stale.stdout + stale.stderr
        assert stale.returncode == 3, said
        assert f"rm -rf {folder}" in said and "a killed build's" in said, said
        assert time.perf_counter() - started < 120 and not (tmp_path / "a" / "report.json").exists()
        shutil.rmtree(folder)  # the command it named
        own_cache = not built_here(COMM)  # this machine's own first build: paid here, once, for the whole suite
        if own_cache:
            env, slow = dict(os.environ), {}
        else:
            compiled(folder)
            slow = {"PATH": f"{slow_ninja(tmp_path / 'bin')}{os.pathsep}{env['PATH']}"}
        with running([sys.executable, "-m", "gaeq.runtime.ops", COMM.builder], tag=tag, env=env | slow, stdout=PIPE,
                     text=True) as first:  # fmt: skip
            building = json.loads(first.stdout.readline())  # a first run's build, alive
            assert building["state"] == "building", building
            lock = Path(building["dir"]) / "lock"
            while not lock.exists() and first.poll() is None:  # (DeepSpeed's builder takes torch's lock)
                time.sleep(0.2)
            second = run(gaeq_command("run", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "b")),
                         timeout=900, tag=tag, env=env, stdout=PIPE, stderr=PIPE, text=True)  # fmt: skip
            said = second.stdout + second.stderr
            assert second.returncode == 0, said[-4000:]  # it waited for the live build, then trained
            waited = f"waiting for {COMM.builder} ({COMM.why}): another process is building it in {building['dir']}"
            assert waited in said, said[-4000:]
            assert "rm -rf" not in said and first.wait(timeout=600) == 0
        assert built_here(COMM) if own_cache else (folder / f"{COMM.name}.so").exists()
    finally:
        assert leftovers(tag) == []


def compiled(folder):
    """This machine's compiled objects of the comm op, copied into `folder` with their times, no library."""
    shutil.copytree(library(COMM).parent, folder, ignore=shutil.ignore_patterns("*.so", "lock"))


def slow_ninja(folder, seconds: int = 10):
    """A folder holding a `ninja` that waits `seconds` before a build (not before `--version`, torch's check),
    then runs the real one: the build it makes is ninja's own, alive that much longer."""
    folder.mkdir()
    real = shutil.which("ninja")
    (folder / "ninja").write_text(f'#!/bin/sh\n[ "$1" = "--version" ] || sleep {seconds}\nexec {real} "$@"\n')
    (folder / "ninja").chmod(0o755)
    return folder
