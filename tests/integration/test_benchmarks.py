"""The benchmarks are code the suite runs: each at `--tiny` — every phase of its measurement, with the
same code and print statements, at its smallest sizes — so that a rename breaks a test, not a
measurement months later.

A tiny run's numbers mean nothing (its first line says so) and its targets are printed, never asserted:
what is checked is that it exits 0 (a gaeq run it makes failing fails it) and prints every phase's line.
benchmarks/plain_deepspeed.py runs here as one process (no launcher); under DeepSpeed's launcher at
world 2 it runs inside lab_speed.py's tiny peer check, whose line needs every launch to have trained.
"""

from __future__ import annotations

import sys
from functools import partial

import pytest

from tests.conftest import REPO
from tests.helpers import deepspeed_shm, shm_left
from tests.processes import run, side_by_side

pytestmark = pytest.mark.integration

PHASES = {
    "lab_speed.py": (
        "process groups reused",  # (its docstring's 2.) wall against in-loop
        "the same with --lanes 1",
        "cost columns: world-1 cells' step time in a lane",
        "isolate / reuse",  # 1.
        "peer check",  # 4. one DeepSpeed launch per configuration against one gaeq run
        "training loops alone",
        "per optimizer step",  # 3. the trainer against a bare loop, and recording
        "gaeq trainer ÷ bare loop generating as it goes",
        "recording/instrumentation",
        "trainer minus the generating bare loop minus recording",
    ),
    "plain_deepspeed.py": ("step 0 loss", "step 1 loss", "trained in"),
    "snapshot_cost.py": ("mlp: untracked", "gpt: untracked"),
    "noise_floor.py": ("false alarms / missed controls", "\nfp32 ", "\nbf16@gpt_43k ", "figure: /"),
    "detection_limit.py": (  # (it exits 1 when a planted split contradicts the limit: both ways, in every split)
        "| tiny.yaml | fp32 |",
        "(2 ×) | 2/2 |",
        "(0.33 ×) | 0/2 |",
        "verdicts contradicting the limit (missed at 2 ×, or caught by the loss or grad norm at a third): 0",
    ),
    "script_speed.py": (
        "splits through gaeq run",
        "plain torchrun launches",
        "plain launches (target: fewer than 3",
        "probe overhead at",
    ),
    "suite_time.py": (
        "folder                tests   seconds   core-s",
        "tests/unit",
        "unit tests",
        " 0 failed; pytest: exit 0",  # what the run came to, beside its time
        "busy core-seconds:",
        "slowest tests",
    ),
    "trainer_sequence_parallel.py": ("w1 GA 1 ", "sp2 GA 2 ", "× w1 GA 1's"),  # (its TINY_RUNS)
    "target_weights.py": ("torch threads:", "| 2 × 16 × 64 |"),
    "pipeline_bubble.py": (
        "bubble  theory  p2p KB/step",
        "torch-w2-pp2-gpipe-",
        "torch-w2-pp2-1f1b-",
        "torch-w2-pp2-interleaved_1f1b-",
        "deepspeed-z1-w2-pp2-1f1b-",
    ),
}
"""Benchmark → a substring of each line it prints (one a phase, or a part of its table)."""
TIMEOUT = {"lab_speed.py": 480}
"""Seconds, generous on the one core of a worker (tests/workers.py) that a loaded machine shares: alone on 2 cores,
lab_speed's tiny run takes ~35 s, script_speed's ~20 s, the others < 16 s (the rest: 240 s)."""


LANES = 2
"""Tiny runs side by side: most of one is start-up (imports, a fork server), one core each."""


@pytest.fixture(scope="module")
def tiny_runs():
    """Every benchmark at --tiny, LANES at a time, the longest first; each with what it left behind."""
    shm_before = deepspeed_shm()
    figure = (REPO / "docs" / "noise_floor.png").stat().st_mtime_ns  # a tiny run never draws over it

    def tiny(name: str):
        return run([sys.executable, str(REPO / "benchmarks" / name), "--tiny"], timeout=TIMEOUT.get(name, 240))

    order = sorted(PHASES, key=lambda name: -TIMEOUT.get(name, 0))
    done = side_by_side({name: partial(tiny, name) for name in order}, lanes=LANES)
    left = shm_left(shm_before, set())  # (a gaeq beside the suite, its groups marked, is not theirs)
    return done, left, (REPO / "docs" / "noise_floor.png").stat().st_mtime_ns == figure


@pytest.mark.parametrize("name", PHASES)  # not `benchmark`: pytest-benchmark's fixture has that name
def test_every_phase_runs_at_tiny_size(name, tiny_runs):
    done, _, _ = tiny_runs
    proc = done[name]
    said = f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    assert proc.stdout.startswith("tiny run (--tiny):") and "mean nothing" in proc.stdout.splitlines()[0], said
    assert [phase for phase in PHASES[name] if phase not in proc.stdout] == [], said


def test_the_tiny_runs_leave_nothing_behind(tiny_runs):
    """A launch of a plain DeepSpeed script leaves its comm op's segments in /dev/shm (lab_speed frees
    them); the noise floor's figure in docs/ is drawn by a full run only."""
    _, left, figure_untouched = tiny_runs
    assert left == [] and figure_untouched
