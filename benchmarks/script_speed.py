"""A user's script checked across splits: gaeq against the launches a user would make by hand.

    python benchmarks/script_speed.py [--steps 6]
    python benchmarks/script_speed.py --tiny     # one split, 2 steps, for the suite: its numbers mean nothing

Eight splits of experiments/scripts/ddp_manual.py at a global batch of 32 (world 1: micro 4, 8, 16,
32; world 2: micro 2, 4, 8, 16): once through `gaeq run` (the script unchanged, every rank probed,
compared with the baseline), once as eight plain `torchrun` launches of the script, each with one thread
per rank as gaeq's ranks have. Prints both wall times and the target: eight splits through gaeq in less
wall time than three plain launches. Then the probe's overhead per step, for the script's model at
10.8 M parameters (world 1, micro-batch 32): its step under gaeq against a plain run's, and the probe's
own seconds as it measures them (`probe_seconds` in probe.json).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "scripts" / "ddp_manual.py"
SPLITS = [(1, 4), (1, 8), (1, 16), (1, 32), (2, 2), (2, 4), (2, 8), (2, 16)]
TINY_SPLITS = [(2, 16)]
"""--tiny: one split (world 2, so that gaeq compares it with the baseline it adds)."""
BATCH = 32
WIDE = ["--d_model", "640", "--hidden", "8192"]
"""ddp_manual.py's model at 10.8 M parameters, for the probe's overhead (--tiny: its default width)."""
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""What every rank of gaeq's runs with (and torchrun gives two workers): plain launches alike, so that
like is compared with like (torchrun leaves a single worker torch's default, a thread per core)."""
TINY = "tiny run (--tiny): the smallest sizes, to keep the code working — its numbers mean nothing"


def through_gaeq(steps: int, out: Path, splits: list[tuple[int, int]]) -> float:
    spec = {
        "name": "script_speed",
        "script": {
            "path": str(SCRIPT),
            "args": [
                "--batch_size",
                "{micro_batch_size}",
                "--grad_accum",
                "{grad_accum_steps}",
                "--max_steps",
                "{steps}",
            ],
        },
        "steps": steps,
        "train_batch_size": BATCH,
        "noise_floor": False,  # the eight splits only (the baseline is one of them): no instrument beside them
        "detection_limit": False,
        "cells": [{"world_size": w, "micro_batch_size": m} for w, m in splits],
    }
    matrix = out / "speed.yaml"
    matrix.write_text(yaml.safe_dump(spec))
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "gaeq", "run", "--matrix", str(matrix), "--out", str(out / "run")],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"gaeq run failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return seconds


def plain_launches(steps: int, splits: list[tuple[int, int]]) -> list[float]:
    times = []
    for world, micro in splits:
        ga = BATCH // (world * micro)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(world),
            str(SCRIPT),
        ]
        cmd += ["--batch_size", str(micro), "--grad_accum", str(ga), "--max_steps", str(steps)]
        times.append(timed_launch(cmd))
    return times


def timed_launch(cmd: list[str]) -> float:
    """Seconds of one plain launch. A launch that fails is started once more (seen once in ~10 suite runs
    on a loaded host: a worker of the plain script exiting 1 at world 2, never reproduced alone); a second
    failure ends the benchmark with the launch's own output."""
    for attempt in (1, 2):
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=SCRIPT.parent, env={**os.environ, **ONE_THREAD})
        if proc.returncode == 0:
            return time.perf_counter() - started
    sys.exit(
        f"plain launch failed twice ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    )


def probe_overhead(steps: int, out: Path, width: list[str]) -> tuple[float, float, float, int]:
    """The probe's cost per step at world 1, micro-batch 32: (step seconds under gaeq — the trace's, steps
    after the first —, a plain run's step seconds — (t(2n) − t(n)) / n, its start-up cancelled —, the probe's
    own seconds per step as it measured them, the model's parameters)."""
    import json

    args = ["--batch_size", "32", "--grad_accum", "1", *width]
    spec = {
        "name": "probe_overhead",
        "script": {"path": str(SCRIPT), "args": [*args, "--max_steps", "{steps}"]},
        "steps": steps,
        "train_batch_size": BATCH,
        "noise_floor": False,
        "detection_limit": False,
        "baseline": {"world_size": 1, "micro_batch_size": BATCH},  # the one cell: the baseline
        "cells": [{"world_size": 1, "micro_batch_size": BATCH}],
    }
    (out / "overhead.yaml").write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "gaeq", "run", "--matrix", str(out / "overhead.yaml"), "--out", str(out / "overhead")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"gaeq run failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    cell = out / "overhead" / "cells" / "script-w1-mb32-ga1"
    probed = json.loads((cell / "probe.json").read_text())["steps"][1:]
    gaeq_step = sum(r["seconds"] for r in probed) / len(probed)
    probe_step = sum(r["probe_seconds"] for r in probed) / len(probed)
    plain = []
    for n in (steps, 2 * steps):
        started = time.perf_counter()
        subprocess.run([sys.executable, str(SCRIPT), *args, "--max_steps", str(n)], check=True, capture_output=True,
                       cwd=SCRIPT.parent, env={**os.environ, **ONE_THREAD})  # fmt: skip
        plain.append(time.perf_counter() - started)
    parameters = _parameters(width)
    return gaeq_step, (plain[1] - plain[0]) / steps, probe_step, parameters


def _parameters(width: list[str]) -> int:
    d, hidden = int(width[1]), int(width[3])
    vocab = 32  # ddp_manual.py's
    return 2 * vocab * d + (2 * d + 1) * hidden + (hidden + 1) * vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="Default 6 (2 with --tiny).")
    parser.add_argument(
        "--tiny", action="store_true", help="One split of 2 steps, for the suite: its numbers mean nothing."
    )
    args = parser.parse_args()
    if args.tiny:
        print(TINY, flush=True)
    steps = args.steps or (2 if args.tiny else 6)
    splits = TINY_SPLITS if args.tiny else SPLITS
    n = len(splits)
    with tempfile.TemporaryDirectory(prefix="gaeq-script-speed-") as folder:
        gaeq = through_gaeq(steps, Path(folder), splits)
        width = ["--d_model", "32", "--hidden", "256"] if args.tiny else WIDE
        gaeq_step, plain_step, probe_step, parameters = probe_overhead(steps + 1, Path(folder), width)
    plain = plain_launches(steps, splits)
    per_launch = sum(plain) / len(plain)
    print(f"{n} splits through gaeq run: {gaeq:.1f} s ({gaeq / n:.2f} s a split, probed and judged)")
    print(f"{n} plain torchrun launches: {sum(plain):.1f} s ({per_launch:.2f} s a launch, nothing compared)")
    print(
        f"gaeq's {n} splits = {gaeq / per_launch:.1f} plain launches (target: fewer than 3 — "
        f"{'met' if gaeq < 3 * per_launch else 'missed'})"
    )
    print(
        f"probe overhead at {parameters / 1e6:.1f} M parameters (world 1, micro-batch 32, one thread): a step "
        f"{gaeq_step * 1e3:.1f} ms under gaeq, {plain_step * 1e3:.1f} ms plain → {gaeq_step / plain_step - 1:+.1%}; "
        f"the probe's own work {probe_step * 1e3:.2f} ms a step = {probe_step / gaeq_step:.1%} of it"
    )


if __name__ == "__main__":
    main()
