"""The torch side of a user's DeepSpeed config: the optimizer and LR schedule DeepSpeed builds from
it, re-derived in plain PyTorch (:mod:`gaeq.problem.dsconfig` reads the file; this module builds).

Where the file is silent, DeepSpeed's own defaults apply — read here from DeepSpeed's signatures
and constants, never copied. Two of them matter: DeepSpeed's FusedAdam / CPU Adam default to
weight_decay 0 where torch.optim.AdamW defaults to 0.01, and its "Adam" is AdamW (decoupled weight
decay) unless `adam_w_mode: false`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch

from gaeq.problem.dsconfig import OptimizerMirror

ADAM_SETTINGS = ("lr", "betas", "eps", "weight_decay")
"""What DeepSpeed's FusedAdam (and CPU Adam, whose defaults are the same) takes from a config's optimizer.params."""


def fused_adam_defaults() -> dict[str, Any]:
    """FusedAdam's own defaults for ADAM_SETTINGS, read from its signature: what DeepSpeed fills in where the file
    is silent (weight_decay 0, not torch AdamW's 0.01)."""
    from deepspeed.ops.adam import FusedAdam

    return {k: v.default for k, v in inspect.signature(FusedAdam).parameters.items() if k in ADAM_SETTINGS}


def mirrored_optimizer(params: Iterable[torch.nn.Parameter], spec: OptimizerMirror) -> torch.optim.Optimizer:
    """torch.optim's counterpart of the optimizer DeepSpeed's engine builds from `spec`."""
    if not spec.adam:  # DeepSpeed looks other names up in torch.optim and passes the params as given
        return getattr(torch.optim, spec.type)(params, **spec.params)
    from deepspeed.runtime.config import ADAM_W_MODE_DEFAULT

    given = dict(spec.params)
    torch_adam = given.pop("torch_adam", False)
    adam_w_mode = given.pop("adam_w_mode", ADAM_W_MODE_DEFAULT) or spec.type.lower() == "adamw"  # AdamW is always W
    given.pop("bias_correction", None)  # True (dsconfig refuses False): what torch's Adam does
    given.pop("amsgrad", None)  # False (likewise)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    if torch_adam:  # DeepSpeed builds this very class with the file's params: torch's defaults apply
        return cls(params, **given, foreach=False)
    return cls(params, **(fused_adam_defaults() | given), foreach=False)


class DeepSpeedSchedule:
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (deepspeed.runtime.lr_schedules),
    re-derived: the lr of optimizer step s is the schedule at DeepSpeed's `last_batch_iteration`
    s − 1 (it starts at −1 and is stepped after every optimizer step that was not skipped). None:
    no scheduler, the optimizer's lr throughout. Defaults come from DeepSpeed's signatures."""

    def __init__(self, optimizer: torch.optim.Optimizer, name: str | None, params: dict[str, Any]) -> None:
        self.optimizer = optimizer
        self.name = name
        self.base_lr = optimizer.param_groups[0]["lr"]
        self.params = _defaults(name) | params
        self.last_batch_iteration = -1
        self._apply()

    def lr_at(self, iteration: int) -> float:
        p, lr = self.params, self.base_lr
        if self.name is None:
            return lr
        n = max(2, p["warmup_num_steps"])
        if self.name == "WarmupCosineLR":
            if iteration < 0:
                return 0.0
            if iteration < n:
                return lr * (p["warmup_min_ratio"] + _warmup(p, iteration, n) * (1.0 - p["warmup_min_ratio"]))
            progress = min(1.0, (iteration - n + 1) / max(1, p["total_num_steps"] - n))
            return lr * max(
                0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * (1 + math.cos(math.pi * progress)) / 2
            )
        low = p["warmup_min_lr"]
        high = lr if p["warmup_max_lr"] is None else p["warmup_max_lr"]  # WarmupLR: None → the optimizer's lr
        if iteration < 0:
            return low
        if iteration < n:
            gamma = _warmup(p, iteration, n)
        elif self.name == "WarmupDecayLR":
            gamma = max(0.0, (p["total_num_steps"] - iteration) / max(1.0, p["total_num_steps"] - n))
        else:
            gamma = 1.0
        return low + (high - low) * gamma

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.last_batch_iteration)


def _warmup(p: dict[str, Any], iteration: int, n: int) -> float:
    if p["warmup_type"] == "linear":
        return iteration / n
    return math.log(iteration + 1) / math.log(n)  # "log", DeepSpeed's default (and its fallback)


def _defaults(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    from deepspeed.runtime import lr_schedules

    sig = inspect.signature(getattr(lr_schedules, name))
    return {
        k: v.default
        for k, v in sig.parameters.items()
        if k not in ("optimizer", "last_batch_iteration") and v.default is not inspect.Parameter.empty
    }
