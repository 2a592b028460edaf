"""The load-balancing loss of a mixture of experts (models.MoE), as the split sees it.

Per layer, coef × experts × Σᵢ fᵢ·Pᵢ (Switch Transformer): fᵢ the share of the routed tokens expert
i took, Pᵢ its mean router probability. Which tokens fᵢ and Pᵢ are taken over is the question of the
split (MoESpec.balance):

- ``micro_batch``: each micro-batch's own, the loss averaged over the GA × dp micro-batches — the
  usual way; a product of two means over the micro-batch is not a mean over the global batch, so
  it depends on which samples share a micro-batch: not invariant, and measured as such.
- ``global``: the global batch's. fᵢ is a count (no gradient), so it can be known before the first
  backward — a routing-only forward of the step's micro-batches, counted on every rank and summed
  over them (:meth:`Balance.route`); Pᵢ is a sum over tokens ÷ their global count, which a
  micro-batch contributes its part of, like the main loss's num_items. Exact, for one more forward
  per step (without gradient).
- ``global_buffered``: fᵢ from a running buffer of this rank's micro-batches so far in the step —
  what the paper (arXiv 2501.11873) does without the extra pass; an approximation, measured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from gaeq.problem.models import MoE
from gaeq.problem.spec import MoESpec


def moe_layers(model: torch.nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


class Balance:
    """One cell's load-balancing loss: its layers, the weight of a micro-batch's term, and (global
    balance) the step's routing counted ahead, or (buffered) the counts so far."""

    def __init__(self, spec: MoESpec, layers: list[MoE], *, share: float, over_own_tokens: bool = False) -> None:
        self.spec, self.layers = spec, layers
        self.share = share
        """A micro-batch's weight in the mean over the step's micro-batches: 1 / (GA × dp)."""
        self.over_own_tokens = over_own_tokens
        """The global counts ÷ this micro-batch's own tokens, not theirs (a planted bug, Megatron-LM#7213)."""
        self.counts: list[torch.Tensor] = []
        self.tokens = 0

    def route(self, forwards: Iterable[Callable[[], object]]) -> None:
        """Before the step's first backward: global balance runs each of the step's forwards
        (without gradient) and sums the experts' counts over them and over the ranks; buffered
        balance empties its buffer. Nothing for micro-batch balance."""
        self.counts, self.tokens = [torch.zeros_like(layer.routed) for layer in self.layers], 0
        if self.spec.balance != "global":
            return
        with torch.no_grad():
            for forward in forwards:
                forward()
                self._add_stats()
        if dist.is_initialized() and dist.get_world_size() > 1:  # (every rank a data-parallel one: rules.check_moe)
            flat = torch.cat([*self.counts, torch.tensor([self.tokens])]).double()
            dist.all_reduce(flat)
            *counts, tokens = flat.long().split([c.numel() for c in self.counts] + [1])
            self.counts, self.tokens = list(counts), int(tokens)

    def loss(self) -> torch.Tensor:
        """This micro-batch's term (call after its forward), to be added to its share of the main loss:
        experts × Σᵢ fᵢ·Pᵢ × its share of the step's micro-batches, Pᵢ over its own tokens and fᵢ over
        the balance's. (Global balance is then exact: every micro-batch routes micro × seq_len tokens,
        so its share is its tokens' share of the global batch, and the Pᵢ parts add up to the global Pᵢ.)"""
        experts, k = self.spec.experts, self.spec.top_k
        if self.spec.balance == "global_buffered":
            self._add_stats()
        total = torch.zeros(())
        for i, layer in enumerate(self.layers):
            counts, prob_sum, tokens = layer.stats
            if self.spec.balance == "micro_batch":
                f = counts.to(prob_sum.dtype) / (tokens * k)
            else:  # the global batch's counts, or the buffer's so far, over the tokens they counted
                f = self.counts[i].to(prob_sum.dtype) / ((tokens if self.over_own_tokens else self.tokens) * k)
            total = total + experts * (f * prob_sum / tokens).sum()
        return self.spec.aux_loss_coef * total * self.share

    def _add_stats(self) -> None:
        for i, layer in enumerate(self.layers):
            self.counts[i] = self.counts[i] + layer.stats[0]
        self.tokens += self.layers[0].stats[2]
