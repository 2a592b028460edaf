"""A DeepSpeed op's first use on a machine, as a newcomer meets it (gaeq/runtime/ops.py): a lock a killed
build left is named with the command that clears it, at once — never waited on —; after that command, the
op is built by `gaeq run` itself before any cell starts, shown as progress, and the run trains.

The build is the one this machine pays once anyway, into its own cache, where the comm op was never built
there (a fresh clone's first suite: every later DeepSpeed cell finds it). Where it was, the test's empty
cache is given the objects this machine compiled (`*.o`, ninja's files), not the library: DeepSpeed's
builder then runs as on first use and ninja links the library (~1 s instead of a ~55 s compile that
proves nothing more about gaeq: the compile is DeepSpeed's and torch's)."""

from __future__ import annotations

import os
import shutil
import time
from subprocess import PIPE

import pytest
import yaml

from gaeq.runtime.ops import COMM, STALE_AFTER_S, built_here, library
from tests.helpers import small_spec
from tests.processes import gaeq_command, leftovers, new_tag, run

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
            env = dict(os.environ)
        else:
            compiled(folder)
        built = run(gaeq_command("run", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "b")),
                    timeout=900, tag=tag, env=env, stdout=PIPE, stderr=PIPE, text=True)  # fmt: skip
        said = built.stdout + built.stderr
        assert built.returncode == 0, said[-4000:]
        building = said.index("building ShareMemCommBuilder")
        assert building < said.index("built ShareMemCommBuilder") and "before any cell starts" in said
        assert built_here(COMM) if own_cache else (folder / f"{COMM.name}.so").exists()
    finally:
        assert leftovers(tag) == []


def compiled(folder):
    """This machine's compiled objects of the comm op, copied into `folder` with their times, no library."""
    shutil.copytree(library(COMM).parent, folder, ignore=shutil.ignore_patterns("*.so", "lock"))
