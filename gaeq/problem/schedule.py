"""The learning rate a DeepSpeed config really trains with: DeepSpeed's own scheduler object, built from the
config's `scheduler` section on a stand-in optimizer with the config's optimizer settings, stepped as the engine
steps it (once after every optimizer step) — never re-derived. Where the file is silent, DeepSpeed's defaults
apply; they are read from its scheduler's signature and said (`LrCurve.defaults`).

What `gaeq audit` says of a schedule: where it starts, where it peaks and at what lr beside the optimizer's, the
steps it trains at lr 0, and the momentum a schedule moves (OneCycle cycles Adam's beta1)."""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MOST_STEPS = 10_000
"""Optimizer steps the curve is stepped through at most (a schedule longer than that is read that far)."""
ADAM = ("adam", "adamw", "fusedadam", "cpuadam", "onebitadam", "zerooneadam", "onebitlamb", "lamb")


@dataclass(frozen=True)
class LrCurve:
    schedule: str | None
    """DeepSpeed's scheduler class (None: none: the optimizer's lr throughout)."""
    optimizer_lr: float | None
    """The lr the file gives its optimizer (None: it names none — the client's optimizer, or DeepSpeed's default)."""
    lrs: tuple[float, ...]
    """The lr of optimizer steps 0, 1, … as the engine trains them."""
    momenta: tuple[float, ...] = ()
    """The momentum (Adam's beta1) of each step, where the schedule moves it."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """The schedule's parameters the file leaves out, at DeepSpeed's defaults."""

    @property
    def peak(self) -> tuple[int, float]:
        """(the first step at the highest lr, that lr)."""
        top = max(self.lrs)
        return self.lrs.index(top), top

    @property
    def at_zero(self) -> list[int]:
        """The steps trained at lr 0: their updates move no weight."""
        return [s for s, lr in enumerate(self.lrs) if lr == 0]

    @property
    def momentum_moves(self) -> bool:
        return len(set(self.momenta)) > 1


def lr_curve(config: dict[str, Any], steps: int | None = None) -> LrCurve:
    """The lr of each optimizer step the config trains with (its first `steps`, else as far as its schedule
    says: total_num_steps, a warmup, a cycle — at most MOST_STEPS). Raises ValueError for a scheduler DeepSpeed
    has not, or parameters its scheduler refuses (the engine would refuse them too)."""
    from deepspeed.runtime import lr_schedules  # (its accelerator set by the caller: gaeq.audit)

    optimizer = _stand_in(config.get("optimizer") or {})
    given = (config.get("optimizer") or {}).get("params", {}).get("lr")
    section = config.get("scheduler") or {}
    name = section.get("type")
    if name is None:
        return LrCurve(schedule=None, optimizer_lr=given, lrs=(optimizer.param_groups[0]["lr"],) * (steps or 1))
    cls = getattr(lr_schedules, name, None)
    if not (isinstance(cls, type) and name in lr_schedules.VALID_LR_SCHEDULES):
        raise ValueError(f"scheduler.type {name!r}: DeepSpeed has {', '.join(lr_schedules.VALID_LR_SCHEDULES)}")
    params = dict(section.get("params") or {})
    signature = inspect.signature(cls)
    defaults = {
        k: v.default
        for k, v in signature.parameters.items()
        if k not in ("optimizer", "last_batch_iteration")
        and k not in params
        and v.default is not inspect.Parameter.empty
    }
    with _quiet():  # (DeepSpeed logs a warning as its scheduler is first read)
        try:
            scheduler = cls(optimizer, **params)
        except TypeError as exc:
            raise ValueError(f"scheduler {name}: {exc}") from None
        n = min(MOST_STEPS, steps or _length(name, params | defaults))
        lrs, momenta = [], []
        group = optimizer.param_groups[0]
        for _ in range(n):
            lrs.append(float(group["lr"]))
            momenta.append(float(group["betas"][0]) if "betas" in group else float(group.get("momentum", 0.0)))
            scheduler.step()
    moved = tuple(momenta) if len(set(momenta)) > 1 else ()
    return LrCurve(schedule=name, optimizer_lr=given, lrs=tuple(lrs), momenta=moved, defaults=defaults)


@contextlib.contextmanager
def _quiet():
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _stand_in(section: dict[str, Any]) -> torch.optim.Optimizer:
    """An optimizer with the file's lr and momentum (Adam's betas, SGD's momentum): what a schedule reads and
    writes; DeepSpeed's FusedAdam defaults where the file is silent."""
    import torch  # here, not above: `gaeq run` imports this module, and its fork server must start before torch

    params = section.get("params") or {}
    weight = [torch.nn.Parameter(torch.zeros(1))]
    if str(section.get("type", "adam")).lower() in ADAM:
        from gaeq.problem.mirror import fused_adam_defaults

        default = fused_adam_defaults()
        return torch.optim.AdamW(
            weight, lr=params.get("lr", default["lr"]), betas=params.get("betas", default["betas"])
        )
    return torch.optim.SGD(weight, lr=params.get("lr", 1e-3), momentum=params.get("momentum", 0.9))


def _length(name: str, p: dict[str, Any]) -> int:
    """How far a schedule says it goes: past its warmup, its total, its cycle and decay."""
    if "total_num_steps" in p:
        return int(p["total_num_steps"]) + 1
    if name == "OneCycle":
        first = int(p["cycle_first_step_size"])
        second = int(p["cycle_second_step_size"] or first)
        return first + second + max(1, int(p.get("decay_step_size") or 0)) * 2
    if name == "LRRangeTest":
        return 4 * int(p["lr_range_test_step_size"])
    return int(p.get("warmup_num_steps", 1000)) + 2


def said(curve: LrCurve) -> str:
    """The curve in words: where it starts, peaks and ends."""
    step, top = curve.peak
    last = len(curve.lrs) - 1
    return f"starts at {curve.lrs[0]:.3g}, peaks at {top:.3g} (step {step}), is {curve.lrs[-1]:.3g} at step {last}"
