"""A user's own DeepSpeed config file: read it, mirror its optimisation for the torch side, and
write each cell's config from it. Pure data (no torch, no DeepSpeed import): it runs while a matrix
is validated. What DeepSpeed does when a key is *absent* is read from DeepSpeed itself, in the
ranks (:mod:`gaeq.problem.optim`) and in `gaeq audit` — never written down here.

The DeepSpeed side runs the file as it is; gaeq writes only

- the batch triple (`train_batch_size`, `train_micro_batch_size_per_gpu`,
  `gradient_accumulation_steps`) — the split is what a matrix varies;
- `zero_optimization.stage` and the optimizer/parameter offload, where the matrix has them as
  axes or in a cell (otherwise the file's own stage and offload are the cells');
- `checkpoint.load_universal` in resumed cells.

Everything it overrides is returned by :func:`cell_config` (and printed by `gaeq run` / `gaeq validate`).
The torch side mirrors the optimisation — optimizer, LR schedule, clipping — and nothing else:
the rest of the file (bucket sizes, overlap_comm, communication and accumulation dtypes, ...) is
what the comparison tests. An optimisation key the torch side cannot mirror is bad input.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction", "amsgrad"}
SGD_PARAMS = {"lr", "momentum", "dampening", "weight_decay", "nesterov"}
SCHEDULES = {
    "WarmupLR": {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupDecayLR": {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
    "WarmupCosineLR": {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"},
}
"""DeepSpeed's schedules the torch side mirrors (deepspeed.runtime.lr_schedules), and their params."""


class ConfigError(ValueError):
    """A DeepSpeed config gaeq cannot run or mirror; the message names the key and why."""


def read_config(path: Path) -> dict[str, Any]:
    """A DeepSpeed config file (JSON, or YAML) as a mapping. ConfigError when unreadable."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} ({str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a mapping of keys, got {type(data).__name__}")
    return data


@dataclass(frozen=True, kw_only=True)
class OptimizerMirror:
    type: str
    """As DeepSpeed reads it: "adam", "adamw" (its own family, case-insensitive) or a torch.optim name."""
    params: dict[str, Any]
    """The file's params, as written (DeepSpeed's defaults fill the rest, in the ranks)."""

    @property
    def adam(self) -> bool:
        return self.type.lower() in ("adam", "adamw")


@dataclass(frozen=True, kw_only=True)
class Mirror:
    """The optimisation a DeepSpeed config defines, as the torch side must reproduce it."""

    optimizer: OptimizerMirror
    schedule: str | None
    """A DeepSpeed schedule name (:data:`SCHEDULES`), or None: a constant lr."""
    schedule_params: dict[str, Any] = field(default_factory=dict)
    gradient_clipping: float | None = None
    """None: the key is absent and DeepSpeed's default applies (read from DeepSpeed)."""
    precision: str = "fp32"
    """fp32, ds_bf16 (the file's bf16 section) or ds_fp16 (its fp16 section): the DeepSpeed cells' dtype."""
    zero_stage: int = 0
    offload: str = "none"


def mirror(config: dict[str, Any]) -> Mirror:
    """The optimisation of `config`, or ConfigError naming the first key the torch side cannot mirror."""
    if _enabled(config.get("amp")):
        raise ConfigError("deepspeed_config.amp: apex AMP has no torch-side counterpart gaeq can mirror")
    optimizer = _optimizer(config.get("optimizer"))
    schedule, schedule_params = _schedule(config.get("scheduler"))
    clipping = config.get("gradient_clipping")
    if clipping is not None and not isinstance(clipping, (int, float)):
        raise ConfigError(f"deepspeed_config.gradient_clipping: {clipping!r} is not a number")
    fp16, bf16 = _enabled(config.get("fp16")), _enabled(config.get("bf16", config.get("bfloat16")))
    if fp16 and bf16:
        raise ConfigError("deepspeed_config: fp16 and bf16 are both enabled")
    zero = config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if offload not in ("none", "cpu"):
        raise ConfigError(
            f"deepspeed_config.zero_optimization.offload_optimizer.device: {offload!r} — gaeq runs none or cpu from "
            "a deepspeed_config (nvme: the matrix's offload axis, on gaeq's own config)"
        )
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed_config.zero_optimization.stage: {stage!r} is not 0, 1, 2 or 3")
    return Mirror(
        optimizer=optimizer,
        schedule=schedule,
        schedule_params=schedule_params,
        gradient_clipping=None if clipping is None else float(clipping),
        precision="ds_fp16" if fp16 else "ds_bf16" if bf16 else "fp32",
        zero_stage=stage,
        offload=offload,
    )


