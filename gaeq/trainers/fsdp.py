"""Manual gradient accumulation with torch FSDP2 (``fully_shard``): parameters, gradients and
optimizer state sharded over the ranks — the comparison people make when they move between
DeepSpeed ZeRO-3 and FSDP. With tensor_parallel > 1, FSDP2 shards over the data-parallel dimension
of a (dp, tp) mesh whose tp dimension splits the layers (DTensor, gaeq/trainers/tensor_parallel.py).

Read it side by side with torch_manual.py: same skeleton, same names. The differences are marked
``# ACCUMULATION:`` — who shards, when gradients are reduced — and ``cell.bug`` lines plant the
mistakes of gaeq/bugs.py where they would really be made.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.optim import build_optimizer, build_scheduler, gradient_clipping
from gaeq.problem.spec import ProblemSpec
from gaeq.trainers import tensor_parallel
from gaeq.trainers.base import RunContext, build_cell_problem, inject_fault, short_step_label, times
from gaeq.trainers.provenance import Provenance
from gaeq.trainers.recorder import StepRecorder
from gaeq.trainers.tensor_parallel import TensorParallel, full


def promised(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What an FSDP2 cell's label promises: the model sharded, every parameter a shard, replicated
    (HSDP) as often as the label says."""
    return short_step_label(cell, problem) | {
        "fsdp": True,
        "sharded_parameters": True,
        "hsdp_replicas": cell.hsdp_replicas,
    }


def _replicas(model: torch.nn.Module) -> int:
    """How many replicas hold the model's shards: the size of the dimension its parameters are
    replicated over (HSDP's), 1 where they are only sharded."""
    from torch.distributed.tensor import Replicate

    p = next(model.parameters())
    return max([p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)] or [1])


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank; returns what really ran (:mod:`gaeq.trainers.provenance`)."""
    task = build_cell_problem(cell, problem, ctx)
    plan = task.plan
    model = task.model.to(ctx.device)
    # ACCUMULATION: FSDP2 shards every block, then the rest (the root), over the data-parallel
    # ranks; its reduce-scatter averages gradients over them (÷ dp), as DDP's all-reduce does —
    # under HSDP over each shard group, then an all-reduce averages the replicas.
    tp = TensorParallel(cell=cell, device=ctx.device) if cell.tensor_parallel > 1 else None
    if tp is not None:
        tp.parallelize(model)  # first the layers over each tensor-parallel group, then FSDP2
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,)) if tp is None else tp.mesh["dp"]
    if cell.hsdp_replicas > 1:  # HSDP: each replica shards the model over its group of ranks
        replicas = cell.hsdp_replicas
        mesh = init_device_mesh(
            ctx.device.type, (replicas, ctx.world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    for block in shard_units(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = build_optimizer(model.named_parameters(), problem)  # over the shards (DTensors)
    scheduler = build_scheduler(optimizer, problem)
    last_param = list(model.parameters())[-1]
    # clip_grad_norm_ returns the pre-clipping norm; max_norm=inf measures without clipping.
    max_norm = gradient_clipping(problem) or math.inf
    # DTensors on two meshes
    clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ if tp is None else tensor_parallel.clip_grad_norm_
    if cell.bug == Bug.TP_GRAD_NORM_PER_SHARD:  # planted bug: each rank clips by its slices' norm
        clip_grad_norm_ = functools.partial(tensor_parallel.clip_grad_norm_, per_shard=True)
    if cell.bug == Bug.HSDP_GRAD_NORM_OVER_REPLICAS:  # planted bug: shards' squares summed over every rank
        clip_grad_norm_ = functools.partial(tensor_parallel.clip_grad_norm_, per_shard=True, over=dist.group.WORLD)
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps, plan=task.plan)
    recorder.count_collectives(model if ctx.world_size > 1 else None)
    recorder.count_collectives(tp)
    ran = Provenance(
        cell,
        promised=promised(cell, problem),
        **task.model_facts(),
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        tensor_parallel=tensor_parallel.tensor_parallel_of(model),
        fsdp=isinstance(model, FSDPModule),
        sharded_parameters=all(isinstance(p, DTensor) for p in model.parameters()),
        hsdp_replicas=_replicas(model),
        update_rule=type(optimizer).__name__,
        gradient_clipping=None if max_norm == math.inf else max_norm,  # (what clip_grad_norm_ is given)
    )

    for step in range(problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        normaliser = task.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        micro_steps = plan.micro_steps(step)  # GA; fewer at an epoch's short last step (epoch_end: short_step)
        for micro_step in range(micro_steps):
            mb = task.micro_batch(step=step, micro_step=micro_step)
            boundary = micro_step == micro_steps - 1
            # ACCUMULATION: gradients are reduce-scattered only on the boundary micro-step; before
            # it, FSDP2 keeps them unsharded and sums them locally.
            model.set_requires_gradient_sync(boundary)
            num_items = task.num_items(cell, mb, normaliser=normaliser)  # what the loss sum is divided by
            with ran.forward(mb.inputs), task.forwarding(mb):
                micro_loss = task.micro_loss(model, mb, num_items=num_items)
            # ACCUMULATION: we divide — num_items counts the whole global batch, so ÷ GA is in it —
            # and multiply by the data-parallel ranks, because FSDP2 averages over them.
            loss = times(micro_loss, task.data_parallel)
            loss.backward()
            recorder.measure_model_state(step=step, micro_step=micro_step, model=model, optimizer=optimizer)
            local_loss_sum += micro_loss.item() * num_items
        if cell.bug == Bug.ONE_GRAD_SCALED:
            last_param.grad.mul_(4.0)  # planted bug: one tensor's gradient 4× (AdamW hardly notices)
        # ACCUMULATION: at the boundary the gradients are sharded; the grad norm and clipping
        # reduce over the shards (a DTensor norm), then step, schedule, zero — as torch_manual.
        if recorder.wants("grads", step):  # full tensors, gathered from every shard: all ranks call it
            recorder.snapshot(
                step=step, kind="grads", gather=lambda: {n: full(p.grad) for n, p in model.named_parameters()}
            )
        grad_norm = ran.grad_norm(full(clip_grad_norm_(model.parameters(), max_norm=max_norm)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        ran.step_done()
        if recorder.wants("params", step):
            recorder.snapshot(
                step=step, kind="params", gather=lambda: {n: full(p) for n, p in model.named_parameters()}
            )
        recorder.record(
            step=step,
            local_loss_sum=local_loss_sum,
            normaliser=normaliser,
            grad_norm=grad_norm,
            lr=lr,
            seconds=time.perf_counter() - started,
        )
    recorder.close()
    return ran.facts


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one (each all-gathered just before its forward): gaeq's
    GPT's blocks, a transformers model's decoder layers; none for the MLP (one unit, the root)."""
    for path in ("blocks", "model.layers", "transformer.h"):
        owner = model
        for name in path.split("."):
            owner = getattr(owner, name, None)
        if isinstance(owner, torch.nn.ModuleList):
            return list(owner)
    return []
