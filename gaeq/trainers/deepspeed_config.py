"""The config a DeepSpeed engine is built from, every knob that changes the optimisation written
out: gaeq's DeepSpeed trainer builds its engine from it, the transformers Trainer's integration
(`hf_deepspeed`) gets it with what the Trainer owns left "auto", and with the user's own
`deepspeed_config` it is that file with the cell's split written in (`dsconfig.split_config`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.dsconfig import split_config
from gaeq.problem.optim import deepspeed_optimizer
from gaeq.problem.spec import ProblemSpec


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
        # DeepSpeed clips to 1.0 by default; 0.0 means off, as in the torch trainer.
        "gradient_clipping": problem.gradient_clipping,
        # Average over ranks after the backward, like DDP: no pre-division, no extra factor.
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "zero_optimization": _zero_config(cell, nvme_path, nvme_buffer_numel, muon=problem.optimizer.name == "muon"),
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
    if cell.deepspeed_accumulation != "managed":  # a loop that accumulates by hand, telling the engine GA 1
        config["gradient_accumulation_steps"] = 1
        config["train_batch_size"] = cell.micro_batch_size * cell.data_parallel
    if cell.deepspeed_accumulation == "manual_unmanaged":  # DeepSpeed's remedy: step() is the boundary
        config["managed_gradient_accumulation"] = False
    if cell.pipeline_parallel > 1:  # the stages pass whole activations, none recomputed
        config["pipeline"] = {"activation_checkpoint_interval": 0, "pipe_partitioned": False, "grad_partitioned": False}
    if cell.offload == "nvme":
        config["aio"] = AIO
    if cell.tensor_parallel > 1:
        config["tensor_parallel"] = _autotp_config(cell, tp_plan or {})
        # DeepSpeed checks train_batch_size twice, in ways no value satisfies with AutoTP: the
        # engine wants micro × GA × world (tp ranks counted as if they saw other samples), ZeRO-3's
        # zero.Init micro × GA × dp. Left out, it is derived (and the engine reports tp × B).
        del config["train_batch_size"]
    if cell.bug == Bug.DEEPSPEED_DEFAULT_CLIPPING:
        del config["gradient_clipping"]  # planted bug: trusts DeepSpeed's default (1.0)
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
    fp16 — DeepSpeed accumulates an fp16 model's gradients in fp16 at every stage (its
    ZeRO-0 refuses anything else); the loss scale keeps them out of the subnormals."""
    if cell.dtype == "ds_fp16":
        return "fp16"
    return "bf16" if cell.bug == Bug.GRAD_ACCUM_BF16 else "fp32"


def _zero_config(cell: Cell, nvme_path: Path | None, nvme_buffer_numel: int, *, muon: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": cell.zero_stage}
    if cell.zero_stage == 3:
        # Partition every parameter, however small: by default ZeRO-3 keeps tensors under 1e5
        # elements whole on every rank — all of a tiny model, which would make it ZeRO-2 in disguise.
        zero["stage3_param_persistence_threshold"] = 0
        if muon:  # its Muon refuses reduce-scatter (stage3.py): each matrix's gradient whole, to orthogonalise
            zero["reduce_scatter"] = False
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


def nvme_swaps_nothing(cell: Cell, numels: list[int]) -> str | None:
    """Why an nvme cell would write no swap file (None: it writes some). DeepSpeed swaps a tensor only
    from max(MIN_AIO_BYTES, the aio block size) bytes on, and ZeRO-3 hands its swappers partitions:
    each parameter's slice (⌈numel ÷ ranks⌉ elements, the model's dtype) to the parameter swapper, the
    rank's slices of every parameter together (fp32) to the optimizer swapper."""
    from deepspeed.runtime.swap_tensor.utils import MIN_AIO_BYTES

    threshold = max(MIN_AIO_BYTES, AIO["block_size"])
    partitions = [-(-n // cell.data_parallel) for n in numels]
    largest = max(partitions) * (2 if cell.dtype in ("ds_bf16", "ds_fp16") else 4)
    optimizer = sum(partitions) * 4
    if max(largest, optimizer) >= threshold:
        return None
    return (
        f"nvme offload would swap nothing: DeepSpeed swaps a tensor only from {threshold:,} bytes on, and at "
        f"world {cell.world_size} ZeRO-3's largest parameter partition is {largest:,} bytes, the rank's optimizer "
        f"state partition {optimizer:,} — everything would stay in memory (a wider model swaps)"
    )


AIO = {
    "block_size": 1_048_576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
    "use_gds": False,
}
"""DeepSpeed's async-I/O settings for nvme offload, written out (its defaults, one thread: 2 cores)."""
