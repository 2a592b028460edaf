"""How a rank's process ended, in words — the code it exited with, or the signal that killed it —
and, when its native code crashed, where it was: every process gaeq starts to train (its own ranks,
a user's script's) writes each thread's Python stack to its log as it dies of such a signal."""

from __future__ import annotations

import faulthandler
import signal

CRASHES = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})
"""The signals a process gets from its own native code when it fails (a bad pointer, an abort)."""


def stacks_to_log() -> None:
    """From here on, a crash in native code writes each thread's Python stack to fd 2 — the rank's
    log — before the process dies of it, as ``python -X faulthandler`` does. It changes no number."""
    faulthandler.enable(all_threads=True)


def how_it_ended(code: int) -> str:
    """A process's exit code (`Popen.returncode`, `Process.exitcode`: minus the signal that killed
    it) in words, e.g. "exited with code 1", "was killed by SIGSEGV (signal 11: a crash in native
    code, its Python stack in its log)"."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"was killed by signal {-code}"
    crash = ": a crash in native code, its Python stack in its log" if sig in CRASHES else ""
    return f"was killed by {sig.name} (signal {-code}{crash})"


REPORT_LINES = 24
"""At most this many lines of a crash report are shown with the error (the whole is in the log)."""


def report_in(lines: list[str]) -> list[str] | None:
    """The crash report at the end of a log (what `stacks_to_log` has Python write as the process
    dies): the signal, then each thread's stack — the crashing thread's first, where it is a Python
    thread —, without its list of extension modules; None where the log holds none."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error: ")]
    if not starts:
        return None
    head, *rest = lines[starts[-1] :]
    threads: list[list[str]] = []
    for line in rest:
        if line.startswith(("Current thread 0x", "Thread 0x")):
            threads.append([line])
        elif threads and line.startswith("  "):
            threads[-1].append(line)
    threads.sort(key=lambda block: not block[0].startswith("Current thread"))  # stable: the rest in order
    return [head, *(line for block in threads for line in block)][:REPORT_LINES]
