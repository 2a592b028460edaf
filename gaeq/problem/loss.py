"""Losses and their normalisation over the *global* batch.

A loss function returns the **sum** of its per-element losses over a micro-batch (an element is a
sample for MSE, a valid token for cross-entropy). Dividing by the number of elements of the whole
global batch — known up front, because samples are pure functions of their index — makes every
element weigh the same whatever the split. The trainers turn that into their backward scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gaeq.problem.data import IGNORE_INDEX


def mse_sum(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over samples of the per-sample MSE (mean over output features)."""
    return (pred.float() - target).pow(2).mean(dim=-1).sum()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over valid tokens of the next-token cross-entropy; padding (IGNORE_INDEX) counts for nothing."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


LOSSES = {"mse": mse_sum, "cross_entropy": cross_entropy_sum}


def share_of_global_mean(*, world_size: int, normaliser: int) -> float:
    """The factor a rank applies to its micro-batch loss *sum* before backward.

    Data parallelism averages gradients over ranks (÷ world) and accumulation sums them over
    micro-steps, so with this factor every loss element of the global batch weighs exactly
    1 / normaliser — whatever the split. For per-sample losses it is (micro-batch mean) ÷ GA.
    """
    return world_size / normaliser


def mean_of_means_factor(*, micro_elements: int, grad_accum_steps: int) -> float:
    """The naive normalisation (planted bug ``mean_of_means``): each micro-batch is averaged over
    its own elements, then ÷ GA. Exact only when every micro-batch has as many elements."""
    return 1.0 / (micro_elements * grad_accum_steps)
