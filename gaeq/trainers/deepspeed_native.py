"""DeepSpeed's native gradient accumulation: engine.backward / engine.step on every micro-step.

Read it side by side with torch_manual.py: same skeleton, same names. The differences are
marked ``# ACCUMULATION:`` and are exactly where accumulation differs — who divides the loss,
when gradients are synchronised, who clips and steps at the boundary. ``cell.bug`` lines plant
the mistakes of gaeq/bugs.py where they would really be made.
"""

from __future__ import annotations

import functools
import math
import shutil
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_grad

from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.optim import build_scheduler, gradient_clipping
from gaeq.problem.spec import ProblemSpec
from gaeq.problem.tp import tp_plan
from gaeq.trainers import compiled, muon
from gaeq.trainers.base import RunContext, autocast_inside, build_cell_problem, inject_fault, short_step_label, times
from gaeq.trainers.checkpoint import load_deepspeed, save_deepspeed
from gaeq.trainers.deepspeed_config import deepspeed_config
from gaeq.trainers.library_state import forget_parallel_groups
from gaeq.trainers.provenance import Provenance, engine_norm_dtype
from gaeq.trainers.recorder import StepRecorder


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank; returns what really ran (:mod:`gaeq.trainers.provenance`)."""
    forget_parallel_groups()
    task = build_cell_problem(cell, problem, ctx)
    plan = task.plan
    model = task.model.to(ctx.device)
    config = deepspeed_config(
        cell,
        problem,
        tp_plan=tp_plan(model) if cell.tensor_parallel > 1 else None,
        nvme_path=swap_dir(ctx),
        nvme_buffer_numel=max(p.numel() for p in model.parameters()),
    )
    if cell.offload == "nvme":
        # DeepSpeed's own ZeRO-3 partitioning takes an fp32 model for bf16 on a CPU without fp16
        # (`Init._set_dtype`: `dtype or fp16 if … else bf16 if …` binds the wrong way) and would swap its
        # parameters to nvme as bf16. Partitioned here, without a dtype, the config's (fp32) is used.
        deepspeed.zero.Init(module=model, config_dict_or_path=config)
    # ACCUMULATION: the engine owns data parallelism (and ZeRO partitioning; AutoTP's split of the
    # layers), the optimizer it builds from the config, and the schedule — ours, or the user's
    # config's own — which it steps at each boundary.
    autocast_inside(model, cell.dtype, ctx.device)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        lr_scheduler=None if problem.deepspeed_config else (lambda optimizer: build_scheduler(optimizer, problem)),
    )
    compiled.start(False)  # a clean compiler; the engine compiles its module itself, as its users ask it to
    if cell.compile:
        compiled.compile_engine(engine)
    net = engine
    managed = cell.deepspeed_accumulation == "managed"  # else GA 1 in the config, and our loop counts
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps, plan=task.plan)
    recorder.count_collectives(engine)
    model_dtype, grad_accum_dtype = engine.get_data_types()
    ran = Provenance(
        cell,
        promised=promised(cell, problem),
        **task.model_facts(),
        world_size=engine.world_size,
        tensor_parallel=_tensor_parallel_of(engine),
        zero_stage=engine.zero_optimization_stage(),
        grad_accum_steps=engine.gradient_accumulation_steps(),
        managed_gradient_accumulation=engine.managed_gradient_accumulation(),
        micro_batch_size=engine.train_micro_batch_size_per_gpu(),
        fp16_enabled=engine.fp16_enabled(),
        bf16_enabled=engine.bfloat16_enabled(),
        gradient_clipping=engine.gradient_clipping(),
        grad_norm_dtype=engine_norm_dtype(engine),
        cpu_offload=engine.zero_cpu_offload(),
        nvme_offload_optimizer=bool(engine.zero_nvme_offload_optimizer()),
        model_dtype=_name(model_dtype),
        grad_accum_dtype=_name(grad_accum_dtype),
        communication_dtype=_name(engine.communication_data_type),
        optimizer=type(engine.optimizer).__name__,
        update_rule=type(engine.basic_optimizer).__name__,  # what the config built (FusedAdam, AdamW, ...)
    )
    if cell.offload == "nvme":  # the engine really swaps: its files are there after the first step
        swapped = functools.cache(lambda: _swap_bytes(swap_dir(ctx)))  # the folder walked once
        ran.read_at_first_step(nvme_swap_bytes=swapped, swapped_to_nvme=lambda: swapped() > 0)
    ran.read_at_first_step(compiled=lambda: compiled.facts()["compiled"])
    if task.routes:  # a mixture of experts: the tokens each expert took in the first step
        ran.read_at_first_step(router_tokens=task.router_tokens)
    if problem.optimizer.name == "muon":  # its Newton–Schulz calls in the first step, wherever the engine runs them
        muon.watch(
            ran,
            matrices=sum(bool(getattr(p, "use_muon", False)) for p in engine.module.parameters()),
            optimizer="muon",
        )
    start = load_deepspeed(engine, run_dir=ctx.run_dir, resume=cell.resume) if cell.resume else 0
    if cell.resume:  # what the engine loaded, read back from it (its config's checkpoint.load_universal)
        ran.facts["resumed"] = {"from": cell.resume.source, "at_step": start,
                                "universal": bool(engine.load_universal_checkpoint())}  # fmt: skip

    for step in range(start, problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = engine.get_lr()[0]
        normaliser = task.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        skipped_before = engine.skipped_steps
        task.route_step(net, step)  # a mixture of experts balanced globally: the step's routing, counted ahead
        micro_steps = plan.micro_steps(step)  # GA; fewer at an epoch's short last step (epoch_end: short_step)
        for micro_step in range(micro_steps):
            mb = task.micro_batch(step=step, micro_step=micro_step)
            boundary = micro_step == micro_steps - 1
            if cell.deepspeed_accumulation == "manual_with_boundary" or (managed and plan.short_steps):
                # DeepSpeed's remedy for a manual loop; with short steps, the engine counting GA would
                # not end the short one: told where every step ends
                engine.set_gradient_accumulation_boundary(boundary)
            # ACCUMULATION: the engine counts micro-steps and reduces gradients at its own
            # boundary; ours must be the same one (a manual loop with GA 1 in the config: every
            # backward is the engine's boundary — open-instruct#1498 — unless told otherwise).
            if managed and engine.is_gradient_accumulation_boundary() != boundary:
                raise RuntimeError(f"DeepSpeed's boundary disagrees with the plan at step {step}.{micro_step}")
            num_items = task.num_items(cell, mb, normaliser=normaliser)  # what the loss sum is divided by
            with ran.forward(mb.inputs), task.forwarding(mb):
                micro_loss = task.micro_loss(net, mb, num_items=num_items)
            # ACCUMULATION: DeepSpeed divides by GA itself inside engine.backward, and num_items
            # already did, so we hand it GA × our share (× dp: it averages over the data-parallel
            # ranks). Its return value is that ÷ GA; the loss we log is the forward one.
            loss = times(micro_loss, task.data_parallel * engine.gradient_accumulation_steps())  # (manual: GA 1)
            engine.backward(loss)
            recorder.measure_model_state(
                step=step, micro_step=micro_step, model=engine.module, optimizer=engine.optimizer
            )
            if boundary:
                with recorder.comm.paused():  # our measurement (the engine clips by its own)
                    grad_norm = _norm_before_step(engine)
                if recorder.wants("grads", step):  # gathered from every partition: all ranks call it
                    recorder.snapshot(step=step, kind="grads", gather=lambda: _full_grads(engine))
            # ACCUMULATION: step() every micro-step; the engine unscales (ds_fp16), clips, updates,
            # steps the schedule and zeroes gradients only when it is at the boundary — and on an
            # fp16 overflow skips the update and the schedule, and lowers its loss scale. A manual
            # loop steps once, after its last backward.
            if managed or boundary:
                engine.step()
            local_loss_sum += micro_loss.item() * num_items
        skipped = engine.skipped_steps > skipped_before
        grad_norm = _norm_after_step(engine, grad_norm)
        ran.step_done()
        if recorder.wants("params", step):
            recorder.snapshot(step=step, kind="params", gather=lambda: _full_params(engine))
        recorder.record(
            step=step,
            local_loss_sum=local_loss_sum,
            normaliser=normaliser,
            grad_norm=grad_norm,
            lr=lr,
            seconds=time.perf_counter() - started,
            skipped=skipped,
        )
        if step + 1 in cell.save_at:  # a collective: every rank saves its partitions
            save_deepspeed(engine, run_dir=ctx.run_dir, cell_id=cell.id, step=step + 1)
    recorder.close()
    engine.destroy()
    if cell.offload == "nvme" and not cell.keep_nvme_swap:
        torch.distributed.barrier()  # every rank is done with its files
        if ctx.rank == 0:
            shutil.rmtree(swap_dir(ctx), ignore_errors=True)
    return ran.facts | (compiled.facts() if cell.compile else {})


def promised(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What a DeepSpeed cell's label promises — what its engine must report after set-up
    (:mod:`gaeq.trainers.provenance` checks it after step 1)."""
    label: dict[str, Any] = (
        short_step_label(cell, problem)
        | {
            "zero_stage": cell.zero_stage,
            "micro_batch_size": cell.micro_batch_size,
            # a manual loop tells the engine GA 1 (its forwards per step are still GA: measured)
            "grad_accum_steps": cell.grad_accum_steps if cell.deepspeed_accumulation == "managed" else 1,
            "managed_gradient_accumulation": cell.deepspeed_accumulation != "manual_unmanaged",
            "cpu_offload": cell.offload == "cpu",
            "fp16_enabled": cell.dtype == "ds_fp16",
            "bf16_enabled": cell.dtype == "ds_bf16",
            "compiled": cell.compile,
        }
        | muon.label(cell, problem)
    )
    if cell.offload == "nvme":  # its optimizer swaps, and it really wrote its swap files (measured)
        label |= {"nvme_offload_optimizer": True, "swapped_to_nvme": True}
    if problem.deepspeed_config is not None:
        pass  # the user's file decides the accumulation dtype; `ran` reports it
    elif cell.dtype == "ds_bf16":  # bf16 accumulation is a planted bug
        label["grad_accum_dtype"] = "bfloat16" if cell.bug == Bug.GRAD_ACCUM_BF16 else "float32"
    elif cell.dtype == "ds_fp16":
        label["grad_accum_dtype"] = "float16"
    if cell.bug != Bug.DEEPSPEED_DEFAULT_CLIPPING:  # that bug is DeepSpeed's default clipping
        label["gradient_clipping"] = gradient_clipping(problem)
    return label


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def swap_dir(ctx: RunContext) -> Path:
    """Where an nvme cell's engine swaps: a folder of its own in the cell's directory."""
    return ctx.cell_dir / "nvme_swap"


