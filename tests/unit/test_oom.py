"""Out of memory told from what a process left (gaeq/oom.py): a failed allocation's exception, and the kernel's
word on a SIGKILL — a real allocation failure and, where this machine lets a test make a memory cgroup, a real
kill by the OOM killer, each beside a control that is not one."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
import torch

from gaeq import oom
from tests.processes import running


def test_a_failed_allocation_is_out_of_memory_wherever_it_sits_in_the_chain():
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(1 << 60, dtype=torch.uint8)  # torch's CPU allocator fails for real: no machine has an EiB
    assert "can't allocate memory" in str(cpu.value)
    assert oom.is_out_of_memory(cpu.value)
    assert oom.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.is_out_of_memory(MemoryError())
    try:  # a script that wraps it (Lightning, a retry loop) still ran out of memory
        try:
            raise cpu.value
        except RuntimeError as exc:
            raise ValueError("the training step failed") from exc
    except ValueError as wrapped:
        assert oom.is_out_of_memory(wrapped)
    # controls: failures that are not an allocation's
    assert not oom.is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"))
    assert not oom.is_out_of_memory(KeyboardInterrupt())
    assert not oom.is_out_of_memory(None)


def test_a_sigkill_is_the_oom_killers_as_sure_as_the_kernel_says(monkeypatch):
    """Each level of sureness from what the kernel lets be read (its log, its count of kills), and the control:
    a count that did not rise means someone else sent the signal."""
    log = "[ 235.6] Memory cgroup out of memory: Killed process 2905 (python) total-vm:221432kB\n"
    monkeypatch.setattr(oom, "kernel_log", lambda: log)
    monkeypatch.setattr(oom, "kill_count", lambda: 8)
    said = oom.oom_killer(2905, before=7)
    assert said.sure is oom.Sure.SURE and said.out_of_memory and "2905" in said.evidence
    said = oom.oom_killer(3000, before=7)  # another pid in its log (a container's pids are not the kernel's)
    assert said.sure is oom.Sure.LIKELY and said.out_of_memory and "rose by 1" in said.evidence
    assert oom.oom_killer(3000, before=8) is None  # no kill while it ran: not the OOM killer
    monkeypatch.setattr(oom, "kernel_log", lambda: None)
    monkeypatch.setattr(oom, "kill_count", lambda: None)
    said = oom.oom_killer(3000, before=None)
    assert said.sure is oom.Sure.UNKNOWN and not said.out_of_memory


@contextlib.contextmanager
def memory_cgroup(limit: int):
    """A memory cgroup of `limit` bytes (cgroup v2, else v1), removed after; skips where none can be made."""
    name = f"gaeq-test-{uuid.uuid4().hex[:8]}"
    for root, limit_file in (
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
    ):
        group = root / name
        if not (root / limit_file).parent.is_dir() or not (root / "cgroup.procs").is_file():
            continue
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            (group / limit_file).write_text(str(limit))
            (group / "memory.swap.max").write_text("0") if (group / "memory.swap.max").exists() else None
            yield group
            return
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                group.rmdir()
    pytest.skip("no memory cgroup can be made here (not root, or no writable cgroup file system)")


def test_a_process_the_oom_killer_kills_is_named_so_and_one_killed_otherwise_is_not(tmp_path):
    grow = "import sys\nx = []\nwhile True: x.append(bytearray(8 << 20))\n"
    with memory_cgroup(64 << 20) as group:
        before = oom.kill_count()
        joined = f"echo $$ > {group / 'cgroup.procs'} && exec {sys.executable} -c '{grow}'"
        with running(["bash", "-c", joined]) as child:
            assert child.wait(timeout=60) == -signal.SIGKILL
            said = oom.oom_killer(child.pid, before=before)
    assert said is not None and said.out_of_memory, said
    assert said.sure in (oom.Sure.SURE, oom.Sure.LIKELY)
    # the control: a process gaeq (or anyone) kills is not the OOM killer's
    before = oom.kill_count()
    with running([sys.executable, "-c", "import time; time.sleep(60)"]) as child:
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        said = oom.oom_killer(child.pid, before=before)
    assert said is None or not said.out_of_memory
