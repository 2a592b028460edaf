"""Tensor parallelism for the torch trainers (DTensor): the (data-parallel, tensor-parallel) mesh,
the model split by its plan (gaeq/problem/tp.py), gradients averaged over the data-parallel ranks,
and the grad norm of the whole model.

Ranks are laid out tensor-parallel innermost: rank = dp rank × tp + tp rank. The ranks of one
tensor-parallel group hold slices of the same layers and see the same micro-batches; the replicated
parameters (embeddings, norms, head) get the same, whole gradient on each of them, because every
column-wise layer's backward sums its input gradient over the group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from gaeq.matrix import Cell
from gaeq.problem.tp import tp_plan


class TensorParallel:
    """One cell's split: its mesh, and what the trainers do differently because of it."""

    def __init__(self, *, cell: Cell, device: torch.device, mesh: DeviceMesh | None = None) -> None:
        """`mesh`: one with ``dp`` and ``tp`` dimensions among others (a pipeline's (pp, dp, tp));
        default: the (dp, tp) mesh of the whole world."""
        self.mesh: DeviceMesh = mesh or init_device_mesh(
            device.type, (cell.data_parallel, cell.tensor_parallel), mesh_dim_names=("dp", "tp")
        )
        self.dp_group = self.mesh["dp"].get_group()
        self.data_parallel = cell.data_parallel

    def parallelize(self, model: torch.nn.Module) -> None:
        """Split the plan's layers over this rank's tensor-parallel group (parameters become DTensors)."""
        styles = {
            "colwise": ColwiseParallel,
            "rowwise": RowwiseParallel,
            "vocab": lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        layers = tp_plan(model)
        parallelize_module(model, self.mesh["tp"], {name: styles[style]() for name, style in layers.items()})
        self.loss_parallel = "vocab" in layers.values()
        """The logits stay sharded by vocabulary: the loss, forward and backward, runs under loss_parallel."""

    def loss_context(self):
        """Around a micro-batch's loss and its backward: torch's loss_parallel where the logits are sharded."""
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def average_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The boundary's all-reduce over the data-parallel ranks (÷ dp), as DDP's: one flat
        buffer of every local gradient (a slice for split layers, the whole tensor otherwise)."""
        if self.data_parallel == 1:
            return
        grads = [local(p.grad) for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat.div_(self.data_parallel)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    per_shard: bool = False,
    dtype: torch.dtype | None = None,
    over: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """torch's clip_grad_norm_ for a model whose parameters are DTensors on any mesh mixed with plain
    tensors: the norm of the whole model's gradient (each tensor's norm reduced over its shards),
    then every gradient × min(1, max_norm / (norm + 1e-6)). Returns the norm before clipping, in the
    precision its squares were summed in: ``dtype`` (the baseline's float64), else the gradients' own.

    ``per_shard``: each rank's norm of the slices it holds — the tensor-parallel mistake of
    measuring a sharded gradient locally (planted bug ``tp_grad_norm_per_shard``).

    ``over``: the group of ranks holding the model's other parameters (a pipeline's stages): their
    squares are summed in too, so that every stage clips by the whole model's norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [full(torch.linalg.vector_norm(local(g) if per_shard else g, dtype=dtype)) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if over is not None:
        squares = total.square().reshape(1)
        dist.all_reduce(squares, group=over)
        total = squares.sqrt()[0]
    if math.isfinite(max_norm):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.item())
    return total


def tensor_parallel_of(model: torch.nn.Module) -> int:
    """How many ranks the model's layers are really split over: the size of the mesh dimension named
    ``tp`` on which some parameter is sharded (1: none is)."""
    sizes = [1]
    for p in model.parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            dim = p.device_mesh.mesh_dim_names.index("tp")
            if isinstance(p.placements[dim], Shard):
                sizes.append(p.device_mesh.size(dim))
    return max(sizes)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective over its mesh), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """The slice of a DTensor this rank holds (a view), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
