"""DeepSpeed's native gradient accumulation: engine.backward / engine.step on every micro-step.

Read it side by side with torch_manual.py: same skeleton, same names. The differences are
marked ``# ACCUMULATION:`` and are exactly where accumulation differs — who divides the loss,
when gradients are synchronised, who clips and steps at the boundary. ``cell.bug`` lines plant
the mistakes of gaeq/bugs.py where they would really be made.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_grad

from gaeq.accelerator import allow_emulated_fp16
from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.dsconfig import split_config
from gaeq.problem.optim import build_scheduler, deepspeed_optimizer
from gaeq.problem.spec import ProblemSpec
from gaeq.problem.tp import tp_plan
from gaeq.trainers.base import RunContext, StepRecorder, build_cell_problem, inject_fault
from gaeq.trainers.checkpoint import load_deepspeed, save_deepspeed
from gaeq.trainers.provenance import Provenance, engine_norm_dtype


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank; returns what really ran (:mod:`gaeq.trainers.provenance`)."""
    allow_emulated_fp16()
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
        # DeepSpeed 0.19's own ZeRO-3 partitioning takes an fp32 model for bf16 on a CPU without fp16
        # (`Init._set_dtype`: `dtype or fp16 if … else bf16 if …` binds the wrong way) and would swap its
        # parameters to nvme as bf16. Partitioned here, without a dtype, the config's (fp32) is used.
        deepspeed.zero.Init(module=model, config_dict_or_path=config)
    # ACCUMULATION: the engine owns data parallelism (and ZeRO partitioning; AutoTP's split of the
    # layers), the optimizer it builds from the config, and the schedule — ours, or the user's
    # config's own — which it steps at each boundary.
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config,
        lr_scheduler=None if problem.deepspeed_config else (lambda optimizer: build_scheduler(optimizer, problem)),
    )
    net = engine
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps)
    recorder.count_collectives(engine)
    model_dtype, grad_accum_dtype = engine.get_data_types()
    ran = Provenance(
        cell,
        problem,
        **task.model_facts(),
        world_size=engine.world_size,
        tensor_parallel=_tensor_parallel_of(engine),
        zero_stage=engine.zero_optimization_stage(),
        grad_accum_steps=engine.gradient_accumulation_steps(),
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
    start = load_deepspeed(engine, run_dir=ctx.run_dir, resume=cell.resume) if cell.resume else 0

    for step in range(start, problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = engine.get_lr()[0]
        normaliser = task.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        local_loss_sum = 0.0  # this rank's part of the global loss sum, float64 on the host
        skipped_before = engine.skipped_steps
        for micro_step in range(plan.grad_accum_steps):
            mb = task.micro_batch(step=step, micro_step=micro_step)
            boundary = micro_step == plan.grad_accum_steps - 1
            # ACCUMULATION: the engine counts micro-steps and reduces gradients at its own
            # boundary; ours must be the same one.
            if engine.is_gradient_accumulation_boundary() != boundary:
                raise RuntimeError(f"DeepSpeed's boundary disagrees with the plan at step {step}.{micro_step}")
            num_items = task.num_items(cell, mb, normaliser=normaliser)  # what the loss sum is divided by
            with ran.forward(mb.inputs), task.forwarding(mb):
                micro_loss = task.micro_loss(net, mb, num_items=num_items)
            # ACCUMULATION: DeepSpeed divides by GA itself inside engine.backward, and num_items
            # already did, so we hand it GA × our share (× dp: it averages over the data-parallel
            # ranks). Its return value is that ÷ GA; the loss we log is the forward one.
            loss = micro_loss * task.data_parallel * plan.grad_accum_steps
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
            # fp16 overflow skips the update and the schedule, and lowers its loss scale.
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
    return ran.ran


def deepspeed_config(
    cell: Cell,
    problem: ProblemSpec,
    *,
    tp_plan: dict[str, str] | None = None,
    nvme_path: Path | None = None,
    nvme_buffer_numel: int = 0,
) -> dict[str, Any]:
    """Every knob that changes the optimisation, written out. Nothing is left to a default.
    With the user's own deepspeed_config: that file, with the cell's split written in.
    `tp_plan` (gaeq/problem/tp.py): the layers AutoTP splits, for tensor_parallel > 1;
    `nvme_path`: the folder nvme offload swaps to, through buffers of `nvme_buffer_numel`
    elements (at least the largest parameter)."""
    if problem.deepspeed_config is not None:
        config, _ = split_config(problem.deepspeed_config, cell)
        return config
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
        "zero_optimization": _zero_config(cell, nvme_path, nvme_buffer_numel),
        # torch.optim.SGD is not on ZeRO's list of tested optimizers; it is exact elementwise math.
        "zero_allow_untested_optimizer": True,
        # With offload DeepSpeed insists on its CPU Adam unless told otherwise: we keep torch's
        # AdamW, the same update code as the torch trainer.
        "zero_force_ds_cpu_optimizer": False,
        # fp32, bf16 and fp16 (forward autocast, base.autocast) keep fp32 weights; fp16 autocast
        # here has no loss scaler (DeepSpeed's own fp16 is ds_fp16). ds_bf16 / ds_fp16 are
        # DeepSpeed's mixed precision: half weights and gradients, fp32 master weights.
        "fp16": _fp16_config(cell),
        "bf16": {"enabled": cell.dtype == "ds_bf16"},
        "data_types": {"grad_accum_dtype": _grad_accum_dtype(cell)},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": bool(cell.resume and cell.resume.universal)},
    }
    if cell.offload == "nvme":
        config["aio"] = AIO
    if cell.tensor_parallel > 1:
        config["tensor_parallel"] = _autotp_config(cell, tp_plan or {})
        # DeepSpeed 0.19 checks train_batch_size twice, in ways no value satisfies with AutoTP: the
        # engine wants micro × GA × world (tp ranks counted as if they saw other samples), ZeRO-3's
        # zero.Init micro × GA × dp. Left out, it is derived (and the engine reports tp × B).
        del config["train_batch_size"]
    if cell.bug == Bug.DEEPSPEED_DEFAULT_CLIPPING:
        del config["gradient_clipping"]  # planted bug: trusts DeepSpeed's default (1.0 in 0.19)
    return config


def _autotp_config(cell: Cell, plan: dict[str, str]) -> dict[str, Any]:
    """AutoTP training: the plan's layers split column- and row-wise by name, nothing else (no
    preset, no default specs: embeddings, norms and the head stay whole, as in the torch trainer)."""
    patterns = {
        style: [rf"^{re.escape(name)}\.weight$" for name, s in plan.items() if s == style]
        for style in ("colwise", "rowwise")
    }
    return {
        "autotp_size": cell.tensor_parallel,
        "partition_config": {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": patterns["colwise"], "partition_type": "column"},
                {"patterns": patterns["rowwise"], "partition_type": "row"},
            ],
        },
    }


