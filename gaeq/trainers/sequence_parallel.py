"""DeepSpeed-Ulysses for the torch trainer (the `sequence_parallel` axis): each sample's tokens split
into contiguous slices over the ranks of a sequence-parallel group, which share micro-batches.

Every layer but attention works token by token, so on a rank's slice alone; attention needs the whole
sequence — DeepSpeed's ``DistributedAttention`` trades a slice of tokens × every head for every token ×
a slice of heads (an all-to-all of q, k and v), attends, and trades back (one more; the backward the
same four). Positions start where the slice does. The loss is each rank's sum over its slice's tokens
÷ the global batch's token count — every token of every rank counted, known before the step
(``CellProblem.normaliser``) — and a parameter's gradient is the sum of its slices' (DDP averages over
every rank of the world, so the loop multiplies by the sequence-parallel ranks as by the data-parallel
ones). A model splits if its attention modules have an ``attend`` and it has a ``position_offset``
(gaeq's GPT).
"""

from __future__ import annotations

import torch
from torch import nn

from gaeq.matrix import Cell
from gaeq.problem.models import CausalSelfAttention, causal_attention


class Ulysses(nn.Module):
    """An attention's `attend` over the sequence-parallel group: DeepSpeed's DistributedAttention on
    (batch, tokens, heads, head_dim) tensors — batch first, heads scattered, tokens gathered."""

    def __init__(self, group) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.inner = DistributedAttention(causal_attention, group, scatter_idx=2, gather_idx=1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.inner(q, k, v, 0)  # batch_dim_idx 0


class SequenceParallel:
    """This rank's sequence-parallel group (every rank makes every group, in the same order: a
    collective)."""

    def __init__(self, cell: Cell, *, rank: int) -> None:
        import deepspeed.comm as ds_dist

        sp = cell.sequence_parallel
        groups = [ds_dist.new_group(list(range(first, first + sp))) for first in range(0, cell.world_size, sp)]
        self.group = groups[rank // sp]
        self.size = ds_dist.get_world_size(group=self.group)  # measured: what the label's sp must be

    def parallelize(self, model: nn.Module, *, tokens: slice) -> int:
        """Wrap every attention of `model` and start its positions where this rank's slice of the
        tokens does (`CellProblem.tokens`); returns how many attentions now span the group."""
        wrapped = 0
        for module in model.modules():
            if isinstance(module, CausalSelfAttention):
                module.attend = Ulysses(self.group)
                wrapped += 1
        model.position_offset = tokens.start
        return wrapped
