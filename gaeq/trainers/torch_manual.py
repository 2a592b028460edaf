"""Manual gradient accumulation in plain PyTorch (DDP when world_size > 1; DTensor tensor
parallelism when tensor_parallel > 1).

Read it side by side with deepspeed_native.py: same skeleton, same names. The differences are
marked ``# ACCUMULATION:`` and are exactly where accumulation differs — who divides the loss,
when gradients are synchronised, who clips and steps at the boundary. ``cell.bug`` lines plant
the mistakes of gaeq/bugs.py where they would really be made.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gaeq.bugs import Bug
from gaeq.matrix import Cell, Role
from gaeq.problem.optim import build_optimizer, build_scheduler, gradient_clipping
from gaeq.problem.spec import ProblemSpec
from gaeq.trainers import compiled, muon, tensor_parallel
from gaeq.trainers.base import RunContext, build_cell_problem, inject_fault, short_step_label, times
from gaeq.trainers.checkpoint import load_torch, save_torch
from gaeq.trainers.provenance import Provenance
from gaeq.trainers.recorder import StepRecorder
from gaeq.trainers.sequence_parallel import SequenceParallel
from gaeq.trainers.tensor_parallel import TensorParallel, full


def promised(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What a torch cell's label promises (:mod:`gaeq.trainers.provenance` checks it after step 1)."""
    return (
        short_step_label(cell, problem)
        | {
            "ddp": cell.world_size > 1 and cell.tensor_parallel == 1,
            "grad_scaler": cell.dtype == "fp16",
            # the baseline is the reference: its norm summed in float64; every other cell's as users sum it
            "grad_norm_dtype": "float64" if cell.role == Role.BASELINE else "float32",
            "sequence_parallel": cell.sequence_parallel,
            "compiled": cell.compile,
            # the head split by vocabulary, the loss on the shards (model.loss_parallel), where layers are split
            "loss_parallel": cell.tensor_parallel > 1 and getattr(problem.model, "loss_parallel", False),
        }
        | muon.label(cell, problem)
    )


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank; returns what really ran (:mod:`gaeq.trainers.provenance`)."""
    task = build_cell_problem(cell, problem, ctx)
    plan = task.plan
    model = task.model.to(ctx.device)
    # ACCUMULATION: we own data parallelism. DDP averages gradients over ranks (÷ world); with
    # tensor parallelism the plan's layers are split over each tensor-parallel group (DTensor) and
    # we average over the data-parallel ranks ourselves (DDP does not take DTensor parameters).
    tp = TensorParallel(cell=cell, device=ctx.device) if cell.tensor_parallel > 1 else None
    if tp is not None:
        tp.parallelize(model)
    # Sequence parallelism (Ulysses): each rank a slice of every sample's tokens, attention over the
    # group through DeepSpeed's all-to-alls; DDP then averages over every rank of the world.
    sp = SequenceParallel(cell, rank=ctx.rank) if cell.sequence_parallel > 1 else None
    ulysses = sp.parallelize(model, tokens=task.tokens) if sp is not None else 0
    compiled.start(cell.compile, model)  # torch.compile in place, as nanoGPT compiles before DDP wraps it
    ddp = DDP(model) if ctx.world_size > 1 and tp is None else None
    net = ddp or model
    optimizer = build_optimizer(model.named_parameters(), problem)
    if cell.bug == Bug.LR_ZERO:
        optimizer.param_groups[0]["lr"] = 0.0  # planted control: the compared side never moves
    if cell.bug == Bug.MUON_WITHOUT_NEWTON_SCHULZ:  # planted bug (DeepSpeed#8441): Muon's matrices stepped by SGD
        muon.without_newton_schulz(optimizer)
    scheduler = build_scheduler(optimizer, problem)
    # fp16: torch's GradScaler, as an fp16 user writes it (a pass-through in every other dtype).
    # Its policy is written out, the same as ds_fp16's in deepspeed_native.py: start at 2^16,
    # halve on an overflow (and skip that update), double after 1000 clean steps.
    scaler = torch.amp.GradScaler(
        ctx.device.type,
        init_scale=2.0**16,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=1000,
        enabled=cell.dtype == "fp16",
    )
    # clip_grad_norm_ returns the pre-clipping norm; max_norm=inf measures without clipping.
    max_norm = gradient_clipping(problem) or math.inf
    # a model split over ranks sums its norm over the slices
    clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ if tp is None else tensor_parallel.clip_grad_norm_
    if cell.role == Role.BASELINE:  # the reference sums the norm that clips in float64, not in float32 as users do
        clip_grad_norm_ = functools.partial(tensor_parallel.clip_grad_norm_, dtype=torch.float64)
    if cell.bug == Bug.TP_GRAD_NORM_PER_SHARD:  # planted bug: each rank clips by its slices' norm
        clip_grad_norm_ = functools.partial(tensor_parallel.clip_grad_norm_, per_shard=True)
    if cell.bug == Bug.UNMIRRORED_DEFAULT_CLIPPING:  # planted bug: no key in the file, so "no clipping"
        max_norm = problem.mirror.gradient_clipping or math.inf
    last_param = list(model.parameters())[-1]
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps, plan=task.plan)
    recorder.count_collectives(ddp or tp)
    if sp is not None:  # and Ulysses' all-to-alls, through deepspeed.comm
        recorder.comm.count_deepspeed(("all_to_all_single",))
    ran = Provenance(
        cell,
        promised=promised(cell, problem),
        **task.model_facts(),
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        ddp=isinstance(net, DDP),
        tensor_parallel=tensor_parallel.tensor_parallel_of(model),
        grad_scaler=scaler.is_enabled(),
        update_rule=type(optimizer).__name__,
        gradient_clipping=None if max_norm == math.inf else max_norm,  # (what clip_grad_norm_ is given)
        sequence_parallel=sp.size if sp is not None else 1,
        ulysses_attention=ulysses,
        loss_parallel=tp is not None and tp.loss_parallel,
    )
    if task.routes:  # a mixture of experts: the tokens each expert took in the first step
        ran.read_at_first_step(router_tokens=task.router_tokens)
    ran.read_at_first_step(compiled=lambda: compiled.facts()["compiled"])
    if cell.bug == Bug.COMPILED_GUARDS_SKIPPED:
        divide = compiled.divided_with_guards_skipped()
    if problem.optimizer.name in muon.MUONS:  # its Newton–Schulz calls in the first step
        muon.watch(ran, matrices=muon.matrices(optimizer), optimizer=problem.optimizer.name)
    start = load_torch(model, optimizer, scheduler, run_dir=ctx.run_dir, resume=cell.resume) if cell.resume else 0
    if cell.resume:  # what it loaded: torch's own state dicts (a universal checkpoint is DeepSpeed's)
        ran.facts["resumed"] = {"from": cell.resume.source, "at_step": start, "universal": False}

    for step in range(start, problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        normaliser = task.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        task.route_step(net, step)  # a mixture of experts balanced globally: the step's routing, counted ahead
        micro_steps = plan.micro_steps(step)  # GA; fewer at an epoch's short last step (epoch_end: short_step)
        for micro_step in range(micro_steps):
            mb = task.micro_batch(step=step, micro_step=micro_step)
            boundary = micro_step == micro_steps - 1
            # ACCUMULATION: gradients are all-reduced only on the boundary micro-step; before it,
            # no_sync() lets them pile up locally in .grad (with tensor parallelism: see below).
            sync = contextlib.nullcontext() if ddp is None or boundary else ddp.no_sync()
            num_items = task.num_items(cell, mb, normaliser=normaliser)  # what the loss sum is divided by
            sharded = tp.loss_context() if tp is not None else contextlib.nullcontext()  # vocab-sharded logits
            with sync, sharded:
                with ran.forward(mb.inputs), task.forwarding(mb):
                    if cell.bug == Bug.COMPILED_GUARDS_SKIPPED:  # planted bug: ÷ the normaliser of its first trace
                        micro_loss = divide(task.micro_loss(net, mb, num_items=1), num_items)
                    else:
                        micro_loss = task.micro_loss(net, mb, num_items=num_items)
                # ACCUMULATION: we divide — num_items counts the whole global batch, so ÷ GA is in it —
                # and multiply by the data-parallel ranks, because DDP averages over them (and by the
                # sequence-parallel ones: a sample's slices' gradients add up, DDP averages them too).
                loss = times(micro_loss, task.data_parallel * task.sequence_parallel)
                if cell.bug == Bug.TOKENS_ALL_REDUCED_THEN_DDP_AVERAGED:
                    loss = micro_loss  # planted bug: the global count, then DDP's average on top (÷ world twice)
                if cell.bug == Bug.NO_LOSS_DIVISION:
                    loss = loss * plan.grad_accum_steps  # planted bug: forgets ÷ GA
                scaler.scale(loss).backward()
            recorder.measure_model_state(step=step, micro_step=micro_step, model=model, optimizer=optimizer)
            if cell.bug == Bug.CLIP_EVERY_MICRO_STEP:
                clip_grad_norm_(model.parameters(), max_norm=max_norm)  # planted bug
            if cell.bug == Bug.SCHEDULER_EVERY_MICRO_STEP and not boundary:
                scheduler.step()  # planted bug: the schedule runs GA× too fast
            local_loss_sum += micro_loss.item() * num_items
        if tp is not None:  # ACCUMULATION: the boundary's all-reduce over the data-parallel ranks
            tp.average_gradients(model.parameters())
        if cell.bug == Bug.ONE_GRAD_SCALED:
            last_param.grad.mul_(4.0)  # planted bug: one tensor's gradient 4× (AdamW hardly notices)
        # ACCUMULATION: at the boundary we unscale (fp16), clip, step the optimizer, step the
        # schedule, zero.
        if cell.bug == Bug.LOSS_SCALE_NOT_UNSCALED_BEFORE_CLIP:
            grad_norm = ran.grad_norm(clip_grad_norm_(model.parameters(), max_norm=max_norm))  # planted bug
        scaler.unscale_(optimizer)
        if recorder.wants("grads", step):
            recorder.snapshot(
                step=step, kind="grads", gather=lambda: {n: full(p.grad) for n, p in model.named_parameters()}
            )
        if cell.bug != Bug.LOSS_SCALE_NOT_UNSCALED_BEFORE_CLIP:
            grad_norm = ran.grad_norm(clip_grad_norm_(model.parameters(), max_norm=max_norm))
        scale = scaler.get_scale()
        scaler.step(optimizer)  # fp16: no update when the gradient overflowed
        scaler.update()
        skipped = scaler.get_scale() < scale
        if not skipped:  # as DeepSpeed's engine: a skipped update does not advance the schedule
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
            skipped=skipped,
        )
        if step + 1 in cell.save_at:
            save_torch(model, optimizer, scheduler, run_dir=ctx.run_dir, cell_id=cell.id, step=step + 1, rank=ctx.rank)
    recorder.close()
    return ran.facts | (compiled.facts() if cell.compile else {})
