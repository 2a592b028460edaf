"""gaeq/runtime/crashes.py: a process that crashes in native code is named by the signal that killed
it, and the error shows where it was — each thread's stack, the crashing thread's first — from its log."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from gaeq.runtime.cells import log_tail
from gaeq.runtime.crashes import how_it_ended
from tests.conftest import REPO

CRASH = textwrap.dedent(
    """
    import ctypes, threading, time
    {setup}
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()

    def read_nothing():
        ctypes.string_at(0)  # a bad pointer, as a bug in a library's native code reads one

    read_nothing()
    """
)


def crash(tmp_path, setup: str) -> tuple[int, str]:
    """A child that crashes with a segmentation fault, its output in rank1.log: its exit code and the log's
    tail as an error shows it. SIGSEGV raised by the process's own fault cannot be ignored or blocked:
    its disposition does not depend on how the suite was started."""
    log = tmp_path / "rank1.log"
    with log.open("w") as out:
        code = subprocess.run(
            [sys.executable, "-c", CRASH.format(setup=setup)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, timeout=60,
        ).returncode  # fmt: skip
    return code, log_tail(log)


def test_a_crash_in_native_code_is_named_and_the_error_shows_each_threads_stack(tmp_path):
    code, tail = crash(tmp_path, "from gaeq.runtime import crashes; crashes.stacks_to_log()")
    assert code == -signal.SIGSEGV
    said = "was killed by SIGSEGV (signal 11: a crash in native code, its Python stack in its log)"
    assert how_it_ended(code) == said
    lines = tail.splitlines()
    assert lines[:2] == ["--- rank1.log (its crash report) ---", "Fatal Python error: Segmentation fault"]
    assert lines[2].startswith("Current thread 0x")  # the crashing thread first, at the frame that crashed
    assert "in string_at" in lines[3] and "in read_nothing" in lines[4]
    assert any(line.startswith("Thread 0x") for line in lines[5:])  # then where the others were
    assert "Extension modules" not in tail


def test_the_control_a_crash_without_it_leaves_no_stack(tmp_path):
    code, tail = crash(tmp_path, "")
    assert code == -signal.SIGSEGV and tail == ""


@pytest.mark.parametrize(
    "code, said",
    [
        (0, "exited with code 0"),
        (17, "exited with code 17"),
        (-signal.SIGKILL, "was killed by SIGKILL (signal 9)"),
        (-signal.SIGABRT, "was killed by SIGABRT (signal 6: a crash in native code, its Python stack in its log)"),
        (-200, "was killed by signal 200"),
    ],
)
def test_an_exit_code_in_words(code, said):
    assert how_it_ended(code) == said
