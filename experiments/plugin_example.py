"""Bring your own model, data and loss: the three plugins used by experiments/plugins.yaml.

A matrix names them as ``{import: "plugin_example:function", args: {...}}``; gaeq imports this
module from the matrix file's folder (or the working directory). The contract:

- data:  function(*, seed, **args) -> object with batch(indices) -> (inputs, targets) and,
         optionally, loss_elements(index) -> int (how many loss elements a sample has; default 1).
         A sample must be a pure function of (seed, index): that is what makes splits comparable.
- model: function(**args) -> torch.nn.Module, built under torch.manual_seed(problem.seed).
- loss:  function(outputs, targets) -> scalar tensor: the SUM of per-element losses of the
         micro-batch. gaeq divides by the element count of the whole global batch.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class SineWaves:
    """Regress a sine wave's next value from its last `window` values; phase and frequency per sample."""

    def __init__(self, *, seed: int, window: int = 8) -> None:
        self.seed = seed
        self.window = window

    def _sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        phase, freq = torch.rand(2, generator=g) * torch.tensor([2 * math.pi, 0.5])
        t = torch.arange(self.window + 1, dtype=torch.float32)
        wave = torch.sin(phase + (0.2 + freq) * t)
        return wave[:-1], wave[-1:]

    def batch(self, indices):
        xs, ys = zip(*(self._sample(i) for i in indices))
        return torch.stack(xs), torch.stack(ys)

    def loss_elements(self, index: int) -> int:
        return 1


def sine_waves(*, seed: int, window: int = 8) -> SineWaves:
    return SineWaves(seed=seed, window=window)


def wide_mlp(*, window: int = 8, width: int = 48) -> nn.Module:
    return nn.Sequential(nn.Linear(window, width), nn.SiLU(), nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 1))


def huber_sum(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.huber_loss(outputs.float(), targets, reduction="sum", delta=0.5)
