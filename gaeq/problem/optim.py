"""One optimisation spec → the torch objects *and* the DeepSpeed config, so every side agrees.

Every knob that changes the optimisation is written out here explicitly for every trainer.
Library defaults are not trusted: DeepSpeed clips gradients to 1.0 unless told otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from gaeq.problem.spec import OptimizerSpec, ProblemSpec, ScheduleSpec


def lr_factor(schedule: ScheduleSpec, *, steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step `s` (0-based). Stepped once per optimizer step."""

    def factor(s: int) -> float:
        if schedule.name == "constant":
            return 1.0
        if s < schedule.warmup_steps:  # transformers' warmup starts at 0, gaeq's one step further
            return (s + (schedule.warmup_convention == "gaeq")) / schedule.warmup_steps
        progress = min(1.0, (s - schedule.warmup_steps) / max(1, steps - schedule.warmup_steps))
        floor = schedule.min_lr_ratio
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(named: Iterable[tuple[str, torch.nn.Parameter]], problem: ProblemSpec) -> torch.optim.Optimizer:
    """The torch trainer's optimizer over the model's named parameters: the same class and arguments
    DeepSpeed builds from :func:`deepspeed_optimizer` — or, with a deepspeed_config, the mirror of
    what DeepSpeed builds from it."""
    named = list(named)
    params = [p for _, p in named]
    if problem.mirror is not None:
        from gaeq.problem.mirror import mirrored_optimizer

        return mirrored_optimizer(params, problem.mirror.optimizer)
    spec = problem.optimizer
    if spec.name == "muon":
        return _muon(named, spec)
    if spec.name == "torch_muon":
        return TorchMuonWithAdamW(named, spec)
    kwargs = _optimizer_kwargs(spec)
    if spec.name == "adamw":
        return torch.optim.AdamW(params, **kwargs)
    return torch.optim.SGD(params, **kwargs)


MUON_SKIPS = ("embed", "lm_head")
"""Name parts that keep a matrix out of Muon (DeepSpeed's ``set_optimizer_flags``: embeddings and the
output head go to the AdamW half, as every other parameter of fewer than 2 dimensions)."""


def muon_matrix(name: str, param: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed's Muon orthogonalises this parameter's update (its ``use_muon``)."""
    return param.ndim >= 2 and not any(part in name.lower() for part in MUON_SKIPS)


def _muon(named: list[tuple[str, torch.nn.Parameter]], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """DeepSpeed's MuonWithAuxAdam, as its engine builds it from :func:`deepspeed_optimizer` at ZeRO-0
    (every matrix whole: its step orthogonalises each), the AdamW half torch's — the same update code."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    matrices = [p for n, p in named if muon_matrix(n, p)]
    rest = [p for n, p in named if not muon_matrix(n, p)]
    muon = {"lr": spec.lr, "momentum": spec.momentum, "weight_decay": spec.weight_decay, "ns_method": NS_METHOD}
    adam = {"lr": spec.adam_lr or spec.lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
    groups = [{"params": matrices, "use_muon": True, **muon}, {"params": rest, "use_muon": False, **adam}]
    return MuonWithAuxAdam(
        [g for g in groups if g["params"]], adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={"foreach": False}
    )


class TorchMuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon over the matrices (:func:`muon_matrix`, DeepSpeed's rule: the same split as
    `muon`), torch.optim.AdamW over the rest, stepped together — as a torch user pairs them (torch's
    Muon takes 2-D parameters only). Its groups are theirs, so a scheduler moves both."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], spec: OptimizerSpec) -> None:
        self.muon = torch.optim.Muon(
            [p for n, p in named if muon_matrix(n, p)],
            lr=spec.lr,
            weight_decay=spec.weight_decay,
            momentum=spec.momentum,
            nesterov=True,
            ns_steps=5,
            adjust_lr_fn="original",  # × sqrt(max(1, rows / cols)): DeepSpeed's
        )
        adam = {"lr": spec.adam_lr or spec.lr, "betas": spec.betas, "eps": spec.eps, "weight_decay": spec.weight_decay}
        self.adamw = torch.optim.AdamW([p for n, p in named if not muon_matrix(n, p)], **adam, foreach=False)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})

    @torch.no_grad()
    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


NS_METHOD = "gram"
"""DeepSpeed's Newton–Schulz by default: on the Gram matrix, in fp16 where the accelerator has it, else fp32."""


def build_scheduler(optimizer: torch.optim.Optimizer, problem: ProblemSpec):
    """Used by every trainer (DeepSpeed receives it as a client scheduler, stepped at each boundary).
    With a deepspeed_config: the torch trainer's mirror of the file's scheduler (DeepSpeed builds its own)."""
    if problem.mirror is not None:
        from gaeq.problem.mirror import DeepSpeedSchedule

        return DeepSpeedSchedule(optimizer, problem.mirror.schedule, problem.mirror.schedule_params)
    return LambdaLR(optimizer, lr_factor(problem.schedule, steps=problem.steps))


def gradient_clipping(problem: ProblemSpec) -> float:
    """The max global grad norm (0: none). With a deepspeed_config, the file's — or, when it has no
    `gradient_clipping` key, DeepSpeed's default, read from DeepSpeed."""
    if problem.mirror is None:
        return problem.gradient_clipping
    if problem.mirror.gradient_clipping is not None:
        return problem.mirror.gradient_clipping
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    return float(GRADIENT_CLIPPING_DEFAULT)


def deepspeed_optimizer(spec: OptimizerSpec) -> dict[str, Any]:
    """The `optimizer` section of the DeepSpeed config.

    `torch_adam: true` makes DeepSpeed build `torch.optim.AdamW` (not its FusedAdam/CPUAdam), so the
    two trainers run the same update code; SGD is looked up in `torch.optim` by name.
    """
    if spec.name == "adamw":
        return {"type": "AdamW", "params": {**_optimizer_kwargs(spec), "torch_adam": True}}
    if spec.name == "muon":  # its AdamW half torch's too (torch_adam), per-tensor kernels (foreach)
        return {
            "type": "Muon",
            "params": {
                "lr": spec.lr,
                "momentum": spec.momentum,
                "weight_decay": spec.weight_decay,
                "ns_method": NS_METHOD,
                "adam_lr": spec.adam_lr or spec.lr,
                "betas": list(spec.betas),
                "eps": spec.eps,
                "torch_adam": True,
                "foreach": False,
            },
        }
    return {"type": "SGD", "params": _optimizer_kwargs(spec)}


def _optimizer_kwargs(spec: OptimizerSpec) -> dict[str, Any]:
    # foreach=False: the same per-tensor kernels for every trainer (and on any device).
    if spec.name == "adamw":
        return {
            "lr": spec.lr,
            "betas": list(spec.betas),
            "eps": spec.eps,
            "weight_decay": spec.weight_decay,
            "amsgrad": False,
            "foreach": False,
        }
    return {
        "lr": spec.lr,
        "momentum": spec.momentum,
        "dampening": 0.0,
        "weight_decay": spec.weight_decay,
        "nesterov": False,
        "foreach": False,
    }
