"""tests/processes.py: a child's signal dispositions do not depend on how the suite was started,
and what a test starts is stopped however the test ends."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager

import pytest

from tests.processes import RELIED_ON, leftovers, new_tag, owned, running, spawn

SHOW = (
    "import sys; status = open('/proc/self/status').read().splitlines();"
    "mask = {l.split()[0]: int(l.split()[1], 16) for l in status if l.startswith(('SigIgn', 'SigBlk'))};"
    "print(*((mask['SigIgn:'] | mask['SigBlk:']) >> (s - 1) & 1 for s in (2, 15, 1)), flush=True); sys.stdin.read()"
)
"""A child that prints, as the kernel sees it, whether SIGINT, SIGTERM, SIGHUP would fail to reach
it (1: ignored or blocked, 0: delivered), then waits."""

SLEEP = "import sys, time; print('ready', flush=True); time.sleep(120)"


@contextmanager
def parent_ignoring(*signals):
    """This process (pytest) with the signals ignored, as under `nohup` or in a background job."""
    before = {s: signal.getsignal(s) for s in signals}
    try:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def dispositions_of_a_child(**kwargs) -> list[int]:
    with running([sys.executable, "-c", SHOW], stdin=-1, **kwargs) as proc:
        line = proc.stdout.readline()
    return [int(v) for v in line.split()]


def test_a_child_gets_the_default_dispositions_whatever_the_parent_ignores():
    assert RELIED_ON == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    with parent_ignoring(signal.SIGINT, signal.SIGHUP):
        assert dispositions_of_a_child() == [0, 0, 0]
        ignored_sigint = dispositions_of_a_child(signals={signal.SIGINT: signal.SIG_IGN})
        assert ignored_sigint == [1, 0, 0]


def test_the_control_a_plain_child_inherits_what_the_parent_ignores():
    """Why the helper exists: without it, a child of a `nohup` pytest ignores SIGHUP."""
    import subprocess

    with parent_ignoring(signal.SIGINT, signal.SIGHUP):
        with owned(new_tag()) as tag:
            proc = subprocess.Popen(
                [sys.executable, "-c", SHOW], stdin=-1, stdout=-1, text=True, env={"GAEQ_TEST_TAG": tag}
            )
            line = proc.stdout.readline()
            proc.kill()
            proc.wait()
    assert [int(v) for v in line.split()] == [1, 0, 1]


def test_a_child_of_a_parent_ignoring_sighup_still_stops_on_sighup():
    with parent_ignoring(signal.SIGINT, signal.SIGHUP):
        with running([sys.executable, "-c", SLEEP]) as proc:
            assert proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGHUP)
            assert proc.wait(timeout=30) == -signal.SIGHUP


def test_a_failing_block_stops_every_tagged_process_it_started():
    """Two tagged children — one that ignores SIGTERM, so only SIGKILL stops it — and a block that
    fails: nothing with the tag is left."""
    tag = new_tag()
    with pytest.raises(AssertionError, match="on purpose"):
        with owned(tag, grace=1.0):
            stubborn = spawn([sys.executable, "-c", SLEEP], tag=tag, signals={signal.SIGTERM: signal.SIG_IGN})
            plain = spawn([sys.executable, "-c", SLEEP], tag=tag)
            assert stubborn.stdout.readline().strip() == plain.stdout.readline().strip() == "ready"
            assert sorted(leftovers(tag, grace=0)) == sorted([stubborn.pid, plain.pid])
            raise AssertionError("a test failing on purpose")
    assert leftovers(tag, grace=0) == []
    assert stubborn.wait(timeout=5) == -signal.SIGKILL and plain.wait(timeout=5) == -signal.SIGTERM
