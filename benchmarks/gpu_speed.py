"""Speed on one device: gaeq's torch and DeepSpeed trainers against bare loops of the same model, data,
optimiser and split — seconds per optimizer step, and so samples/s. Part of the GPU check
(benchmarks/gpu_check.py); runnable alone:

    python benchmarks/gpu_speed.py MATRIX.yaml [--steps 12]     # a GPU where there is one, else the CPU

Each bare loop does what the trainer's step does and nothing else: the batches generated as it goes
(as the trainer generates them), the loss summed over the micro-batch and divided by the step's valid
tokens, clipping, the optimizer and the schedule; the DeepSpeed one through `deepspeed.initialize` with
the config gaeq writes for the cell (engine.backward divides by GA itself: the loss is handed to it × GA).
The trainers' seconds per step are their traces' (the in-loop time of each step). Steps 0 and 1 are
warm-up (allocator, kernels chosen, DeepSpeed's first step); the median of the rest is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

WARMUP = 2
"""Steps left out of every median: the first steps pay the allocator's and the kernels' first use."""


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_indices(plan, step: int) -> list[list[int]]:
    return [plan.sample_indices(step=step, micro_step=k, rank=0) for k in range(plan.grad_accum_steps)]


def bare_torch(cell, problem, device, steps: int) -> list[float]:
    """Seconds per optimizer step of a plain PyTorch loop over the cell's split."""
    import torch

    from gaeq.problem.build import build_problem
    from gaeq.problem.optim import build_optimizer, build_scheduler
    from gaeq.trainers.base import plan_of

    torch.manual_seed(problem.seed)
    built = build_problem(problem)
    model = built.model.to(device)
    optimizer = build_optimizer(model.named_parameters(), problem)
    scheduler = build_scheduler(optimizer, problem)
    plan, seconds = plan_of(cell, problem), []
    for step in range(steps):
        started = time.perf_counter()
        micro = step_indices(plan, step)
        tokens = built.dataset.total_loss_elements([i for m in micro for i in m])
        for indices in micro:
            x, y = built.dataset.batch(indices)
            (built.loss_sum(model(x.to(device)), y.to(device)) / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), problem.gradient_clipping)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def bare_deepspeed(cell, problem, device, steps: int) -> list[float]:
    """Seconds per optimizer step of a plain DeepSpeed loop: the engine gaeq's config builds, stepped
    after every micro-batch as DeepSpeed's docs write it."""
    import deepspeed
    import torch

    from gaeq.problem.build import build_problem
    from gaeq.problem.optim import build_scheduler
    from gaeq.trainers.base import plan_of
    from gaeq.trainers.deepspeed_config import deepspeed_config

    torch.manual_seed(problem.seed)
    built = build_problem(problem)
    config = deepspeed_config(cell, problem)
    engine, *_ = deepspeed.initialize(
        model=built.model, model_parameters=built.model.parameters(), config=config,
        lr_scheduler=lambda optimizer: build_scheduler(optimizer, problem),
    )  # fmt: skip
    plan, seconds = plan_of(cell, problem), []
    for step in range(steps):
        started = time.perf_counter()
        micro = step_indices(plan, step)
        tokens = built.dataset.total_loss_elements([i for m in micro for i in m])
        for indices in micro:
            x, y = built.dataset.batch(indices)
            loss = built.loss_sum(engine(x.to(device)), y.to(device)) / tokens
            engine.backward(loss * plan.grad_accum_steps)  # it divides by GA
            engine.step()
        sync(device)
        seconds.append(time.perf_counter() - started)
    engine.destroy()
    return seconds


def trainer(name: str, cell, problem, device, folder: Path) -> list[float]:
    """Seconds per optimizer step of gaeq's trainer `name` on the cell, from its trace."""
    from gaeq.results.trace import read_trace
    from gaeq.trainers import RunContext, trainer_for

    cell_dir = folder / f"{name}-{time.perf_counter_ns()}"
    cell_dir.mkdir()
    ctx = RunContext(rank=0, world_size=1, device=device, cell_dir=cell_dir, run_dir=folder)
    trainer_for(name)(cell=cell, problem=problem, ctx=ctx)
    return [r.seconds for r in read_trace(cell_dir)]


def measure(matrix: Path, *, cells: dict[str, str], steps: int) -> dict:
    """{trainer: {cell, bare_s, gaeq_s, ratio, samples_per_s}}: per optimizer step, the median after
    warm-up. `cells`: trainer → the matrix's cell id to time it on."""
    import torch
    import torch.distributed as dist

    from gaeq.matrix import load_matrix
    from gaeq.runtime import dist as gaeq_dist

    gaeq_dist.set_accelerator_env()
    device = gaeq_dist.device_for(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # a group of one, as gaeq's world-1 cells run in
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(gaeq_dist.free_port())
        dist.init_process_group(gaeq_dist.backend())
    m = load_matrix(matrix)
    problem = m.problem.model_copy(update={"steps": steps})
    bare = {"torch": bare_torch, "deepspeed": bare_deepspeed}
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, cell_id in cells.items():
            cell = next(c for c in m.cells if c.id == cell_id)
            theirs = statistics.median(bare[name](cell, problem, device, steps)[WARMUP:])
            ours = statistics.median(trainer(name, cell, problem, device, Path(folder))[WARMUP:])
            found[name] = {
                "cell": cell_id,
                "bare_s": theirs,
                "gaeq_s": ours,
                "ratio": ours / theirs,
                "samples_per_s": {"bare": cell.train_batch_size / theirs, "gaeq": cell.train_batch_size / ours},
            }
    found["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("matrix", type=Path)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--torch-cell", default="torch-w1-mb16-ga2")
    parser.add_argument("--deepspeed-cell", default="deepspeed-z2-w1-mb16-ga2")
    args = parser.parse_args()
    cells = {"torch": args.torch_cell, "deepspeed": args.deepspeed_cell}
    print(json.dumps(measure(args.matrix, cells=cells, steps=args.steps), indent=1))


if __name__ == "__main__":
    main()
