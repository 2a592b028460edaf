"""torch.distributed.pipelining: the model cut into stages by layer, ``schedule.step()`` once per
optimizer step — accumulation is the schedule.

Read it beside deepspeed_pipeline.py: the same data plan, loss and records. What differs is who
runs the micro-steps: the schedule (GPipe, 1F1B or interleaved 1F1B) splits the step's micro-batches
back out of one batch, sends activations forward and their gradients back, and divides every
gradient by its micro-batch count at the end of ``step()`` (``scale_grads``, torch's default); the
data-parallel average, the clipping and the update are ours. ``# ACCUMULATION:`` marks where.

Ranks are laid out (pp, dp, tp) — stage outermost, as ``Cell.place`` and DeepSpeed's pipe grid: the
ranks of one pipeline hold its stages, the same stage of the data-parallel replicas averages its
gradients, a tensor-parallel group splits its stage's layers (DTensor).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from gaeq.bug_catalogue import BUGS
from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.models import gpt_boundaries, gpt_stage
from gaeq.problem.optim import build_optimizer, build_scheduler, gradient_clipping
from gaeq.problem.spec import ProblemSpec
from gaeq.problem.stages import stages_per_rank
from gaeq.trainers import tensor_parallel
from gaeq.trainers.base import RunContext, build_cell_problem, inject_fault
from gaeq.trainers.provenance import Provenance
from gaeq.trainers.recorder import StepRecorder
from gaeq.trainers.tensor_parallel import TensorParallel

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
"""The `pipeline_schedule` axis → torch's schedule class (gaeq.registry.PIPELINE_SCHEDULES)."""


