"""Model plugins defined in a test module (tests/unit/test_plugins_and_variants.py names them by import path)."""

from __future__ import annotations

import subprocess

import torch.distributed as dist
from torch import nn


def two_layer(*, in_features: int = 8, out_features: int = 2, width: int = 24) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, out_features))


def not_a_module(**_):
    return "a string, not a torch.nn.Module"


def normed(*, in_features: int = 8, out_features: int = 2, width: int = 24, norm: str = "layer") -> nn.Module:
    layers = {"layer": nn.LayerNorm(width), "none": nn.Identity()}
    return nn.Sequential(nn.Linear(in_features, width), layers[norm], nn.Tanh(), nn.Linear(width, out_features))


def with_a_helper(**kwargs) -> nn.Module:
    """two_layer, built by a rank that starts a helper process of its own (as a JIT compile does): the
    parent, which checks the problem without a process group, starts none."""
    if dist.is_initialized():
        subprocess.Popen(["sleep", "600"])  # noqa: S603,S607 - a stand-in that outlives nothing on its own
    return two_layer(**kwargs)
