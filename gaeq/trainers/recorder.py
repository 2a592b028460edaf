"""What every trainer records at each optimizer step: the trace (the loss summed over data-parallel ranks
in float64, the grad norm, the lr, the cost), the snapshots a matrix tracks, the model state a rank holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from gaeq.matrix import Cell
from gaeq.problem.data import BatchPlan
from gaeq.results.snapshots import SnapshotWriter, wanted
from gaeq.results.trace import StepRecord, TraceWriter
from gaeq.trainers.base import RunContext
from gaeq.trainers.cost import CommCounter, PeakMemory, PipelineCost, model_state_bytes


class StepRecorder:
    """Every rank calls :meth:`record` (it sums the loss over ranks) and gathers the snapshots it
    :meth:`wants` (gathering is a collective under ZeRO); rank 0 writes the trace and snapshots."""

    def __init__(self, *, cell: Cell, ctx: RunContext, steps: int, plan: BatchPlan) -> None:
        self.cell = cell
        self.plan = plan
        """The samples of each step (an epoch's short last step holds fewer)."""
        self.ctx = ctx
        self.steps = steps
        self.writer = TraceWriter(ctx.cell_dir) if ctx.rank == 0 else None
        self.snapshots = SnapshotWriter(ctx.cell_dir) if ctx.rank == 0 and cell.snapshots else None
        self.comm = CommCounter()
        self.pipeline = PipelineCost()
        """A pipeline trainer's stages report their p2p transfers and compute time here."""
        self.memory = PeakMemory(ctx.device)
        self._model_state_bytes = 0
        place = cell.place(ctx.rank)
        self._counts_loss = not place.tensor and place.stage == cell.pipeline_parallel - 1
        """A tensor-parallel group saw one micro-batch: its first rank counts it; a pipeline's loss exists on
        its last stage only."""

    def count_collectives(self, wrapper) -> None:
        """Count the bytes `wrapper` (DDP, a DeepSpeed engine, an FSDP2 module, a TensorParallel
        split; None: nothing) communicates. Call it once per wrapper."""
        self.comm.attach(wrapper)

    def wants(self, kind: str, step: int) -> bool:
        """Whether `kind` ("grads" or "params") is saved at `step`: the same answer on every rank."""
        return kind in self.cell.snapshots and wanted(step, every=self.cell.snapshot_every, steps=self.steps)

    def measure_model_state(self, *, step: int, micro_step: int, model: torch.nn.Module, optimizer: object) -> None:
        """Call after every backward: once per cell — after the first micro-step of the second
        optimizer step (the optimizer state exists from the first; with GA > 1, mid-accumulation) —
        counts the parameters, gradients and optimizer state this rank holds (cost.model_state_bytes)."""
        if self.writer is not None and (step, micro_step) == (min(1, self.steps - 1), 0):
            self._model_state_bytes = model_state_bytes(model, optimizer)

    def snapshot(self, *, step: int, kind: str, gather: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """`gather()` runs on every rank (it may be a collective) and is not counted as training traffic."""
        with self.comm.paused():
            named = gather()
        if self.snapshots is not None:
            self.snapshots.add(step=step, kind=kind, named=named)

    def record(
        self,
        *,
        step: int,
        local_loss_sum: float,
        normaliser: int,
        grad_norm: float,
        lr: float,
        seconds: float,
        skipped: bool = False,
    ) -> None:
        # float64 end to end: the comparison must not be limited by the logging precision.
        comm_bytes, a2a_bytes = self.comm.take(), self.comm.take_all_to_all()
        p2p_bytes, computing, span = self.pipeline.take()
        if not self._counts_loss:
            local_loss_sum = 0.0
        if self.ctx.world_size > 1:  # the loss sum and (pipelines) the ranks' compute time; the span: the longest
            total = torch.tensor([local_loss_sum, computing], dtype=torch.float64, device=self.ctx.device)
            longest = torch.tensor([span], dtype=torch.float64, device=self.ctx.device)
            with self.comm.paused():  # the lab's own collectives, not training traffic
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
                if self.cell.pipeline_parallel > 1:
                    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
            (local_loss_sum, computing), span = total.tolist(), longest.item()
        if self.writer is None:
            return
        self.writer.write(
            StepRecord(
                step=step,
                loss=local_loss_sum / normaliser,  # (summed over the ranks)
                grad_norm=float(grad_norm),
                lr=float(lr),
                samples=self.plan.step_positions(step).stop,  # trained through this step
                seconds=seconds,
                skipped=skipped,
                comm_bytes=comm_bytes,
                peak_mem_bytes=self.memory.peak_bytes(),
                model_state_bytes=self._model_state_bytes,
                p2p_bytes=p2p_bytes,
                a2a_bytes=a2a_bytes,
                # the mean share of the pipeline's span a rank did not compute
                bubble=1.0 - computing / self.ctx.world_size / span if span > 0 else None,
            )
        )
        self._model_state_bytes = 0
        self.ctx.on_step(step)

    def close(self) -> None:
        self.comm.detach()
        self.pipeline.detach()
        self.memory.close()
        if self.snapshots is not None:
            self.snapshots.close()
        if self.writer is not None:
            self.writer.close()  # last: a published trace means a complete cell
