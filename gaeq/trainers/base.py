"""What both trainers share: the problem they build, step accounting, recording, fault injection.

Everything that is *not* about how gradients are accumulated lives here, so that the two trainer
modules differ only where accumulation really differs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gaeq.matrix import Cell, ProblemSpec
from gaeq.problem.data import BatchPlan, RegressionData
from gaeq.problem.loss import LOSSES
from gaeq.problem.models import build_model
from gaeq.results.trace import StepRecord, TraceWriter


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """Where a cell runs: this process's place in the (already initialised) process group."""

    rank: int
    world_size: int
    device: torch.device
    cell_dir: Path
    on_step: Callable[[int], None] = lambda step: None
    """Called by rank 0 after each optimizer step (progress reporting)."""


@dataclass(frozen=True, kw_only=True)
class Problem:
    """The built problem of one cell: identical for both trainers."""

    plan: BatchPlan
    data: RegressionData
    model: torch.nn.Module
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def micro_batch(self, *, step: int, micro_step: int, rank: int, device: torch.device):
        x, y = self.data.batch(self.plan.sample_indices(step=step, micro_step=micro_step, rank=rank))
        return x.to(device), y.to(device)


def build_problem(cell: Cell, problem: ProblemSpec) -> Problem:
    if cell.world_size != (dist.get_world_size() if dist.is_initialized() else 1):
        raise RuntimeError(f"cell {cell.id} needs world_size {cell.world_size}, process group has another")
    return Problem(
        plan=BatchPlan(
            train_batch_size=cell.train_batch_size,
            micro_batch_size=cell.micro_batch_size,
            world_size=cell.world_size,
            num_samples=problem.data.num_samples,
            seed=problem.seed,
        ),
        data=RegressionData(data=problem.data, model=problem.model, seed=problem.seed),
        model=build_model(problem.model, seed=problem.seed),
        loss_sum=LOSSES[problem.loss],
    )


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Forward-pass autocast for low-precision cells; a no-op in fp32."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class StepRecorder:
    """Every rank calls :meth:`record` (it sums the loss over ranks); rank 0 writes the trace."""

    def __init__(self, *, cell: Cell, ctx: RunContext) -> None:
        self.cell = cell
        self.ctx = ctx
        self.writer = TraceWriter(ctx.cell_dir) if ctx.rank == 0 else None

    def record(self, *, step: int, local_loss_sum: float, normaliser: int, grad_norm: float, lr: float, seconds: float) -> None:
        # float64 end to end: the comparison must not be limited by the logging precision.
        total = torch.tensor([local_loss_sum], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.world_size > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
        if self.writer is None:
            return
        self.writer.write(
            StepRecord(
                step=step,
                loss=total.item() / normaliser,
                grad_norm=float(grad_norm),
                lr=float(lr),
                samples=(step + 1) * self.cell.train_batch_size,
                seconds=seconds,
            )
        )
        self.ctx.on_step(step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def inject_fault(cell: Cell, *, rank: int, step: int) -> None:
    """Test knob (matrix `fault:`): make this rank fail at the start of `step`."""
    fault = cell.fault
    if fault is None or fault.rank != rank or fault.step != step:
        return
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raises at step {step}")
    if fault.kind == "exit":
        os._exit(17)
    while True:  # "hang": a rank that never answers again
        time.sleep(3600)
