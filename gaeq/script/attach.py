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
    from gaeq.script.probe import Probe, _rank

    script, args = sys.argv[1], sys.argv[2:]
    probe = Probe.from_env()
    probe.install()
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts its folder first
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        # The script ended (or raised) before the asked steps: what was seen is saved, no trace.
        if probe.step < probe.steps and _rank() == 0:
            probe.save(complete=False)


if __name__ == "__main__":
    main()
