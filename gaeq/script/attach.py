"""``python -m gaeq.script.attach SCRIPT ARGS…``: run a user's script unchanged, as ``python SCRIPT
ARGS…`` would, with gaeq's probe loaded first (gaeq.script.probe). A launcher starts it on every
rank (``torchrun … -m gaeq.script.attach train.py …``), so the script sees the launcher's
environment exactly as it would without gaeq.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m gaeq.script.attach SCRIPT [ARGS...]")
    run(sys.argv[1], sys.argv[2:])


def run(script: str, args: list[str]) -> None:
    """The script under the probe, in this process (its environment already the rank's, with the fp16
    answer gaeq's run forces on DeepSpeed's accelerator, if any: gaeq/accelerator.py)."""
    from gaeq.accelerator import force_fp16_answer, forced_fp16
    from gaeq.contract import OUT_OF_MEMORY_FILE, ran_out_of_memory
    from gaeq.oom import is_out_of_memory
    from gaeq.runtime import crashes
    from gaeq.script.probe import Probe
    from gaeq.script.ranks import rank

    crashes.stacks_to_log()  # a crash in the script's native code: where it was, in the rank's log
    force_fp16_answer(forced_fp16())
    probe = Probe.from_env()
    probe.install()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts its folder first
    try:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        except BaseException as exc:
            if is_out_of_memory(exc):  # a failed allocation: the cell's reason, whatever its peers say of it
                probe.write(OUT_OF_MEMORY_FILE.format(rank=rank()), ran_out_of_memory(exc, script=script))
            raise
        probe.end_of_script()  # ended of itself: a training step still open is complete
    finally:
        # The script ended (or raised) before the asked steps: what was seen is saved, no trace.
        if probe.step < probe.steps and rank() == 0:
            probe.save(complete=False)


def forked_rank(script: str, args: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """A rank forked from gaeq's fork server, which has imported torch already: it becomes what a
    fresh ``python -m gaeq.script.attach SCRIPT ARGS`` would be — its own session, the rank's
    environment (nothing of the server's), the script's folder, its output in `log` — and runs it."""
    import traceback

    from gaeq.runtime import lifeline
    from gaeq.runtime.worker import redirect_fds

    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    # Dies with gaeq, whatever kills it (GAEQ_PARENT_PID is in env), and takes its session — the
    # script's own processes — with it. No death signal tied to the fork server: when gaeq is killed
    # the server exits too, and a rank SIGKILLed for that first would leave its session running.
    lifeline.bind_to_parent()
    os.chdir(cwd)
    redirect_fds(log)
    as_started_fresh()
    code = 0
    try:
        run(script, args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the script's own failure, in its log
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def as_started_fresh() -> None:
    """What the fork server set up before the fork, as a fresh interpreter in the rank's environment
    has it: torch's intra-op threads as OMP_NUM_THREADS says (else one per core this process may run
    on: torch's own default) — the server's pool was sized before the rank's variables were set —
    and torch's, `random`'s and numpy's global generators seeded anew from the OS, as each fresh
    interpreter seeds its own (forked, every rank and every cell would draw the server's numbers:
    an unseeded script would look seeded, the same on every rank); and the signals a launcher's agent
    catches before it starts its workers at their defaults, as exec leaves a caught signal — torchrun's
    (and accelerate's) agent catches those its TORCHELASTIC_SIGNALS_TO_HANDLE names, so its workers
    start with them at their defaults even under `nohup`; DeepSpeed's launcher catches none before, so
    its workers keep what the shell gave (as a forked rank keeps what gaeq was given)."""
    import random
    import signal

    import torch

    for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "").split(","):
        if isinstance(sig := getattr(signal, name.strip(), None), signal.Signals):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)

    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0 else len(os.sched_getaffinity(0)))
    torch.seed()
    random.seed()
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed()


if __name__ == "__main__":
    main()
