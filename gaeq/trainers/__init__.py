"""HOW gradients are accumulated: the pair of trainers the lab exists to compare (manual PyTorch,
DeepSpeed), and the libraries people train with (accelerate, the transformers Trainer)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from gaeq.registry import TRAINERS


def __getattr__(name: str) -> Any:
    # RunContext lives with torch (gaeq.trainers.base); importing this package (e.g. for the
    # checkpoint path helpers in `gaeq run`'s parent) must not import torch.
    if name == "RunContext":
        from gaeq.trainers.base import RunContext

        return RunContext
    raise AttributeError(name)


def trainer_for(name: str, *, pipeline_parallel: int = 1) -> Callable[..., dict]:
    """The train function of a trainer name — of its pipeline module for a cell with pipeline stages
    (gaeq/registry.py; imports its libraries only when asked for)."""
    if name not in TRAINERS:
        raise ValueError(f"unknown trainer {name!r}")
    spec = TRAINERS[name]
    module = spec.pipeline if pipeline_parallel > 1 else spec.module
    if module is None:
        raise ValueError(f"trainer {name!r} does not pipeline")
    return importlib.import_module(module).train


__all__ = ["RunContext", "trainer_for"]
