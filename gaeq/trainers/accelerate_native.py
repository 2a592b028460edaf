"""accelerate's gradient accumulation, as its docs teach it: ``Accelerator(gradient_accumulation_steps=GA)``,
``with accelerator.accumulate(model)``, ``accelerator.backward(loss)``, clipping with
``accelerator.clip_grad_norm_`` on sync steps, optimizer and scheduler through ``prepare``.

Read it side by side with torch_manual.py: same skeleton, same names; the differences are marked
``# ACCUMULATION:``. ``cell.bug`` lines plant the mistakes of gaeq/bugs.py where they are made.

Data: gaeq's plan, not accelerate's sharding. No dataloader goes through ``prepare`` (its sharding
would hand each rank other samples); each rank takes exactly the micro-batches the plan gives it —
the ones every other trainer sees — and accelerate counts the micro-steps itself (``accumulate``
syncs on every GA-th call), which is checked against the plan's boundary at every micro-step.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

from torch.nn.parallel import DistributedDataParallel as DDP

from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.optim import build_optimizer, build_scheduler, gradient_clipping
from gaeq.problem.spec import ProblemSpec
from gaeq.trainers.base import RunContext, build_cell_problem, inject_fault, times
from gaeq.trainers.library_state import reset_accelerate_state
from gaeq.trainers.provenance import Provenance
from gaeq.trainers.recorder import StepRecorder

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16"}
"""Cell dtype → accelerate's mixed_precision (autocast over fp32 weights, as in the torch trainer)."""


def promised(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What an accelerate cell's label promises (:mod:`gaeq.trainers.provenance` checks it after step 1)."""
    return {
        # gaeq's ranks run as a launcher starts them (LOCAL_RANK set): accelerate then wraps DDP
        # at world 1 too, as under `accelerate launch` or torchrun — a 1-rank all-reduce, a no-op.
        "ddp": cell.world_size > 1 or "LOCAL_RANK" in os.environ,
        "grad_accum_steps": cell.grad_accum_steps,
        "mixed_precision": MIXED_PRECISION[cell.dtype],
        "scheduler_steps_with_optimizer": cell.bug == Bug.ACCELERATE_SCHEDULER_PER_PROCESS,
    }


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank; returns what really ran (:mod:`gaeq.trainers.provenance`)."""
    task = build_cell_problem(cell, problem, ctx)
    plan = task.plan
    accelerator = new_accelerator(cell, plan.grad_accum_steps, cpu=ctx.device.type == "cpu")
    model = task.model.to(ctx.device)
    optimizer = build_optimizer(model.named_parameters(), problem)
    scheduler = build_scheduler(optimizer, problem)
    # ACCUMULATION: accelerate wraps all three: the model in DDP (world > 1; no_sync inside
    # accumulate() until the sync step), the optimizer (step and zero_grad act on sync steps only),
    # the scheduler (see new_accelerator for how often it steps).
    net, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    # clip_grad_norm_ returns the pre-clipping norm; max_norm=inf measures without clipping.
    max_norm = gradient_clipping(problem) or math.inf
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps, plan=task.plan)
    recorder.count_collectives(net if isinstance(net, DDP) else None)
    ran = Provenance(
        cell,
        promised=promised(cell, problem),
        **task.model_facts(),
        world_size=accelerator.num_processes,
        ddp=isinstance(net, DDP),
        grad_accum_steps=accelerator.gradient_accumulation_steps,
        mixed_precision=accelerator.mixed_precision,
        scheduler_steps_with_optimizer=scheduler.step_with_optimizer,
        update_rule=type(optimizer.optimizer).__name__,
    )

    for step in range(problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        normaliser = task.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        for micro_step in range(plan.grad_accum_steps):
            mb = task.micro_batch(step=step, micro_step=micro_step)
            boundary = micro_step == plan.grad_accum_steps - 1
            num_items = task.num_items(cell, mb, normaliser=normaliser)  # what the loss sum is divided by
            # ACCUMULATION: accelerate counts micro-steps and syncs gradients on its own boundary;
            # ours must be the same one.
            with accelerator.accumulate(net):
                if accelerator.sync_gradients != boundary:
                    raise RuntimeError(f"accelerate's sync step disagrees with the plan at step {step}.{micro_step}")
                with ran.forward(mb.inputs), task.forwarding(mb):
                    micro_loss = task.micro_loss(net, mb, num_items=num_items)
                # ACCUMULATION: accelerator.backward divides by GA itself (as DeepSpeed does), so we
                # hand it GA × this micro-batch's share of the global-batch mean (× dp: DDP
                # averages over the ranks) — accelerate's recipe for token-normalised losses.
                loss = times(micro_loss, task.data_parallel * plan.grad_accum_steps)
                if cell.bug == Bug.ACCELERATE_LOSS_DIVIDED_TWICE:
                    loss = loss / plan.grad_accum_steps  # planted bug: ÷ GA by hand, then accelerate's ÷ GA
                accelerator.backward(loss)
                recorder.measure_model_state(
                    step=step, micro_step=micro_step, model=model, optimizer=optimizer.optimizer
                )
                if accelerator.sync_gradients:
                    if recorder.wants("grads", step):
                        recorder.snapshot(
                            step=step, kind="grads", gather=lambda: {n: p.grad for n, p in model.named_parameters()}
                        )
                    grad_norm = ran.grad_norm(accelerator.clip_grad_norm_(net.parameters(), max_norm=max_norm))
                # ACCUMULATION: called every micro-step, acting on the sync step only.
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            local_loss_sum += micro_loss.item() * num_items
        ran.step_done()
        if recorder.wants("params", step):
            recorder.snapshot(step=step, kind="params", gather=lambda: dict(model.named_parameters()))
        recorder.record(
            step=step,
            local_loss_sum=local_loss_sum,
            normaliser=normaliser,
            grad_norm=grad_norm,
            lr=lr,
            seconds=time.perf_counter() - started,
        )
    recorder.close()
    accelerator.free_memory()
    return ran.facts


def new_accelerator(cell: Cell, grad_accum_steps: int, *, cpu: bool):
    """A fresh Accelerator for the cell (:func:`reset_accelerate_state` first)."""
    from accelerate import Accelerator

    reset_accelerate_state()
    return Accelerator(
        gradient_accumulation_steps=grad_accum_steps,
        mixed_precision=MIXED_PRECISION[cell.dtype],
        cpu=cpu,
        # By default accelerate steps a prepared scheduler num_processes times per optimizer step
        # (it assumes a schedule written in per-process batches): the schedule would then depend on
        # the world size. Ours is written in optimizer steps: we step it once per sync step.
        step_scheduler_with_optimizer=cell.bug == Bug.ACCELERATE_SCHEDULER_PER_PROCESS,  # planted bug: the default
    )
