"""What tracking params/grads costs per optimizer step, in-process (torch trainer, world 1).

    python benchmarks/snapshot_cost.py [--repeats 5]
    python benchmarks/snapshot_cost.py --tiny     # 1 repeat of 2 steps, for the suite: its numbers mean nothing

Prints the median seconds per optimizer step with and without `track: [params, grads]` for the
default MLP and GPT problems, and the overhead. Untracked runs pay nothing: no tensor is copied.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from gaeq.matrix import load_matrix
from gaeq.trainers import RunContext, trainer_for

TINY = "tiny run (--tiny): the smallest sizes, to keep the code working — its numbers mean nothing"

PROBLEMS = {
    "mlp": {"model": {"kind": "mlp", "hidden": 64}, "data": {"kind": "regression"}, "loss": "mse"},
    "gpt": {"model": {"kind": "gpt"}, "data": {"kind": "tokens"}, "loss": "cross_entropy"},
}


def seconds_per_step(problem: dict, track: list[str], *, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "name": "bench",
            "problem": {**problem, "steps": steps, "train_batch_size": 32, "gradient_clipping": 1.0},
            "axes": {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [8]},
            "track": track,
        }
        path = Path(tmp) / "m.yaml"
        path.write_text(yaml.safe_dump(spec))
        matrix = load_matrix(path)
        cell = next(c for c in matrix.cells if c.micro_batch_size == 8)
        cell_dir = Path(tmp) / "cell"
        cell_dir.mkdir()
        ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), cell_dir=cell_dir)
        started = time.perf_counter()
        trainer_for("torch")(cell=cell, problem=matrix.problem, ctx=ctx)  # includes writing the files
        return (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=None, help="Default 5 (1 with --tiny).")
    parser.add_argument("--steps", type=int, default=None, help="Default 40 (2 with --tiny).")
    parser.add_argument(
        "--tiny", action="store_true", help="One repeat of 2 steps, for the suite: its numbers mean nothing."
    )
    args = parser.parse_args()
    if args.tiny:
        print(TINY, flush=True)
    repeats = args.repeats or (1 if args.tiny else 5)
    steps = args.steps or (2 if args.tiny else 40)
    torch.set_num_threads(1)
    for name, problem in PROBLEMS.items():
        timings = {}
        for label, track in (
            ("untracked", ["loss", "grad_norm"]),
            ("params+grads", ["loss", "grad_norm", "params", "grads"]),
        ):
            seconds_per_step(problem, track, steps=3)  # warm-up
            runs = [seconds_per_step(problem, track, steps=steps) for _ in range(repeats)]
            timings[label] = statistics.median(runs)
        overhead = timings["params+grads"] / timings["untracked"] - 1
        print(
            f"{name}: untracked {timings['untracked'] * 1e3:.2f} ms/step, "
            f"params+grads {timings['params+grads'] * 1e3:.2f} ms/step ({overhead:+.1%})"
        )


if __name__ == "__main__":
    main()
