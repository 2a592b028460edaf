"""DeepSpeed's native gradient accumulation: engine.backward / engine.step on every micro-step.

Read it side by side with torch_manual.py: same skeleton, same names. The differences are
marked ``# ACCUMULATION:`` and are exactly where accumulation differs — who divides the loss,
when gradients are synchronised, who clips and steps at the boundary.
"""

from __future__ import annotations

import math
import time
from typing import Any

import deepspeed
import torch

from gaeq.matrix import Cell, ProblemSpec
from gaeq.problem.loss import global_normaliser
from gaeq.problem.optim import build_scheduler, deepspeed_optimizer
from gaeq.trainers.base import RunContext, StepRecorder, autocast, build_problem, inject_fault


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> None:
    built = build_problem(cell, problem)
    plan = built.plan
    model = built.model.to(ctx.device)
    # ACCUMULATION: the engine owns data parallelism (and ZeRO partitioning), the optimizer it
    # builds from the config, and the schedule we hand it, which it steps at each boundary.
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=deepspeed_config(cell, problem),
        lr_scheduler=lambda optimizer: build_scheduler(optimizer, problem),
    )
    net = engine
    recorder = StepRecorder(cell=cell, ctx=ctx)

    for step in range(problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = engine.get_lr()[0]
        normaliser = global_normaliser(plan, step=step)
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        for micro_step in range(plan.grad_accum_steps):
            x, y = built.micro_batch(step=step, micro_step=micro_step, rank=ctx.rank, device=ctx.device)
            boundary = micro_step == plan.grad_accum_steps - 1
            # ACCUMULATION: the engine counts micro-steps and reduces gradients at its own
            # boundary; ours must be the same one.
            if engine.is_gradient_accumulation_boundary() != boundary:
                raise RuntimeError(f"DeepSpeed's boundary disagrees with the plan at step {step}.{micro_step}")
            with autocast(cell.dtype, ctx.device):
                micro_loss_sum = built.loss_sum(net(x), y)
            # ACCUMULATION: DeepSpeed divides by GA itself inside engine.backward, so we hand it GA ×
            # this micro-batch's share of the global-batch mean (× world: it averages over ranks).
            # Its return value is that ÷ GA; the loss we log is the forward one.
            loss = micro_loss_sum * ctx.world_size / normaliser * plan.grad_accum_steps
            engine.backward(loss)
            if boundary:
                grad_norm = _norm_before_step(engine)
            # ACCUMULATION: step() every micro-step; the engine clips, updates, steps the schedule
            # and zeroes gradients only when it is at the boundary.
            engine.step()
            local_loss_sum += micro_loss_sum.item()
        grad_norm = _norm_after_step(engine, grad_norm)
        recorder.record(
            step=step,
            local_loss_sum=local_loss_sum,
            normaliser=normaliser,
            grad_norm=grad_norm,
            lr=lr,
            seconds=time.perf_counter() - started,
        )
    recorder.close()
    engine.destroy()


def deepspeed_config(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """Every knob that changes the optimisation, written out. Nothing is left to a default."""
    return {
        "train_batch_size": cell.train_batch_size,
        "train_micro_batch_size_per_gpu": cell.micro_batch_size,
        "gradient_accumulation_steps": cell.grad_accum_steps,
        "optimizer": deepspeed_optimizer(problem.optimizer),
        # DeepSpeed 0.19 clips to 1.0 by default; 0.0 means off, as in the torch trainer.
        "gradient_clipping": problem.gradient_clipping,
        # Average over ranks after the backward, like DDP: no pre-division, no extra factor.
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "zero_optimization": {"stage": cell.zero_stage},
        # torch.optim.SGD is not on ZeRO's list of tested optimizers; it is exact elementwise math.
        "zero_allow_untested_optimizer": True,
        # Low precision is forward autocast on both sides (see base.autocast); weights stay fp32.
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _norm_before_step(engine) -> float | None:
    """ZeRO-0 keeps whole, already-averaged gradients in .grad at the boundary: measure them.

    With ZeRO ≥ 1 the gradients are partitioned; the engine's optimizer computes the global norm
    inside step() and we read it afterwards (:func:`_norm_after_step`).
    """
    if engine.zero_optimization_stage() > 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads).item()


def _norm_after_step(engine, before: float | None) -> float:
    if before is not None:
        return before
    norm = engine.get_global_grad_norm()
    if norm is None:
        return math.nan
    return float(norm)
