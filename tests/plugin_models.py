"""Model plugins defined in a test module (tests/unit/test_plugins_and_variants.py names them by import path)."""

from __future__ import annotations

from torch import nn


def two_layer(*, in_features: int = 8, out_features: int = 2, width: int = 24) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, width), nn.Tanh(), nn.Linear(width, out_features))


def not_a_module(**_):
    return "a string, not a torch.nn.Module"


def normed(*, in_features: int = 8, out_features: int = 2, width: int = 24, norm: str = "layer") -> nn.Module:
    layers = {"layer": nn.LayerNorm(width), "none": nn.Identity()}
    return nn.Sequential(nn.Linear(in_features, width), layers[norm], nn.Tanh(), nn.Linear(width, out_features))
