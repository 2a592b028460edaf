"""What a DeepSpeed config really trains with — the optimizer as DeepSpeed builds it, the learning rate its
scheduler produces step by step, the precision of the gradients, their accumulation and their communication —
said beside what the file seems to say. Read from DeepSpeed (its signatures, its scheduler objects, its engine's
rules), never copied; every `risk` names the experiment cell that shows it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from gaeq.audit.finding import LOW, Finding, enabled
from gaeq.problem.dsconfig import Mirror
from gaeq.problem.schedule import LrCurve, lr_curve, said

TEAM = "experiments/your_team_config.yaml"
"""The team's config of #75 (ds_config_team.json), run as it is: the lr, the clip and the precision it trains with."""
TEAM_CELL = f"{TEAM}: deepspeed-z2-w2-mb4-ga4-ds_bf16"


def optimizer_settings(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    """The optimizer's settings as DeepSpeed builds it: the file's, DeepSpeed's FusedAdam defaults for the rest."""
    if m is None or not m.optimizer.adam:
        return
    from gaeq.problem.mirror import ADAM_SETTINGS, fused_adam_defaults

    defaults, given = fused_adam_defaults(), m.optimizer.params
    shown = ", ".join(
        f"{k} {given[k]!r}" if k in given else f"{k} {defaults[k]!r} (DeepSpeed's default)" for k in ADAM_SETTINGS
    )
    yield Finding(
        key="optimizer.params",
        value=f"{m.optimizer.type}: {shown}",
        effect="fine",
        why="what DeepSpeed's Adam is built with (the file's, its own defaults for the rest); gaeq's torch cells "
        "build torch.optim.AdamW with the same",
    )


def schedule(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    """The lr DeepSpeed's own scheduler gives each optimizer step: its start, peak and end, steps at lr 0, and the
    defaults that set them — a `risk` where the optimizer's lr is not what trains, or a step trains at lr 0."""
    section = config.get("scheduler") or {}
    if not section.get("type"):
        return
    try:
        curve = lr_curve(config)
    except ValueError as exc:  # DeepSpeed's own scheduler refused it: so would its engine (no cell to show it)
        yield Finding(key="scheduler", value=repr(section.get("type")), effect="breaks",
                      why=f"DeepSpeed refuses it, as its engine would: {exc}")  # fmt: skip
        return
    risks = [*_lr_not_used(curve), *_at_zero(curve), *_momentum(curve)]
    left = ", ".join(f"{k} {v!r}" for k, v in curve.defaults.items())
    left = f"left to DeepSpeed's defaults: {left}" if left else "every parameter given"
    why = (
        f"{'; '.join(risks) + ' — ' if risks else ''}DeepSpeed's own {curve.schedule}, stepped after every optimizer "
        f"step: it {said(curve)} ({left})"
    )
    yield Finding(
        key="scheduler",
        value=curve.schedule,
        effect="risk" if risks else "fine",
        why=why,
        evidence=TEAM_CELL if risks else None,
    )


def _lr_not_used(curve: LrCurve) -> Iterator[str]:
    step, top = curve.peak
    if curve.optimizer_lr is None or math.isclose(top, curve.optimizer_lr, rel_tol=1e-6):
        return
    because = {
        "warmup_max_lr": f"{curve.schedule}'s warmup_max_lr defaults to {curve.defaults.get('warmup_max_lr')!r}",
    }
    reason = next((words for key, words in because.items() if key in curve.defaults), None)
    reason = reason or f"{curve.schedule} sets the lr itself from its own parameters"
    yield f"your lr {curve.optimizer_lr:g} is not used: {reason} — it trains at up to {top:g} (step {step})"


def _at_zero(curve: LrCurve) -> Iterator[str]:
    if zero := curve.at_zero:
        shown = ", ".join(map(str, zero[:4])) + ("…" if len(zero) > 4 else "")
        yield f"step{'s' if len(zero) > 1 else ''} {shown} train at lr 0: no update"


def _momentum(curve: LrCurve) -> Iterator[str]:
    if curve.momentum_moves:
        yield (
            f"it moves the momentum (Adam's beta1) from {min(curve.momenta):g} to {max(curve.momenta):g} "
            f"step by step{' (cycle_momentum defaults to True)' if 'cycle_momentum' in curve.defaults else ''}"
        )


def precision(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    """The gradients' dtype, and the dtype they are reduced over ranks in where the file does not say it: the
    engine's own rule (communication_data_type, else fp16 or bf16 where enabled, else fp32)."""
    low = next((name for name in ("fp16", "bf16") if enabled(config, name)), None)
    if low is None:
        return
    yield Finding(
        key=f"{low}.enabled",
        value="true",
        effect="fine",
        why=f"the model's weights, its forward, backward and gradients in {low}, the master weights fp32: judged "
        f"against a {low} reference of the same arithmetic (dtype ds_{low})",
    )
    comm = config.get("communication_data_type")
    if comm is not None and comm not in LOW:
        yield Finding(
            key="communication_data_type",
            value=repr(comm),
            effect="fine",
            why=f"the {low} gradients are reduced over ranks in {comm}: no rounding of their own",
        )
    if comm is None:
        yield Finding(
            key="communication_data_type",
            value=f"absent → {low} ({low} is enabled)",
            effect="risk",
            why=f"DeepSpeed reduces the gradients over ranks in {low} then: each reduction rounds them, more often "
            "the more ranks — write fp32 to reduce them exactly",
            evidence="experiments/your_config.yaml: deepspeed-z2-w2-mb2-ga4@comm_bf16",
        )