def _optimizer(opt: Any) -> OptimizerMirror:
    """The file's optimizer section: Adam/AdamW or SGD, with options the torch side has."""
    if not isinstance(opt, dict) or "type" not in opt:
        raise ConfigError(
            "deepspeed_config.optimizer: absent — gaeq mirrors the optimizer DeepSpeed builds from the file, "
            "so the file must name one (a client optimizer is not part of a config)"
        )
    optimizer = OptimizerMirror(type=str(opt["type"]), params=dict(opt.get("params") or {}))
    kind, params = optimizer.type, optimizer.params
    allowed = ADAM_PARAMS if optimizer.adam else SGD_PARAMS if kind == "SGD" else None
    if allowed is None:
        raise ConfigError(
            f"deepspeed_config.optimizer.type: {kind!r} — gaeq mirrors Adam, AdamW (DeepSpeed's FusedAdam / "
            "CPU Adam / torch_adam) and SGD on the torch side; other optimizers have no mirror"
        )
    for name, value in params.items():
        if name not in allowed:
            raise ConfigError(f"deepspeed_config.optimizer.params.{name}: not an option gaeq can mirror for {kind}")
        _not_auto(f"optimizer.params.{name}", value)
    if params.get("bias_correction", True) is not True or params.get("amsgrad", False) is not False:
        raise ConfigError(
            "deepspeed_config.optimizer.params: bias_correction false / amsgrad true have no torch AdamW mirror"
        )
    return optimizer


def _schedule(sched: Any) -> tuple[str | None, dict[str, Any]]:
    """The file's scheduler section: one of DeepSpeed's :data:`SCHEDULES` and its params (None: constant lr)."""
    if sched is None:
        return None, {}
    schedule = sched.get("type") if isinstance(sched, dict) else None
    if schedule not in SCHEDULES:
        raise ConfigError(f"deepspeed_config.scheduler.type: {schedule!r} — gaeq mirrors {', '.join(SCHEDULES)}")
    params = dict(sched.get("params") or {})
    for name, value in params.items():
        if name not in SCHEDULES[schedule]:
            raise ConfigError(f"deepspeed_config.scheduler.params.{name}: not a parameter of DeepSpeed's {schedule}")
        _not_auto(f"scheduler.params.{name}", value)
    if "total_num_steps" in SCHEDULES[schedule] and "total_num_steps" not in params:
        raise ConfigError(f"deepspeed_config.scheduler.params.total_num_steps: DeepSpeed's {schedule} requires it")
    return schedule, params


def _not_auto(key: str, value: Any) -> None:
    if value == "auto":
        raise ConfigError(f"deepspeed_config.{key}: 'auto' is filled in by the transformers Trainer; write a value")


@dataclass(frozen=True, kw_only=True)
class Override:
    """A value of the file that gaeq replaces in a cell's config."""

    key: str
    file_value: Any
    cell_value: Any
    why: str


def split_config(config: dict[str, Any], cell: Any) -> tuple[dict[str, Any], list[Override]]:
    """:func:`cell_config` for a matrix cell (anything with its split's fields: batch sizes, GA,
    ZeRO stage, offload, resume)."""
    return cell_config(
        config,
        train_batch_size=cell.train_batch_size,
        micro_batch_size=cell.micro_batch_size,
        grad_accum_steps=cell.grad_accum_steps,
        zero_stage=cell.zero_stage,
        offload=cell.offload,
        load_universal=bool(cell.resume and cell.resume.universal),
    )


def cell_config(
    config: dict[str, Any],
    *,
    train_batch_size: int,
    micro_batch_size: int,
    grad_accum_steps: int,
    zero_stage: int,
    offload: str,
    load_universal: bool,
) -> tuple[dict[str, Any], list[Override]]:
    """The file with the cell's split written in, and what that replaced."""
    out = copy.deepcopy(config)
    changed: list[Override] = []

    def put(where: dict, key: str, value: Any, *, path: str, why: str) -> None:
        old = where.get(key)
        if key in where and old != value and old != "auto":
            changed.append(Override(key=path, file_value=old, cell_value=value, why=why))
        where[key] = value

    split = "the split is what the matrix varies"
    fixed = "the matrix's train_batch_size, what every split holds fixed"
    put(out, "train_batch_size", train_batch_size, path="train_batch_size", why=fixed)
    put(out, "train_micro_batch_size_per_gpu", micro_batch_size, path="train_micro_batch_size_per_gpu", why=split)
    put(out, "gradient_accumulation_steps", grad_accum_steps, path="gradient_accumulation_steps", why=split)
    zero = out.setdefault("zero_optimization", {})
    put(zero, "stage", zero_stage, path="zero_optimization.stage", why="the matrix's zero_stage axis")
    for section, stages in (("offload_optimizer", (1, 2, 3)), ("offload_param", (3,))):
        device = offload if zero_stage in stages else "none"
        current = (zero.get(section) or {}).get("device", "none")
        if current != device:
            if section in zero:
                changed.append(
                    Override(
                        key=f"zero_optimization.{section}.device",
                        file_value=current,
                        cell_value=device,
                        why="the matrix's offload axis",
                    )
                )
            zero[section] = {**(zero.get(section) or {}), "device": device}
    if load_universal:
        checkpoint = out.setdefault("checkpoint", {})
        put(
            checkpoint,
            "load_universal",
            True,
            path="checkpoint.load_universal",
            why="a resumed cell loads a universal checkpoint",
        )
    return out, changed


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled", False) is True
