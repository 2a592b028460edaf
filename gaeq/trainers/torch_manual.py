"""Manual gradient accumulation in plain PyTorch (DDP when world_size > 1).

Read it side by side with deepspeed_native.py: same skeleton, same names. The differences are
marked ``# ACCUMULATION:`` and are exactly where accumulation differs — who divides the loss,
when gradients are synchronised, who clips and steps at the boundary.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gaeq.matrix import Cell, ProblemSpec
from gaeq.problem.loss import global_normaliser
from gaeq.problem.optim import build_optimizer, build_scheduler
from gaeq.trainers.base import RunContext, StepRecorder, autocast, build_problem, inject_fault


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> None:
    built = build_problem(cell, problem)
    plan = built.plan
    model = built.model.to(ctx.device)
    # ACCUMULATION: we own the data-parallel wrapper; DDP averages gradients over ranks (÷ world).
    ddp = DDP(model) if ctx.world_size > 1 else None
    net = ddp or model
    optimizer = build_optimizer(model.parameters(), problem.optimizer)
    scheduler = build_scheduler(optimizer, problem)
    # clip_grad_norm_ returns the pre-clipping norm; max_norm=inf measures without clipping.
    max_norm = problem.gradient_clipping or math.inf
    recorder = StepRecorder(cell=cell, ctx=ctx)

    for step in range(problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        normaliser = global_normaliser(plan, step=step)
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        for micro_step in range(plan.grad_accum_steps):
            x, y = built.micro_batch(step=step, micro_step=micro_step, rank=ctx.rank, device=ctx.device)
            boundary = micro_step == plan.grad_accum_steps - 1
            # ACCUMULATION: gradients are all-reduced only on the boundary micro-step; before it,
            # no_sync() lets them pile up locally in .grad.
            sync = contextlib.nullcontext() if ddp is None or boundary else ddp.no_sync()
            with sync:
                with autocast(cell.dtype, ctx.device):
                    micro_loss_sum = built.loss_sum(net(x), y)
                # ACCUMULATION: we divide. This micro-batch's share of the global-batch mean,
                # × world because DDP averages over ranks; for per-sample losses that is
                # (micro-batch mean) ÷ GA.
                loss = micro_loss_sum * ctx.world_size / normaliser
                if cell.bug == "no_loss_division":
                    loss = loss * plan.grad_accum_steps  # planted bug: forgets ÷ GA
                loss.backward()
            local_loss_sum += micro_loss_sum.item()
        # ACCUMULATION: at the boundary we clip, step the optimizer, step the schedule, zero.
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        recorder.record(
            step=step,
            local_loss_sum=local_loss_sum,
            normaliser=normaliser,
            grad_norm=grad_norm,
            lr=lr,
            seconds=time.perf_counter() - started,
        )
    recorder.close()
