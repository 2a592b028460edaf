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
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gaeq.accelerator import FP16_ENV, fp16_answer_record, fp16_emulated
from gaeq.matrix import Cell
from gaeq.registry import TRAINERS

COMPUTE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "ds_bf16": "bfloat16", "ds_fp16": "float16"}
"""The dtype a cell's forward pass must compute in (the lowest precision any module produced)."""


class LabelMismatch(RuntimeError):
    """A cell ran something other than its label says."""


def label_of(cell: Cell, promised: dict[str, Any]) -> dict[str, Any]:
    """What the cell's label promises, in the terms :class:`Provenance` reads back: what every cell
    promises, and what its trainer's ``promised(cell, problem)`` adds (each trainer module's own)."""
    label: dict[str, Any] = {
        "world_size": cell.world_size,
        "compute_dtype": COMPUTE_DTYPE[cell.dtype],  # measured: the forward's lowest precision
        "micro_batch_rows": cell.micro_batch_size,  # measured: rows of the first micro-batch
        "micro_steps": cell.grad_accum_steps,  # measured: forward passes in the first optimizer step
    }
    if TRAINERS[cell.trainer].tensor_parallel:
        label["tensor_parallel"] = cell.tensor_parallel  # measured: ranks a layer's parameters are split over
    return label | promised


class Provenance:
    def __init__(self, cell: Cell, *, promised: dict[str, Any], **read_back: Any) -> None:
        """`promised`: what the trainer's label promises beyond every cell's (its module's
        ``promised(cell, problem)``); `read_back`: what its live objects say after set-up."""
        self.label = label_of(cell, promised)
        self.facts: dict[str, Any] = dict(read_back)
        """What ran: read back, measured in the first step, then returned by the trainer."""
        fp16 = cell.dtype in ("fp16", "ds_fp16")
        if (answer := fp16_answer_record(ask=fp16)) is not None:  # where DeepSpeed is loaded: it may have asked
            self.facts["accelerator_fp16"] = answer
        if fp16 and fp16_emulated():
            self.facts["fp16_kernels"] = f"emulated ({FP16_ENV}=yes on a CPU without fp16)"
        self._micro_steps = 0
        self._checked = False
        self._at_first_step: dict[str, Callable[[], Any]] = {}

    def read_at_first_step(self, **measures: Callable[[], Any]) -> None:
        """Facts that exist only once training has begun (files an engine wrote, …), read when the
        first optimizer step is done, before the label is checked."""
        self._at_first_step |= measures

    def forward(self, inputs: torch.Tensor) -> contextlib.AbstractContextManager:
        """Around each forward pass: the first one records the micro-batch rows and the dtypes
        every module produced (every later one is counted, nothing more)."""
        self._micro_steps += 1
        if "compute_dtype" in self.facts:
            return contextlib.nullcontext()
        return self._first_forward(inputs)

    @contextlib.contextmanager
    def _first_forward(self, inputs: torch.Tensor) -> Iterator[None]:
        self.facts["micro_batch_rows"] = int(inputs.shape[0])
        with module_output_dtypes() as seen:
            yield
        self.facts["compute_dtype"] = lowest_precision(seen)

    def watch_forwards(self, module: torch.nn.Module) -> None:
        """For a loop the trainer does not write (a pipeline's schedule): every forward of `module`
        is measured as :meth:`forward` measures one."""
        entered: list = []

        def before(_module, args) -> None:
            entered.append(self.forward(args[0]))
            entered[-1].__enter__()

        def after(_module, _args, _output) -> None:
            entered.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def grad_norm(self, norm: torch.Tensor) -> float:
        """The norm a trainer's clipping returned, as a number; the first records the precision its
        squares were summed in (float32 and float64 sums of a million squares differ by ~1e-5)."""
        self.facts.setdefault("grad_norm_dtype", str(norm.dtype).removeprefix("torch."))
        return norm.item()

    def step_done(self) -> None:
        """After each optimizer step. The first: compare with the label (LabelMismatch names both).
        Later: the first step with another number of micro-steps (an epoch's short last step) is
        measured too, and compared with the label's ``short_step_micro_steps`` where it has one."""
        micro_steps, self._micro_steps = self._micro_steps, 0
        if self._checked:
            if micro_steps != self.facts["micro_steps"] and "short_step_micro_steps" not in self.facts:
                self.facts["short_step_micro_steps"] = micro_steps
                want = self.label.get("short_step_micro_steps")
                if want is not None and micro_steps != want:
                    raise LabelMismatch(
                        f"the cell did not run what its label says — short_step_micro_steps: label {want!r}, "
                        f"ran {micro_steps!r}"
                    )
            return
        self._checked = True
        self.facts["micro_steps"] = micro_steps
        # Not a label, a fact worth seeing: a rank runs one intra-op thread (worker.set_up_rank)
        # unless a library changed it (the thread count changes summation order).
        self.facts["intra_op_threads"] = torch.get_num_threads()
        self.facts |= {key: measure() for key, measure in self._at_first_step.items()}
        wrong = [
            f"{key}: label {want!r}, ran {self.facts.get(key)!r}"
            for key, want in self.label.items()
            if key != "short_step_micro_steps" and self.facts.get(key) != want  # (that one: when it comes)
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
