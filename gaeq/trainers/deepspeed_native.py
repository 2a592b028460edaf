"""DeepSpeed's native gradient accumulation: engine.backward / engine.step on every micro-step.

Read it side by side with torch_manual.py: same skeleton, same names. The differences are
marked ``# ACCUMULATION:`` and are exactly where accumulation differs — who divides the loss,
when gradients are synchronised, who clips and steps at the boundary. ``cell.bug`` lines plant
the mistakes of gaeq/bugs.py where they would really be made.
"""

from __future__ import annotations

import math
import time
from typing import Any

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

from gaeq.matrix import Cell
from gaeq.problem.loss import mean_of_means_factor, share_of_global_mean
from gaeq.problem.optim import build_scheduler, deepspeed_optimizer
from gaeq.problem.spec import ProblemSpec
from gaeq.trainers.base import RunContext, StepRecorder, build_problem, inject_fault
from gaeq.trainers.checkpoint import load_deepspeed, save_deepspeed


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> None:
    built = build_problem(cell, problem, ctx)
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
    if (cell.offload != "none") != engine.zero_cpu_offload():
        raise RuntimeError(f"asked for offload={cell.offload}, the engine has zero_cpu_offload()={engine.zero_cpu_offload()}")
    net = engine
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps)
    recorder.count_collectives(engine)
    start = load_deepspeed(engine, run_dir=ctx.run_dir, resume=cell.resume) if cell.resume else 0

    for step in range(start, problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = engine.get_lr()[0]
        normaliser = built.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        for micro_step in range(plan.grad_accum_steps):
            mb = built.micro_batch(step=step, micro_step=micro_step, rank=ctx.rank)
            boundary = micro_step == plan.grad_accum_steps - 1
            # ACCUMULATION: the engine counts micro-steps and reduces gradients at its own
            # boundary; ours must be the same one.
            if engine.is_gradient_accumulation_boundary() != boundary:
                raise RuntimeError(f"DeepSpeed's boundary disagrees with the plan at step {step}.{micro_step}")
            with built.forwarding(mb):
                micro_loss_sum = built.loss_sum(net(mb.inputs), mb.targets)
            # ACCUMULATION: DeepSpeed divides by GA itself inside engine.backward, so we hand it GA ×
            # this micro-batch's share of the global-batch mean (× world: it averages over ranks).
            # Its return value is that ÷ GA; the loss we log is the forward one.
            loss = micro_loss_sum * share_of_global_mean(world_size=ctx.world_size, normaliser=normaliser)
            loss = loss * plan.grad_accum_steps
            if cell.bug == "mean_of_means":  # planted bug: normalises by its own micro-batch
                loss = micro_loss_sum * mean_of_means_factor(
                    micro_elements=mb.loss_elements, grad_accum_steps=plan.grad_accum_steps
                ) * plan.grad_accum_steps
            engine.backward(loss)
            if boundary:
                grad_norm = _norm_before_step(engine)
                if recorder.wants("grads", step):  # gathered from every partition: all ranks call it
                    recorder.snapshot(step=step, kind="grads", gather=lambda: _full_grads(engine))
            # ACCUMULATION: step() every micro-step; the engine clips, updates, steps the schedule
            # and zeroes gradients only when it is at the boundary.
            engine.step()
            local_loss_sum += micro_loss_sum.item()
        grad_norm = _norm_after_step(engine, grad_norm)
        if recorder.wants("params", step):
            recorder.snapshot(step=step, kind="params", gather=lambda: _full_params(engine))
        recorder.record(
            step=step,
            local_loss_sum=local_loss_sum,
            normaliser=normaliser,
            grad_norm=grad_norm,
            lr=lr,
            seconds=time.perf_counter() - started,
        )
        if step + 1 in cell.save_at:  # a collective: every rank saves its partitions
            save_deepspeed(engine, run_dir=ctx.run_dir, cell_id=cell.id, step=step + 1)
    recorder.close()
    engine.destroy()


def deepspeed_config(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """Every knob that changes the optimisation, written out. Nothing is left to a default."""
    config = {
        "train_batch_size": cell.train_batch_size,
        "train_micro_batch_size_per_gpu": cell.micro_batch_size,
        "gradient_accumulation_steps": cell.grad_accum_steps,
        "optimizer": deepspeed_optimizer(problem.optimizer),
        # DeepSpeed 0.19 clips to 1.0 by default; 0.0 means off, as in the torch trainer.
        "gradient_clipping": problem.gradient_clipping,
        # Average over ranks after the backward, like DDP: no pre-division, no extra factor.
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "zero_optimization": _zero_config(cell),
        # torch.optim.SGD is not on ZeRO's list of tested optimizers; it is exact elementwise math.
        "zero_allow_untested_optimizer": True,
        # With offload DeepSpeed insists on its CPU Adam unless told otherwise: we keep torch's
        # AdamW, the same update code as the torch trainer.
        "zero_force_ds_cpu_optimizer": False,
        # fp32 and bf16 (forward autocast, base.autocast) keep fp32 weights. ds_bf16 is DeepSpeed's
        # own bf16: bf16 weights and gradients, fp32 master weights, gradients accumulated in fp32.
        "fp16": {"enabled": False},
        "bf16": {"enabled": cell.dtype == "ds_bf16"},
        "data_types": {"grad_accum_dtype": "bf16" if cell.bug == "grad_accum_bf16" else "fp32"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": bool(cell.resume and cell.resume.universal)},
    }
    if cell.bug == "deepspeed_default_clipping":
        del config["gradient_clipping"]  # planted bug: trusts DeepSpeed's default (1.0 in 0.19)
    return config


def _zero_config(cell: Cell) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": cell.zero_stage}
    if cell.zero_stage == 3:
        # Partition every parameter, however small: by default ZeRO-3 keeps tensors under 1e5
        # elements whole on every rank — all of a tiny model, which would make it ZeRO-2 in disguise.
        zero["stage3_param_persistence_threshold"] = 0
    if cell.offload != "none":
        zero["offload_optimizer"] = {"device": cell.offload, "pin_memory": False}
        if cell.zero_stage == 3:
            zero["offload_param"] = {"device": cell.offload, "pin_memory": False}
    return zero


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


def _full_grads(engine) -> dict[str, torch.Tensor]:
    """The reduced, accumulated gradient of every parameter, whole (before the engine's step)."""
    return {name: safe_get_full_grad(p) for name, p in engine.module.named_parameters()}


def _full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter, whole, in full precision (the fp32 master copy where there is one)."""
    full = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)
        full[name] = p if master is None else master
    return full
