"""A tensor that may be a DTensor (FSDP2's parameters and gradients, tensor parallelism's), read where it
lives: its local block, where that block sits in the whole tensor, and sums over the ranks that hold the
other blocks. Plain tensors pass through as their own whole. A leaf: no gaeq imports.

A DTensor's placements say, per mesh dimension, whether the tensor is split over it (``Shard``), held
whole by every rank of it (``Replicate``) or summed over it (``Partial``): a sum over the whole tensor is
each rank's sum over its block, added over the mesh dimensions that shard it — never over those that
replicate it (HSDP's replicas hold the same block)."""

from __future__ import annotations

import torch


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """The block of `t` this rank holds (the tensor itself when it is no DTensor)."""
    return t.to_local() if is_dtensor(t) else t


def block(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's block of `t` within the whole tensor."""
    if not is_dtensor(t):
        return tuple(t.shape), (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)


def sharded_over(t: torch.Tensor) -> tuple:
    """A key for the process groups a sum over `t`'s blocks is completed over: () for a plain tensor."""
    if not is_dtensor(t):
        return ()
    dims = tuple(i for i, p in enumerate(t.placements) if p.is_shard())
    return (id(t.device_mesh), dims) if dims else ()


def sum_over_blocks(partial: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`partial` (this rank's sum over its block of `t`, any shape) summed over the ranks holding `t`'s
    other blocks — a collective: every rank of the mesh calls it, in the same order."""
    if not is_dtensor(t):
        return partial
    import torch.distributed as dist

    for dim, placement in enumerate(t.placements):
        if placement.is_shard() and t.device_mesh.size(dim) > 1:
            dist.all_reduce(partial, group=t.device_mesh.get_group(dim))
    return partial


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor's blocks gathered: a collective)."""
    return t.full_tensor() if is_dtensor(t) else t


def entries_here(t: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the whole tensor's flat positions `where`: which live in this rank's block (a mask over `where`)
    and their flat positions in the local block."""
    shape, offset = block(t)
    if not is_dtensor(t):
        return torch.ones(len(where), dtype=torch.bool, device=where.device), where
    coords = torch.stack(torch.unravel_index(where.cpu(), tuple(t.shape)))  # [dims, k]
    start = torch.tensor(offset).unsqueeze(1)
    size = torch.tensor(shape).unsqueeze(1)
    inside = ((coords >= start) & (coords < start + size)).all(0)
    rel = coords[:, inside] - start[:, :1]
    flat = torch.zeros(rel.shape[1], dtype=torch.long)
    for d, n in enumerate(shape):
        flat = flat * n + rel[d]
    return inside.to(where.device), flat.to(where.device)