def _swap_bytes(folder: Path) -> int:
    """Bytes the engine has written under its swap folder."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def _norm_before_step(engine) -> float | None:
    """ZeRO-0 keeps whole, already-averaged gradients in .grad at the boundary: measure them —
    with AutoTP, the split layers' slices summed over the tensor-parallel group, the rest once;
    with managed_gradient_accumulation off, the average over the data-parallel ranks step() will take.

    With ZeRO ≥ 1 the gradients are partitioned; the engine's optimizer computes the global norm
    inside step() and we read it afterwards (:func:`_norm_after_step`).
    """
    if engine.zero_optimization_stage() > 0:
        return None
    params = [p for p in engine.module.parameters() if p.grad is not None]
    if not engine.managed_gradient_accumulation():  # the engine reduces inside step(): the average it will take
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        deepspeed.comm.all_reduce(flat, group=engine.data_parallel_group)
        return (torch.linalg.vector_norm(flat) / engine.dp_world_size).item()
    split = [p.grad for p in params if getattr(p, "tensor_model_parallel", False)]
    if not split:
        return torch.nn.utils.get_total_norm([p.grad for p in params]).item()
    whole = [p.grad for p in params if not getattr(p, "tensor_model_parallel", False)]
    split_sq = torch.nn.utils.get_total_norm(split) ** 2
    deepspeed.comm.all_reduce(split_sq, group=groups.get_tensor_model_parallel_group())
    return (split_sq + torch.nn.utils.get_total_norm(whole) ** 2).sqrt().item()


def _norm_after_step(engine, before: float | None) -> float:
    if before is not None:
        return before
    norm = engine.get_global_grad_norm()
    if norm is None:
        return math.nan
    return float(norm)


def _full_grads(engine) -> dict[str, torch.Tensor]:
    """The reduced, accumulated gradient of every parameter, whole (before the engine's step)."""
    whole = _tp_gather(engine)
    return {name: whole(name, safe_get_full_grad(p)) for name, p in engine.module.named_parameters()}


def _full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter, whole, in full precision (the fp32 master copy where there is one)."""
    whole = _tp_gather(engine)
    full = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        full[name] = whole(name, p if master is None else master)
    return full


def _tp_gather(engine):
    """`whole(name, t)`: `t` — the ZeRO-gathered value of parameter `name` — whole across the
    tensor-parallel group too (all-gathered by its AutoTP layer along the dimension it splits:
    column-parallel weights and biases 0, row-parallel weights 1); other parameters as they are."""
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer

    split = {}
    for name, module in engine.module.named_modules():
        if isinstance(module, LinearLayer):
            split |= {f"{name}.weight": (module, 0), f"{name}.bias": (module, 0)}
        elif isinstance(module, LinearAllreduce):
            split[f"{name}.weight"] = (module, 1)

    def whole(name: str, t: torch.Tensor) -> torch.Tensor:
        if name not in split:
            return t
        module, dim = split[name]
        return module._all_gather_shards(t.contiguous(), module._partition_sizes, dim)

    return whole


def _tensor_parallel_of(engine) -> int:
    """How many ranks the engine's layers are really split over: AutoTP's group, if it split any."""
    if not any(getattr(p, "tensor_model_parallel", False) for p in engine.module.parameters()):
        return 1
    return groups.get_tensor_model_parallel_world_size()
