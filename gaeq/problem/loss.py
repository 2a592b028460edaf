"""Losses and their normalisation over the *global* batch.

A loss function returns the **sum** of its per-element losses over a micro-batch (an element is a
sample for MSE, a valid token for cross-entropy). Dividing by the number of elements of the whole
global batch (``num_items``) — known up front, because samples are pure functions of their index —
makes every element weigh the same whatever the split: ÷ GA is included, and the trainers multiply
by world size because data parallelism averages over ranks. ``loss: hf`` is the same division made
by a transformers model (``num_items_in_batch``, gaeq/problem/hf.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gaeq.problem.completions import ADVANTAGE, LABEL
from gaeq.problem.data import IGNORE_INDEX


def mse_sum(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over samples of the per-sample MSE (mean over output features)."""
    return (pred.float() - target).pow(2).mean(dim=-1).sum()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over valid tokens of the next-token cross-entropy; padding (IGNORE_INDEX) counts for nothing."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def cross_entropy_on_own_shard(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The planted loss_parallel_shard_softmax: each tensor-parallel rank's cross-entropy over its own slice
    of the vocabulary (the local shard of vocabulary-sharded logits) — the softmax normalised over the slice
    alone, a target outside it ignored — where loss_parallel normalises over the whole vocabulary."""
    local = logits.to_local() if hasattr(logits, "to_local") else logits
    width = local.shape[-1]
    start = logits.device_mesh.get_local_rank() * width if hasattr(logits, "device_mesh") else 0
    own = labels - start
    own = torch.where((labels == IGNORE_INDEX) | (own < 0) | (own >= width), IGNORE_INDEX, own)
    return F.cross_entropy(local.float().flatten(0, -2), own.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def policy_gradient_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over completion tokens of −advantage × log π(token) (targets: gaeq/problem/completions.py).
    On-policy — one update per generation, as GRPO and DAPO run by default — PPO's clipped ratio is 1
    and its gradient −A ∇log π: this objective's. Its value is the advantage-weighted negative
    log-likelihood (the ratio's would be −A whatever the policy), so the loss curve moves with it."""
    labels, advantages = targets[..., LABEL].long(), targets[..., ADVANTAGE]
    nll = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return (nll * advantages.flatten().to(nll.dtype)).sum()


LOSSES = {"mse": mse_sum, "cross_entropy": cross_entropy_sum, "policy_gradient": policy_gradient_sum}


def cross_entropy_row_means(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over rows of each row's mean cross-entropy over its valid tokens: a row (a pack) weighs
    the same whatever its token count — the reduction of the planted bug packed_sequences_weighted_per_pack."""
    per_token = F.cross_entropy(
        logits.float().transpose(1, -1), labels, ignore_index=IGNORE_INDEX, reduction="none"
    )  # (rows, seq_len)
    return (per_token.sum(dim=1) / (labels != IGNORE_INDEX).sum(dim=1).clamp(min=1)).sum()


def mean_of_means_count(*, micro_elements: int, grad_accum_steps: int, data_parallel: int) -> int:
    """The count the planted bug ``mean_of_means`` divides by: as if every micro-batch of the global
    batch held this one's elements. Each micro-batch then weighs the same, whatever its element
    count — the mean of micro-batch means. Exact only when every micro-batch has as many elements."""
    return micro_elements * grad_accum_steps * data_parallel
