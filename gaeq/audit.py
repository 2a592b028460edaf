"""`gaeq audit`: what a DeepSpeed config does to gradient-accumulation equivalence, one finding per key.

Each finding says the key, its value (or what DeepSpeed does when it is absent — read from
DeepSpeed), its effect (`breaks` / `risk` / `fine`) and why, in a sentence. The lab states nothing
it has not shown: every `breaks` and `risk` names the experiment cell that demonstrates it (a
control that diverges, or a measured difference); tests/unit/test_audit.py checks that each named
cell exists and is expected to show what the finding says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gaeq.problem.dsconfig import BATCH_KEYS, ConfigError, mirror, split_config

Effect = Literal["breaks", "risk", "fine"]
LOW = ("bf16", "bfloat16", "fp16", "float16", "half")


@dataclass(frozen=True, kw_only=True)
class Finding:
    key: str
    value: str
    effect: Effect
    why: str
    evidence: str | None = None
    """experiment file: cell id — where the lab shows it (required for breaks and risk)."""

    @property
    def line(self) -> str:
        shown = f" (shown by {self.evidence})" if self.evidence else ""
        return f"{self.key} = {self.value}: {self.effect} — {self.why}{shown}"


def audit(config: dict[str, Any]) -> list[Finding]:
    """The findings for one DeepSpeed config (a mapping, as read from its file)."""
    from gaeq.runtime.dist import set_accelerator_env

    set_accelerator_env()  # before DeepSpeed's first import: say cpu rather than let it guess (and warn)
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    out: list[Finding] = []
    add = lambda *a, **k: out.append(Finding(**dict(zip(("key", "value", "effect", "why"), a)), **k))  # noqa: E731

    try:
        m = mirror(config)
    except ConfigError as exc:
        m = None
        key, _, why = str(exc).partition(": ")
        add(
            key.removeprefix("deepspeed_config."),
            "as written",
            "risk",
            f"gaeq cannot mirror it on the torch side, so a matrix with this config is bad input ({why})",
        )

    clip = config.get("gradient_clipping")
    if clip is None:
        add(
            "gradient_clipping",
            f"absent → DeepSpeed clips at {GRADIENT_CLIPPING_DEFAULT}",
            "risk",
            "every step whose global grad norm exceeds it is clipped: a PyTorch run without clipping is another "
            "optimisation (gaeq's torch side mirrors the default)",
            evidence="experiments/your_config.yaml: torch-w1-mb4-ga4-bug_unmirrored_default_clipping@clipped",
        )
    else:
        add("gradient_clipping", repr(clip), "fine", "written out, mirrored on the torch side")

    for key in BATCH_KEYS:
        if key in config:
            add(
                key,
                repr(config[key]),
                "fine",
                f"overridden in every cell by the matrix's split ({key} is what a split changes)",
            )

    opt = config.get("optimizer") or {}
    params = opt.get("params") or {}
    if m is not None and m.optimizer.adam:
        if str(opt.get("type")).lower() == "adam" and params.get("adam_w_mode", True):
            add(
                "optimizer.type",
                "Adam",
                "fine",
                "DeepSpeed's Adam is AdamW (decoupled weight decay) unless adam_w_mode: false — mirrored as such",
            )
        if "weight_decay" not in params and not params.get("torch_adam"):
            add(
                "optimizer.params.weight_decay",
                "absent → DeepSpeed's FusedAdam uses 0",
                "fine",
                "torch.optim.AdamW would use 0.01; gaeq mirrors DeepSpeed's default",
            )
        if not params.get("torch_adam"):
            add(
                "optimizer.params.torch_adam",
                "absent → FusedAdam (CPU Adam under offload)",
                "fine",
                "the same Adam update as torch.optim.AdamW up to float rounding: the config's cells match the torch "
                "mirror",
                evidence="experiments/your_config.yaml: deepspeed-z2-w2-mb2-ga4",
            )

    sched = config.get("scheduler") or {}
    if sched.get("type") in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        add(
            "scheduler.type",
            sched["type"],
            "fine",
            "DeepSpeed steps it after each optimizer step from iteration −1, so steps 0 and 1 both run at the "
            "warmup's first lr; mirrored step for step",
        )

    fp16 = config.get("fp16") or {}
    if fp16.get("enabled") is True and fp16.get("loss_scale", 0) == 0:
        add(
            "fp16.loss_scale",
            "0 (dynamic)",
            "risk",
            "a step whose scaled gradients overflow is skipped and the scale lowered: compared runs must skip the "
            "same steps (gaeq reports which side skipped which)",
            evidence="experiments/fp16.yaml: deepspeed-z1-w2-mb2-ga4-ds_fp16@ds",
        )

    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    bf16 = (config.get("bf16") or config.get("bfloat16") or {}).get("enabled") is True
    if accum in LOW:
        add(
            "data_types.grad_accum_dtype",
            repr(accum),
            "risk",
            "micro-step gradients pile up in 16 bits and every addition rounds: measured |Δloss| 1.7e-4 at GA 16 "
            "against fp32 "
            "accumulation's 1.1e-4 — within bf16's own noise at this scale, and it grows with GA",
            evidence="experiments/pitfalls.yaml: deepspeed-z1-w1-mb2-ga16-ds_bf16-bug_grad_accum_bf16@bf16_accum",
        )
    elif bf16 and accum is None:
        add(
            "data_types.grad_accum_dtype",
            "absent (bf16 enabled)",
            "risk",
            "DeepSpeed then picks where bf16 gradients accumulate; below fp32 they drift as GA grows — write fp32",
            evidence="experiments/pitfalls.yaml: deepspeed-z1-w1-mb2-ga16-ds_bf16-bug_grad_accum_bf16@bf16_accum",
        )

    comm = config.get("communication_data_type")
    if comm in LOW:
        add(
            "communication_data_type",
            repr(comm),
            "breaks",
            "gradients are all-reduced in 16 bits: every reduction rounds them (rel 1e-4 on the first step's grad "
            "norm at world 2, above fp32's tolerance)",
            evidence="experiments/your_config.yaml: deepspeed-z2-w2-mb2-ga4@comm_bf16",
        )
    if config.get("prescale_gradients") is True:
        add(
            "prescale_gradients",
            "true",
            "risk",
            "divides by the world size before the all-reduce instead of after: the same mean up to rounding at "
            "ZeRO-0 (measured: it matches), "
            "but DeepSpeed 0.19 refuses it at ZeRO-2/3 with reduce_scatter (an assertion at start-up)",
            evidence="experiments/your_config.yaml: deepspeed-z0-w2-mb2-ga4@prescale",
        )
    factor = config.get("gradient_predivide_factor", 1.0)
    if factor != 1.0:
        add(
            "gradient_predivide_factor",
            repr(factor),
            "risk",
            "the same mean up to rounding at ZeRO-0 (measured: it matches), but DeepSpeed 0.19 refuses it at "
            "ZeRO-2/3 with reduce_scatter (an assertion at start-up)",
            evidence="experiments/your_config.yaml: deepspeed-z0-w2-mb2-ga4@predivide",
        )
    if config.get("zero_allow_untested_optimizer") is True and m is not None:
        add(
            "zero_allow_untested_optimizer",
            "true",
            "fine",
            "the optimizers gaeq mirrors (Adam, AdamW, SGD) are elementwise: ZeRO's partitioning leaves their update "
            "exact",
        )

    zero = config.get("zero_optimization") or {}
    tuning = [
        k
        for k in (
            "overlap_comm",
            "contiguous_gradients",
            "reduce_scatter",
            "reduce_bucket_size",
            "allgather_bucket_size",
        )
        if k in zero
    ]
    if tuning:
        add(
            "zero_optimization." + "/".join(tuning),
            "as written",
            "fine",
            "communication scheduling and buffer sizes: the same sums in another order (the config's cells match)",
            evidence="experiments/your_config.yaml: deepspeed-z2-w2-mb2-ga4",
        )
    if m is not None:
        add(
            "zero_optimization.stage",
            str(m.zero_stage),
            "fine",
            "the cells' stage unless the matrix has a zero_stage axis (then overridden, and said)",
        )
    return out


def overrides_of(config: dict[str, Any], cells) -> list[str]:
    """One line per file value that gaeq replaces in some of `cells` (the split, ZeRO stage, offload)."""
    seen: dict[str, set] = {}
    for cell in cells:
        if cell.trainer != "deepspeed" or cell.skip_reason:
            continue
        _, changed = split_config(config, cell)
        for o in changed:
            seen.setdefault((o.key, repr(o.file_value), o.why), set()).add(o.cell_value)
    return [
        f"{key}: the file's {value} → {', '.join(map(str, sorted(values, key=str)))} per cell ({why})"
        for (key, value, why), values in seen.items()
    ]


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.effect == "breaks" for f in findings) else 0