def forget_parallel_groups() -> None:
    """Each engine finds its own groups: AutoTP leaves its (dp, tp) groups in DeepSpeed's
    process-wide state, where the next engine of the process group would take them — a plain
    DeepSpeed cell would average over a data-parallel group of one, an AutoTP cell of another size
    would reuse the old split (DeepSpeed keeps the first tensor-parallel group it made)."""
    groups.mpu = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = None
    groups._MODEL_PARALLEL_GROUP = None
    groups._DATA_PARALLEL_GROUP = None


def _fp16_config(cell: Cell) -> dict[str, Any]:
    """ds_fp16's dynamic loss scaling, written out — the same policy as the torch trainer's
    GradScaler: start at 2^16, halve on every overflow (skipping that update), double after 1000
    clean steps, never below 1."""
    if cell.dtype != "ds_fp16":
        return {"enabled": False}
    return {
        "enabled": True,
        "loss_scale": 0,  # 0: dynamic
        "initial_scale_power": 16,
        "loss_scale_window": 1000,
        "hysteresis": 1,  # lower the scale on the first overflow, as GradScaler does
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    }


def _grad_accum_dtype(cell: Cell) -> str:
    """Where micro-step gradients pile up. ds_bf16: fp32 (bf16 only as a planted bug). ds_fp16:
    fp16 — DeepSpeed 0.19 accumulates an fp16 model's gradients in fp16 at every stage (its
    ZeRO-0 refuses anything else); the loss scale keeps them out of the subnormals."""
    if cell.dtype == "ds_fp16":
        return "fp16"
    return "bf16" if cell.bug == Bug.GRAD_ACCUM_BF16 else "fp32"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _zero_config(cell: Cell, nvme_path: Path | None, nvme_buffer_numel: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": cell.zero_stage}
    if cell.zero_stage == 3:
        # Partition every parameter, however small: by default ZeRO-3 keeps tensors under 1e5
        # elements whole on every rank — all of a tiny model, which would make it ZeRO-2 in disguise.
        zero["stage3_param_persistence_threshold"] = 0
    if cell.offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        if cell.zero_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    if cell.offload == "nvme":  # ZeRO-Infinity: the optimizer state and the parameters in files (ZeRO-3)
        swap = {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": False}
        # 4 buffers: Adam's fp32 parameter, gradient, momentum, variance; no fast_init, no pipelining
        zero["offload_optimizer"] = swap | {
            "buffer_count": 4,
            "fast_init": False,
            "pipeline_read": False,
            "pipeline_write": False,
        }
        # every partition goes to its file (max_in_cpu 0), through 5 buffers each large enough for any
        # parameter (DeepSpeed's examples say 1e8 elements: 2 GB of buffers for a 2 MB model)
        buffer = -(-nvme_buffer_numel // 2**20) * 2**20  # whole MiB-elements
        zero["offload_param"] = swap | {"buffer_count": 5, "buffer_size": buffer, "max_in_cpu": 0}
    return zero


AIO = {
    "block_size": 1_048_576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
    "use_gds": False,
}
"""DeepSpeed's async-I/O settings for nvme offload, written out (its defaults, one thread: 2 cores)."""


def swap_dir(ctx: RunContext) -> Path:
    """Where an nvme cell's engine swaps: a folder of its own in the cell's directory."""
    return ctx.cell_dir / "nvme_swap"


def _swap_bytes(folder: Path) -> int:
    """Bytes the engine has written under its swap folder."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0


def _norm_before_step(engine) -> float | None:
    """ZeRO-0 keeps whole, already-averaged gradients in .grad at the boundary: measure them —
    with AutoTP, the split layers' slices summed over the tensor-parallel group, the rest once.

    With ZeRO ≥ 1 the gradients are partitioned; the engine's optimizer computes the global norm
    inside step() and we read it afterwards (:func:`_norm_after_step`).
    """
    if engine.zero_optimization_stage() > 0:
        return None
    params = [p for p in engine.module.parameters() if p.grad is not None]
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
