"""What really ran: read back from the live objects, never copied from the cell, and checked
against the cell's label. A report row is only worth something if its label is what trained.

Each trainer fills a :class:`Provenance` with what its objects say after set-up (DDP or not, the
GradScaler; DeepSpeed's engine: ZeRO stage, GA, micro batch, fp16/bf16, clipping, offload, data
types), and it measures the rest while training: the rows of the first micro-batch, how many
micro-steps the first optimizer step took, and which dtypes the model's modules produced in the
first forward pass. After that first step, any difference from the label fails the cell with a
reason that names both values.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gaeq.accelerator import fp16_emulated
from gaeq.bugs import Bug
from gaeq.matrix import Cell, Role
from gaeq.problem.optim import gradient_clipping
from gaeq.problem.spec import ProblemSpec

COMPUTE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "ds_bf16": "bfloat16", "ds_fp16": "float16"}
"""The dtype a cell's forward pass must compute in (the lowest precision any module produced)."""


class LabelMismatch(RuntimeError):
    """A cell ran something other than its label says."""


def label_of(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What the cell's label (and the problem) promise, in the terms :class:`Provenance` reads back."""
    label: dict[str, Any] = {
        "world_size": cell.world_size,
        "compute_dtype": COMPUTE_DTYPE[cell.dtype],  # measured: the forward's lowest precision
        "micro_batch_rows": cell.micro_batch_size,  # measured: rows of the first micro-batch
        "micro_steps": cell.grad_accum_steps,  # measured: forward passes in the first optimizer step
    }
    if cell.trainer in ("torch", "fsdp", "deepspeed"):
        label["tensor_parallel"] = cell.tensor_parallel  # measured: ranks a layer's parameters are split over
    if cell.trainer == "torch":
        return label | {
            "ddp": cell.world_size > 1 and cell.tensor_parallel == 1,
            "grad_scaler": cell.dtype == "fp16",
            # the baseline is the reference: its norm summed in float64; every other cell's as users sum it
            "grad_norm_dtype": "float64" if cell.role == Role.BASELINE else "float32",
        }
    if cell.trainer == "fsdp":
        return label | {"fsdp": True, "sharded_parameters": True}
    if cell.trainer in ("hf", "hf_deepspeed"):
        if cell.trainer == "hf_deepspeed":
            label["zero_stage"] = cell.zero_stage
        return label | {
            "grad_accum_steps": cell.grad_accum_steps,
            "model_accepts_loss_kwargs": cell.bug != Bug.HF_LOSS_PER_MICRO_BATCH,
            "average_tokens_across_devices": cell.bug != Bug.HF_TOKENS_PER_DEVICE,
        }
    if cell.trainer == "accelerate":
        return label | {
            # gaeq's ranks run as a launcher starts them (LOCAL_RANK set): accelerate then wraps DDP
            # at world 1 too, as under `accelerate launch` or torchrun — a 1-rank all-reduce, a no-op.
            "ddp": cell.world_size > 1 or "LOCAL_RANK" in os.environ,
            "grad_accum_steps": cell.grad_accum_steps,
            "mixed_precision": {"fp32": "no", "bf16": "bf16"}[cell.dtype],
            "scheduler_steps_with_optimizer": cell.bug == Bug.ACCELERATE_SCHEDULER_PER_PROCESS,
        }
    label |= {
        "zero_stage": cell.zero_stage,
        "micro_batch_size": cell.micro_batch_size,
        "grad_accum_steps": cell.grad_accum_steps,
        "cpu_offload": cell.offload == "cpu",
        "fp16_enabled": cell.dtype == "ds_fp16",
        "bf16_enabled": cell.dtype == "ds_bf16",
    }
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


class Provenance:
    def __init__(self, cell: Cell, problem: ProblemSpec, **read_back: Any) -> None:
        self.label = label_of(cell, problem)
        self.ran: dict[str, Any] = dict(read_back)
        if cell.dtype in ("fp16", "ds_fp16") and fp16_emulated():
            self.ran["fp16_kernels"] = "emulated (GAEQ_FP16_EMULATION=1)"
        self._micro_steps = 0
        self._checked = False
        self._at_first_step: dict[str, Callable[[], Any]] = {}

    def read_at_first_step(self, **measures: Callable[[], Any]) -> None:
        """Facts that exist only once training has begun (files an engine wrote, …), read when the
        first optimizer step is done, before the label is checked."""
        self._at_first_step |= measures

    @contextlib.contextmanager
    def forward(self, inputs: torch.Tensor) -> Iterator[None]:
        """Around each forward pass: the first one records the micro-batch rows and the dtypes
        every module produced."""
        self._micro_steps += 1
        if "compute_dtype" in self.ran:
            yield
            return
        self.ran["micro_batch_rows"] = int(inputs.shape[0])
        with module_output_dtypes() as seen:
            yield
        self.ran["compute_dtype"] = lowest_precision(seen)

    def grad_norm(self, norm: torch.Tensor) -> float:
        """The norm a trainer's clipping returned, as a number; the first records the precision its
        squares were summed in (float32 and float64 sums of a million squares differ by ~1e-5)."""
        self.ran.setdefault("grad_norm_dtype", str(norm.dtype).removeprefix("torch."))
        return norm.item()

    def step_done(self) -> None:
        """After the first optimizer step: compare with the label (LabelMismatch names both)."""
        if self._checked:
            return
        self._checked = True
        self.ran["micro_steps"] = self._micro_steps
        # Not a label, a fact worth seeing: a rank runs one intra-op thread (worker.set_up_rank)
        # unless a library changed it (the thread count changes summation order).
        self.ran["intra_op_threads"] = torch.get_num_threads()
        self.ran |= {key: measure() for key, measure in self._at_first_step.items()}
        wrong = [
            f"{key}: label {want!r}, ran {self.ran.get(key)!r}"
            for key, want in self.label.items()
            if self.ran.get(key) != want
        ]
        if wrong:
            raise LabelMismatch("the cell did not run what its label says — " + "; ".join(wrong))


def engine_norm_dtype(engine) -> str:
    """The precision the engine sums the squares of the norm it clips with: ZeRO ≥ 1 in DeepSpeed's
    norm dtype (``zero.utils.get_norm_dtype``: float64 where the accelerator has it), ZeRO-0 in
    float32 (``runtime.utils.clip_grad_norm_`` takes ``.float()`` of each gradient)."""
    if engine.zero_optimization_stage() == 0:
        return "float32"
    from deepspeed.runtime.zero.utils import get_norm_dtype

    return str(get_norm_dtype()).removeprefix("torch.")


@contextlib.contextmanager
def module_output_dtypes() -> Iterator[set[torch.dtype]]:
    """The floating-point dtypes of every module output produced inside the block."""
    seen: set[torch.dtype] = set()

    def hook(module, args, output) -> None:
        for t in _tensors(output):
            if t.is_floating_point():
                seen.add(t.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def lowest_precision(dtypes: set[torch.dtype]) -> str | None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        if dtype in dtypes:
            return str(dtype).removeprefix("torch.")
    return None


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)
    elif hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):  # transformers' outputs
        yield output.logits
