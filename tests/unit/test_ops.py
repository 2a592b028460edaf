"""DeepSpeed's ops a run needs (gaeq/runtime/ops.py): which, and a dead build's lock told from a live one."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from gaeq.matrix import load_matrix
from gaeq.runtime.ops import ASYNC_IO, COMM, CPU_ADAM, FUSED_ADAM, STALE_AFTER_S, needed, stale
from tests.helpers import small_spec
from tests.processes import running


def ops_of(tmp_path, **overrides) -> list:
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(small_spec(**overrides)))
    matrix = load_matrix(tmp_path / "m.yaml")
    return needed(matrix.runnable(), matrix.problems)


def test_the_ops_a_matrix_needs(tmp_path, monkeypatch):
    assert ops_of(tmp_path) == []  # torch alone builds nothing
    assert ops_of(tmp_path, axes={"trainer": ["torch", "deepspeed"], "zero_stage": [1]}) == [COMM]
    nvme = {"trainer": "deepspeed", "micro_batch_size": 4, "zero_stage": 3, "offload": "nvme"}
    # the machine's answer forced both ways (a fresh machine may have no libaio; CI installs it)
    monkeypatch.setattr("gaeq.accelerator.nvme_unsupported_reason", lambda: None)
    assert ops_of(tmp_path, cells=[nvme]) == [COMM, ASYNC_IO]
    monkeypatch.setattr("gaeq.accelerator.nvme_unsupported_reason", lambda: "no libaio: apt-get install libaio-dev")
    assert ops_of(tmp_path, cells=[nvme]) == []  # the nvme cell skipped, with the reason: nothing to build
    config = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "train_batch_size": 16}
    mine = ("optimizer", "schedule", "gradient_clipping")  # (the config's, with a deepspeed_config)
    problem = {k: v for k, v in small_spec()["problem"].items() if k not in mine} | {"deepspeed_config": config}
    offload = {"trainer": "deepspeed", "micro_batch_size": 4, "zero_stage": 2, "offload": "cpu"}
    axes = {"trainer": ["deepspeed"], "world_size": [1], "micro_batch_size": [4], "zero_stage": [1]}
    adam = {"problem": problem, "axes": axes, "cells": [offload]}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({**small_spec(), **adam}))
    matrix = load_matrix(tmp_path / "a.yaml")
    # DeepSpeed's own Adam, as configured: fused, and its CPU Adam where the optimizer is offloaded
    assert needed(matrix.runnable(), matrix.problems) == [COMM, FUSED_ADAM, CPU_ADAM]


def test_a_scripts_own_config_that_asks_deepspeeds_adam_builds_it_before_any_cell(tmp_path):
    """A script's deepspeed_config is built into its engine as it is: its Adam without torch_adam is FusedAdam,
    a first-use build (#75) said and done before any cell starts, not inside a cell's deadline."""
    from tests.helpers import REPO_ROOT

    source = REPO_ROOT / "experiments"
    spec = yaml.safe_load((source / "your_deepspeed_script.yaml").read_text())
    config = json.loads((source / "scripts" / "ds_config.json").read_text())
    spec["script"]["path"] = str(source / "scripts" / "deepspeed_engine.py")
    for torch_adam, expected in ((True, [COMM]), (False, [COMM, FUSED_ADAM])):
        config["optimizer"]["params"]["torch_adam"] = torch_adam
        spec["script"]["deepspeed_config"] = config
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
        matrix = load_matrix(tmp_path / "s.yaml")
        assert needed(matrix.runnable(), matrix.problems) == expected


def test_a_lock_is_a_dead_builds_only_when_old_alone_and_no_process_builds_there(tmp_path):
    folder, library = tmp_path / "async_io", tmp_path / "async_io" / "async_io.so"
    folder.mkdir()
    assert not stale(folder, library)  # no lock: nothing to say
    (folder / "lock").touch()
    assert not stale(folder, library)  # a fresh lock: a build may have just begun
    old = time.time() - 2 * STALE_AFTER_S
    os.utime(folder / "lock", (old, old))
    assert stale(folder, library)  # old, no library, nobody compiling: a killed build's
    with running([sys.executable, "-c", "import time; time.sleep(60)", str(folder)]):  # its compiler, say
        time.sleep(0.2)
        assert not stale(folder, library)
    (folder / "build").mkdir()
    with running([sys.executable, "-c", "import time; time.sleep(60)"], cwd=folder / "build"):  # ninja: relative
        time.sleep(0.2)  # targets, the folder named nowhere in its command line, only where it works
        assert not stale(folder, library)
    assert stale(folder, library)  # and gone again: a killed build's
    library.touch()
    assert not stale(folder, library)  # built: the lock is harmless


@pytest.mark.integration  # starts processes of its own
@pytest.mark.parametrize("builder", ["ShareMemCommBuilder"])
def test_a_planted_dead_lock_is_named_with_the_command_that_clears_it(tmp_path, monkeypatch, builder):
    """The process that builds reports the stale lock instead of waiting on it (torch's FileBaton would)."""
    from gaeq.runtime.ops import StaleBuild, ensure_built

    folder = tmp_path / "deepspeed_shm_comm"
    folder.mkdir()
    (folder / "lock").touch()
    os.utime(folder / "lock", (time.time() - 2 * STALE_AFTER_S,) * 2)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    events = []
    started = time.perf_counter()
    with pytest.raises(StaleBuild) as caught:
        ensure_built([COMM], events.append)
    assert f"rm -rf {folder}" in str(caught.value) and "a killed build's" in str(caught.value)
    assert events == [] and time.perf_counter() - started < 60  # named at once, nothing built, nothing waited on


def test_a_build_stopped_midway_takes_its_compilers_with_it(monkeypatch, tmp_path):
    """Ctrl-C while an op builds: the build process and every compiler it started (its group) are gone — a killed
    build's compiler would write on into the folder the next run finds locked."""
    from gaeq.runtime import ops
    from gaeq.runtime.events import EventKind

    started = tmp_path / "compiler.pid"
    build = (  # a stand-in build: a compiler of its own that outlives it unless its group is stopped
        "import json, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(started)!r}, 'w').write(str(child.pid))\n"
        "print(json.dumps({'state': 'building', 'dir': 'x'}), flush=True)\n"
        "time.sleep(120)\n"
    )
    monkeypatch.setattr(ops, "build_command", lambda op: [sys.executable, "-c", build])
    monkeypatch.setattr(ops, "built_here", lambda op: False)

    def interrupt(event):
        if event.kind == EventKind.BUILD:
            raise KeyboardInterrupt  # Ctrl-C as the build runs

    compiler = None
    try:
        with pytest.raises(KeyboardInterrupt):
            ops.ensure_built([ops.COMM], interrupt)
        compiler = int(started.read_text())
        time.sleep(0.2)
        assert not Path(f"/proc/{compiler}").exists() or "Z" in Path(f"/proc/{compiler}/stat").read_text().split()[2]
    finally:
        if compiler is not None and Path(f"/proc/{compiler}").exists():
            os.kill(compiler, 9)
