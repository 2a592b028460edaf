"""Nothing gaeq starts outlives it — whatever stops the `gaeq` process, SIGKILL included.

A clean stop (a finished group, Ctrl-C, SIGTERM, SIGHUP, a failed rank) kills every rank from the
parent (gaeq.runtime.launch). A killed parent cleans up nothing, so each process it starts binds
its own life to the parent's:

- The ranks' fork server, gaeq's own ranks and the ranks under an external launcher (`gaeq
  worker`) watch the `gaeq` process itself, named in ``GAEQ_PARENT_PID``, through a pidfd (which
  cannot be fooled by a reused PID) and exit the moment it is gone. Watching the process, not the
  parent link, matters: ``PR_SET_PDEATHSIG`` fires when the *parent* dies, and the ranks' parent
  is the fork server (or torchrun), which outlived a killed `gaeq` — the fork server gets EOF and
  raises SystemExit, but its interpreter never finishes shutting down with torch's and
  DeepSpeed's threads loaded, so the ranks it forked trained on, reparented to init.
- Direct children that are not Python of ours (torchrun, DeepSpeed's launcher, ds_to_universal)
  get ``PR_SET_PDEATHSIG`` = SIGKILL from :func:`die_with_parent` as they start; the ranks such a
  launcher starts run `gaeq worker`, which watches `gaeq` as above.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from collections.abc import Callable

PARENT_ENV = "GAEQ_PARENT_PID"
"""The `gaeq` process (the CLI, or the Python process that called gaeq.run) every helper watches."""


def mark_parent() -> None:
    """In the `gaeq` process, before it starts anything: children inherit who to watch."""
    os.environ[PARENT_ENV] = str(os.getpid())


def bind_to_parent() -> bool:
    """In a process gaeq started, directly or not: exit as soon as the `gaeq` process is gone.
    Returns whether it watches (not without ``GAEQ_PARENT_PID``, nor where the OS has no pidfd).

    A process group leader (a rank: it has its own group) takes its group with it — the rank and
    anything it started (a JIT compiler); anything else (the fork server) exits."""
    pid = os.environ.get(PARENT_ENV)
    if not pid or int(pid) == os.getpid() or not hasattr(os, "pidfd_open"):
        return False
    try:
        fd = os.pidfd_open(int(pid))
    except ProcessLookupError:
        _die()  # gone before we got here
    threading.Thread(target=_wait_then_die, args=(fd,), name="gaeq-lifeline", daemon=True).start()
    return True


def _wait_then_die(fd: int) -> None:
    select.select([fd], [], [])  # a pidfd is readable once its process has exited
    _die()


def _die() -> None:
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
"""Looked up here, not in the forked child, where loading a library is not safe."""


def die_with_parent() -> Callable[[], None]:
    """A `preexec_fn` for a child process: SIGKILL when this process (its parent) dies. A child
    that dies takes no descendants with it; those must watch gaeq themselves (:func:`bind_to_parent`).
    Start children from the main thread: the death signal follows the thread that forked."""
    parent = os.getpid()

    def arm() -> None:
        arm_death_signal()
        if os.getppid() != parent:
            os._exit(1)  # the parent died before the death signal was armed

    return arm


def arm_death_signal() -> None:
    """SIGKILL this process when its parent dies (Linux)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
