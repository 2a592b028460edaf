"""Built-in models. Built from a seed so every rank and every cell starts from the same weights."""

from __future__ import annotations

import torch
from torch import nn

from gaeq.matrix import ModelSpec


class MLP(nn.Module):
    """A tiny tanh MLP. No BatchNorm and no dropout: nothing in it depends on how the batch is split."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        widths = [spec.in_features] + [spec.hidden] * spec.depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Linear(widths[-1], spec.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(x)


def build_model(spec: ModelSpec, *, seed: int) -> nn.Module:
    # A private generator state: the init must not depend on what ran before in this process
    # (processes are reused across cells).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.kind == "mlp":
            return MLP(spec)
    raise ValueError(f"unknown model kind {spec.kind!r}")
