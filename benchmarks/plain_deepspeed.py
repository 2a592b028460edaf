"""One configuration, one launch: the way a ZeRO correctness checker without gaeq runs — a plain
DeepSpeed training script started by DeepSpeed's launcher for each ZeRO stage × GA it checks.

    deepspeed --num_gpus 2 benchmarks/plain_deepspeed.py --zero 2 --micro 4 --steps 50
    python benchmarks/plain_deepspeed.py --tiny     # 2 steps, one process (no launcher): seconds, for the suite

It trains experiments/ga.yaml's problem (its model, data, AdamW, schedule, clipping, written into
the DeepSpeed config as gaeq writes it) and prints one line per step on rank 0: what a peer script
must do to be compared with a baseline. `benchmarks/lab_speed.py` times it against `gaeq run`.
Started without a launcher (`python benchmarks/plain_deepspeed.py`) it is one process, world 1.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = "tiny run (--tiny): the smallest sizes, to keep the code working — its numbers mean nothing"
TINY_STEPS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help=f"Default 50 ({TINY_STEPS} with --tiny).")
    parser.add_argument("--local_rank", type=int, default=-1)  # set by DeepSpeed's launcher
    parser.add_argument(
        "--tiny", action="store_true", help="The same run at the fewest steps, for the suite: its numbers mean nothing."
    )
    args = parser.parse_args()
    started = time.perf_counter()
    if args.tiny and os.environ.get("RANK", "0") == "0":
        print(TINY, flush=True)
    steps = args.steps or (TINY_STEPS if args.tiny else 50)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # no launcher: one process, as `python train.py` of a plain script is
        from gaeq.runtime.dist import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))

    import deepspeed
    import torch
    import torch.distributed as dist
    import yaml

    from gaeq.problem.build import build_problem
    from gaeq.problem.data import BatchPlan
    from gaeq.problem.loss import mse_sum
    from gaeq.problem.optim import build_scheduler, deepspeed_optimizer
    from gaeq.problem.spec import ProblemSpec

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = ProblemSpec.model_validate(yaml.safe_load((REPO / "experiments" / "ga.yaml").read_text())["problem"])
    plan = BatchPlan(train_batch_size=problem.train_batch_size, micro_batch_size=args.micro, data_parallel=world,
                     num_samples=problem.num_samples, seed=problem.seed)  # fmt: skip
    torch.manual_seed(problem.seed)
    built = build_problem(problem)
    config = {
        "train_batch_size": plan.train_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "optimizer": deepspeed_optimizer(problem.optimizer),
        "gradient_clipping": problem.gradient_clipping,
        "zero_optimization": {"stage": args.zero, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
    }
    engine, *_ = deepspeed.initialize(model=built.model, model_parameters=built.model.parameters(), config=config,
                                      lr_scheduler=lambda optimizer: build_scheduler(optimizer, problem))  # fmt: skip
    training = time.perf_counter()
    for step in range(steps):
        loss_sum = 0.0
        for micro_step in range(plan.grad_accum_steps):
            x, y = built.dataset.batch(plan.sample_indices(step=step, micro_step=micro_step, rank=rank))
            loss = mse_sum(engine(x), y) / plan.train_batch_size
            engine.backward(loss * world * plan.grad_accum_steps)  # DeepSpeed divides by GA and averages over ranks
            engine.step()
            loss_sum += loss.item()
        total = torch.tensor([loss_sum], dtype=torch.float64)
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item():.10f} grad_norm {engine.get_global_grad_norm()}", flush=True)
    if rank == 0:
        now = time.perf_counter()
        print(
            f"trained in {now - training:.3f} s; done in {now - started:.1f} s (after the interpreter's start)",
            flush=True,
        )
    # Shut down as a script should: the engine's and the default process group's threads end here,
    # not in the interpreter's teardown (where gloo on CPU can abort a finished run).
    dist.barrier()
    del engine
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
