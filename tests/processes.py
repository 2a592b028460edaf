"""Processes a test starts: known signal dispositions, a tag, and stopped whatever happens.

The suite may be started plainly, from a background job or CI runner (SIGINT ignored), under
`nohup` (SIGHUP ignored), or both. A child inherits those dispositions, and gaeq keeps a signal it
was started with ignored (gaeq.cli._stop_on_signals), so a test that relies on a signal must set
it in the child: :func:`spawn` sets SIGINT, SIGTERM and SIGHUP to their defaults unless told
otherwise, whatever pytest had.

Every child carries an environment tag (``GAEQ_TEST_TAG``) that everything it starts inherits —
gaeq's fork server and ranks, launchers and their workers, a TensorBoard server — so
:func:`leftovers` finds them all and :func:`owned` stops them all, in a ``finally``: a failing
test never leaves a run training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

from gaeq.runtime import server

REPO_ROOT = Path(__file__).resolve().parents[1]

TAG = "GAEQ_TEST_TAG"
RELIED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals tests send to gaeq, or that gaeq's handling depends on."""

CHILDREN_OF = "children-of:"
"""A tag naming the processes that are the live children of a pid (the session's fork server)."""


def new_tag() -> str:
    return uuid.uuid4().hex


def dispositions(overrides: Mapping[signal.Signals, object] | None = None) -> dict[signal.Signals, object]:
    """Every signal in RELIED_ON → its disposition in the child: the default unless overridden."""
    chosen = {s: signal.SIG_DFL for s in RELIED_ON}
    chosen.update(overrides or {})
    return chosen


def spawn(
    cmd: list[str], *, tag: str, signals: Mapping[signal.Signals, object] | None = None, **popen
) -> subprocess.Popen:
    """Start ``cmd`` tagged, with SIGINT, SIGTERM and SIGHUP set explicitly (:func:`dispositions`)
    and unblocked.

    Output is captured as text (stdout and stderr apart) unless ``popen`` says otherwise."""
    chosen = dispositions(signals)

    def set_dispositions() -> None:  # in the child, between fork and exec
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELIED_ON)
        for sig, handler in chosen.items():
            signal.signal(sig, handler)

    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("text", True)
    popen.setdefault("cwd", REPO_ROOT)
    env = {**os.environ, **popen.pop("env", {}), TAG: tag}
    return subprocess.Popen(cmd, env=env, preexec_fn=set_dispositions, **popen)


@contextmanager
def owned(tag: str, *, grace: float = 5.0) -> Iterator[str]:
    """Whatever the block does — returns, fails an assertion, times out — every process carrying
    ``tag`` is stopped when it ends (:func:`stop_tagged`)."""
    try:
        yield tag
    finally:
        stop_tagged(tag, grace=grace)


@contextmanager
def running(cmd: list[str], *, tag: str | None = None, signals=None, **popen) -> Iterator[subprocess.Popen]:
    """:func:`spawn` inside :func:`owned`: the child and everything it started are stopped on exit.
    The child's tag is ``proc.tag``."""
    with owned(tag or new_tag()) as tag:
        proc = spawn(cmd, tag=tag, signals=signals, **popen)
        proc.tag = tag
        try:
            yield proc
        finally:
            stop(proc)


def run(
    cmd: list[str], *, timeout: float, tag: str | None = None, signals=None, **popen
) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a test: tagged, known dispositions, and on a timeout (or anything
    else) the whole tree is stopped before the exception leaves."""
    with running(cmd, tag=tag, signals=signals, **popen) as proc:
        out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def side_by_side(jobs: Mapping[str, Callable[[], object]], *, lanes: int = 2) -> dict[str, object]:
    """Each job (a function that starts processes and waits for them) run `lanes` at a time, in
    threads: name → what it returned; the first exception is raised once every job has ended.

    For jobs whose processes mostly start and wait — interpreters importing, launchers meeting —, not
    for two that train side by side: DeepSpeed's CPU all-reduce spins while it waits, so two process
    groups on two cores slow each other down several times (docs/tests.md)."""
    with ThreadPoolExecutor(lanes) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        wait(futures.values())
    return {name: future.result() for name, future in futures.items()}


def gaeq_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "gaeq", *args]


def stop(proc: subprocess.Popen, *, grace: float = 20.0) -> None:
    """SIGTERM a child that is still running (gaeq then kills its ranks itself, and its lifeline
    takes anything left), SIGKILL it if it has not gone after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            stream.close()


def stop_tagged(tag: str, *, grace: float = 5.0) -> list[int]:
    """Stop every live process carrying ``tag``: SIGTERM, then SIGKILL what is left after ``grace``
    seconds. Returns the PIDs that had to be stopped (empty when nothing was left)."""
    found = leftovers(tag, grace=0)
    for pid in found:
        _signal(pid, signal.SIGTERM)
    survivors = leftovers(tag, grace=grace)
    for pid in survivors:
        _signal(pid, signal.SIGKILL)
    if leftovers(tag, grace=grace):
        raise RuntimeError(f"processes tagged {tag} survived SIGKILL: {leftovers(tag, grace=0)}")
    return found


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def leftovers(tag: str, *, grace: float = 5.0) -> list[int]:
    """PIDs of live processes that inherited the tag — or, for a ``children-of:`` tag, the live
    children of that pid — polled until none is left or ``grace`` seconds pass."""
    if tag.startswith(CHILDREN_OF):
        parent = int(tag.removeprefix(CHILDREN_OF))
        return _live_processes(lambda proc: _child_of(proc, parent), grace=grace)
    return inheriting(f"{TAG}={tag}", grace=grace)


def inheriting(variable: str, *, grace: float = 5.0) -> list[int]:
    """PIDs of live processes whose environment holds `variable` (``NAME=value``), polled as `leftovers`."""
    marker = b"\0" + variable.encode() + b"\0"
    return _live_processes(lambda proc: marker in b"\0" + (proc / "environ").read_bytes() and _alive(proc), grace=grace)


def _state_and_parent(proc: Path) -> tuple[str, int]:
    stat = (proc / "stat").read_text()
    state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]  # after "pid (comm) "
    return state, int(ppid)


def _alive(proc: Path) -> bool:
    return _state_and_parent(proc)[0] not in ("Z", "X")


def _child_of(proc: Path, parent: int) -> bool:
    state, ppid = _state_and_parent(proc)
    return ppid == parent and state not in ("Z", "X")


def _live_processes(matches, *, grace: float) -> list[int]:
    """PIDs of /proc entries that `matches`, polled until none is left or `grace` seconds pass."""
    deadline = time.monotonic() + grace
    me = os.getpid()
    while True:
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                if matches(entry):
                    pids.append(int(entry.name))
            except OSError:  # the process ended while we looked
                continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)


def start_session_fork_server() -> None:
    """The fork server every in-process run's ranks fork from (:func:`tests.helpers.gaeq_run_here`),
    with every module a fork server may import; started once — by tests/conftest.py as a session
    that will train starts, so that its imports overlap pytest's collection."""
    from gaeq.runtime import lifeline

    lifeline.mark_parent()  # the session's fork server and its ranks die with pytest
    server.start(server.PRELOAD_ORDER)
