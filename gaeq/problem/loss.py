"""Losses and their normalisation over the *global* batch.

A loss function returns the **sum** of per-sample losses of a micro-batch. Dividing by a quantity
of the global batch (here: its sample count B), which the BatchPlan knows up front, makes every
sample weigh the same whatever the split. Trainers turn that into the right backward scale.
"""

from __future__ import annotations

import torch

from gaeq.problem.data import BatchPlan


def mse_sum(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over samples of the per-sample MSE (mean over output features)."""
    return (pred.float() - target).pow(2).mean(dim=-1).sum()


def global_normaliser(plan: BatchPlan, *, step: int) -> int:
    """The denominator of step `step`'s loss: samples in the global batch (per-sample losses)."""
    del step  # per-sample losses: the same every step; token losses will count valid tokens here
    return plan.train_batch_size


LOSSES = {"mse": mse_sum}