def promised(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What a torch pipeline cell's label promises — what its stages and schedule report after set-up."""
    return {
        "pipeline_parallel": cell.pipeline_parallel,
        "schedule": SCHEDULES[cell.pipeline_schedule].__name__,
        "stages": cell.pipeline_parallel * stages_per_rank(cell.pipeline_schedule),
        "pipeline_micro_batches": cell.grad_accum_steps,
        "grad_norm_dtype": "float32",  # as torch's clip_grad_norm_ sums it, over every stage
    }


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank (one or two stages of one pipeline); returns what really ran."""
    task = build_cell_problem(cell, problem, ctx)
    plan = task.plan
    pp, chunks = cell.pipeline_parallel, stages_per_rank(cell.pipeline_schedule)
    mesh = init_device_mesh(
        ctx.device.type, (pp, cell.data_parallel, cell.tensor_parallel), mesh_dim_names=("pp", "dp", "tp")
    )
    pp_group, place = mesh["pp"].get_group(), cell.place(ctx.rank)
    # ACCUMULATION: we own data parallelism: each stage's gradients are averaged over its
    # data-parallel replicas at the boundary (and its layers split over tensor_parallel ranks).
    split = TensorParallel(cell=cell, device=ctx.device, mesh=mesh)
    if cell.tensor_parallel > 1:
        split.parallelize(task.model)  # the whole model, then cut: every stage holds its own slices
    # Stage s of pp × chunks: this rank holds s = its place and (interleaved) s + pp — torch's loop layout.
    indices = [place.stage + k * pp for k in range(chunks)]
    modules = [gpt_stage(task.model, index=i, count=pp * chunks).to(ctx.device) for i in indices]
    # what crosses each cut, given: torch then needs no shape-inference forward or metadata exchange
    cuts = gpt_boundaries(task.model, task.micro_batch(step=0, micro_step=0).inputs, count=pp * chunks)
    stages = [
        PipelineStage(m, i, pp * chunks, ctx.device, input_args=cuts[i], output_args=cuts[i + 1], group=pp_group)
        for m, i in zip(modules, indices)
    ]
    params = [p for m in modules for p in m.parameters()]
    step_loss = {"sum": 0.0, "num_items": 1}  # the forward loss sums of this step (only the last stage has any)

    # ACCUMULATION: one schedule.step() per optimizer step runs all GA micro-batches.
    calls = 1
    if cell.bug == Bug.PIPELINING_STEP_PER_MICRO_BATCH:  # planted bug (torchtitan#1733): accumulating over
        calls = BUGS[cell.bug].pipeline_calls  # several step() calls, each dividing ALL gradients so far
    per_call = plan.grad_accum_steps // calls  # the schedule's n_microbatches

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss_sum = task.built.loss_sum(logits, targets)
        step_loss["sum"] += loss_sum.item()
        # ACCUMULATION: the schedule divides the gradients by its n_microbatches and we average them
        # over the data-parallel ranks; num_items counts the whole global batch (÷ GA is in it), so
        # we hand it n_microbatches × dp × our share — as deepspeed_pipeline.py hands its engine.
        return loss_sum / step_loss["num_items"] * task.data_parallel * per_call

    schedule_class = SCHEDULES[cell.pipeline_schedule]
    schedule = schedule_class(stages if chunks > 1 else stages[0], n_microbatches=per_call, loss_fn=loss_fn)
    optimizer = build_optimizer([(n, p) for m in modules for n, p in m.named_parameters()], problem)
    scheduler = build_scheduler(optimizer, problem)
    max_norm = gradient_clipping(problem) or math.inf
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps, plan=task.plan)
    recorder.count_collectives(split)
    _measure_stages(stages, recorder)
    ran = Provenance(
        cell,
        promised=promised(cell, problem),
        world_size=mesh.size(),
        pipeline_parallel=pp_group.size(),
        tensor_parallel=tensor_parallel.tensor_parallel_of(task.model),
        stages=stages[0].num_stages,
        stage_indices=[s.stage_index for s in stages],
        schedule=type(schedule).__name__,
        pipeline_micro_batches=schedule._n_microbatches * calls,
        update_rule=type(optimizer).__name__,
    )
    ran.watch_forwards(modules[0])
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    for step in range(problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        normaliser = task.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        step_loss.update(sum=0.0, num_items=normaliser)
        micro_batches = [task.micro_batch(step=step, micro_step=k) for k in range(plan.grad_accum_steps)]
        recorder.pipeline.start()
        for call in range(calls):
            # ACCUMULATION: the schedule cuts the batch back into its n_microbatches micro-batches
            # (the first stage reads their inputs, the last their targets), runs their forwards and
            # backwards through the stages, and divides the gradients by n_microbatches.
            mine = micro_batches[call * per_call : (call + 1) * per_call]
            inputs = (torch.cat([mb.inputs for mb in mine]),) if first else ()
            targets = {"target": torch.cat([mb.targets for mb in mine])} if last else {}
            schedule.step(*inputs, **targets)
        recorder.measure_model_state(step=step, micro_step=0, model=torch.nn.ModuleList(modules), optimizer=optimizer)
        # ACCUMULATION: at the boundary we average over the data-parallel replicas, clip by the
        # whole model's norm (every stage's squares), step the optimizer, step the schedule, zero.
        split.average_gradients(params)
        grad_norm = ran.grad_norm(tensor_parallel.clip_grad_norm_(params, max_norm=max_norm, over=pp_group))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ran.step_done()
        recorder.record(
            step=step,
            local_loss_sum=step_loss["sum"],
            normaliser=normaliser,
            grad_norm=grad_norm,
            lr=lr,
            seconds=time.perf_counter() - started,
        )
    recorder.close()
    return ran.facts


def _measure_stages(stages: list[PipelineStage], recorder: StepRecorder) -> None:
    """Each stage's forwards and backwards timed as its work, the tensors its send and receive
    operations move counted as its p2p bytes (gaeq.trainers.cost.PipelineCost)."""
    cost = recorder.pipeline
    moved = lambda args, kwargs, ops: [op.tensor for op in ops]  # noqa: E731 — P2POps: one tensor each
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk"):
            cost.patch(stage, name, cost.computing)
        for name in ("get_fwd_send_ops", "get_bwd_send_ops", "get_fwd_recv_ops", "get_bwd_recv_ops"):
            cost.patch(stage, name, lambda fn: cost.sending(fn, moved))
