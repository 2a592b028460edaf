"""A pipeline's bubble as measured beside the schedule's theory, at two stages, as GA grows.

    python benchmarks/pipeline_bubble.py [--steps 6] [--n-embd 256]
    python benchmarks/pipeline_bubble.py --tiny     # GA 2 only, 2 steps, n_embd 16: its numbers mean nothing

Runs `gaeq run` on a generated matrix — a GPT of four blocks (wider than the suite's, so that a
stage's compute is not lost in gloo's latency), B = 32 split into GA = 2, 4, 8, 16 micro-batches —
through torch's GPipe, 1F1B and interleaved 1F1B and DeepSpeed's pipeline engine, and prints, per
cell, the bubble measured (the mean share of a step's schedule a rank spent not computing, steps after
the first) beside the theory (pp − 1) / (v·GA + pp − 1), the p2p bytes per step and the step time.
Every cell must also match the baseline (the run's exit code is checked).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

BATCH = 32
MICRO_BATCHES = (16, 8, 4, 2)  # GA 2, 4, 8, 16 at two stages and one data-parallel replica
TINY_MICRO_BATCHES = (16,)  # --tiny: GA 2, every schedule once
TINY = "tiny run (--tiny): the smallest sizes, to keep the code working — its numbers mean nothing"


def matrix(*, steps: int, n_embd: int, micro_batches: tuple[int, ...] = MICRO_BATCHES) -> dict:
    torch_cells = [
        {"trainer": "torch", "world_size": 2, "pipeline_parallel": 2, "pipeline_schedule": s, "micro_batch_size": m}
        for s in ("gpipe", "1f1b", "interleaved_1f1b")
        for m in micro_batches
    ]
    deepspeed_cells = [
        {"trainer": "deepspeed", "world_size": 2, "pipeline_parallel": 2, "zero_stage": 1, "micro_batch_size": m}
        for m in micro_batches
    ]
    return {
        "name": "pipeline_bubble",
        "problem": {
            "model": {"kind": "gpt", "n_layer": 4, "n_head": 4, "n_embd": n_embd},
            "data": {"kind": "tokens", "vocab_size": 256, "seq_len": 64},
            "loss": "cross_entropy",
            "optimizer": {"name": "adamw", "lr": 1.0e-3},
            "steps": steps,
            "train_batch_size": BATCH,
        },
        "cells": torch_cells + deepspeed_cells,
        "noise_floor": False,  # the cells alone: no instrument beside them
        "detection_limit": False,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="Default 6 (2 with --tiny: the bubble counts from 2).")
    parser.add_argument("--n-embd", type=int, default=None, help="Default 256 (16 with --tiny).")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="Every schedule at GA 2, 2 steps, n_embd 16, for the suite: its numbers mean nothing.",
    )
    args = parser.parse_args()
    if args.tiny:
        print(TINY, flush=True)
    steps = args.steps or (2 if args.tiny else 6)
    n_embd = args.n_embd or (16 if args.tiny else 256)
    micro_batches = TINY_MICRO_BATCHES if args.tiny else MICRO_BATCHES
    with tempfile.TemporaryDirectory() as tmp:
        path, out = Path(tmp) / "bubble.yaml", Path(tmp) / "run"
        path.write_text(yaml.safe_dump(matrix(steps=steps, n_embd=n_embd, micro_batches=micro_batches)))
        proc = subprocess.run(
            [sys.executable, "-m", "gaeq", "run", "--matrix", str(path), "--out", str(out)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.exit(f"gaeq run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        report = json.loads((out / "report.json").read_text())
    print(f"{'cell':45} {'GA':>3} {'bubble':>7} {'theory':>7} {'p2p KB/step':>12} {'step ms':>8}")
    for c in report["cells"]:
        if c["pipeline_parallel"] == 1:
            continue
        print(
            f"{c['id']:45} {c['grad_accum_steps']:>3} {c['bubble']:>7.2f} {c['bubble_theory']:>7.2f} "
            f"{c['p2p_bytes_per_step'] / 1024:>12.0f} {c['step_seconds'] * 1e3:>8.1f}"
        )


if __name__ == "__main__":
    main()
