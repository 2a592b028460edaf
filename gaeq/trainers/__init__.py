"""HOW gradients are accumulated: the pair of trainers the lab exists to compare (manual PyTorch,
DeepSpeed), and the libraries people train with (accelerate, the transformers Trainer)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def __getattr__(name: str) -> Any:
    # RunContext lives with torch (gaeq.trainers.base); importing this package (e.g. for the
    # checkpoint path helpers in `gaeq run`'s parent) must not import torch.
    if name == "RunContext":
        from gaeq.trainers.base import RunContext

        return RunContext
    raise AttributeError(name)


def trainer_for(name: str) -> Callable[..., None]:
    """The train function of a trainer name (imports DeepSpeed only when asked for)."""
    if name == "torch":
        from gaeq.trainers.torch_manual import train
    elif name == "deepspeed":
        from gaeq.trainers.deepspeed_native import train
    elif name == "fsdp":
        from gaeq.trainers.fsdp import train
    elif name == "accelerate":
        from gaeq.trainers.accelerate_native import train
    elif name in ("hf", "hf_deepspeed"):
        from gaeq.trainers.hf_trainer import train
    else:
        raise ValueError(f"unknown trainer {name!r}")
    return train


__all__ = ["RunContext", "trainer_for"]
