"""What each key of a DeepSpeed config does to gradient-accumulation equivalence (gaeq.audit's CHECKS, one
function a concern): every `breaks` and `risk` names the experiment cell that shows it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gaeq.audit.finding import LOW, Finding, enabled
from gaeq.problem.dsconfig import BATCH_KEYS, ConfigError, Mirror


def unmirrorable(exc: ConfigError) -> Finding:
    key, _, why = str(exc).partition(": ")
    return Finding(
        key=key.removeprefix("deepspeed_config."),
        value="as written",
        effect="risk",
        why=f"gaeq cannot mirror it on the torch side, so a matrix with this config is bad input ({why})",
    )


def clipping(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    clip = config.get("gradient_clipping")
    if clip is not None:
        yield Finding(
            key="gradient_clipping",
            value=repr(clip),
            effect="fine",
            why="written out: DeepSpeed clips at it (gaeq's torch cells, where a matrix has any, clip alike)",
        )
        return
    yield Finding(
        key="gradient_clipping",
        value=f"absent → DeepSpeed clips at {GRADIENT_CLIPPING_DEFAULT}",
        effect="risk",
        why="every step whose global grad norm exceeds it is clipped: a PyTorch run without clipping is another "
        "optimisation (gaeq's torch side mirrors the default)",
        evidence="experiments/your_config.yaml: torch-w1-mb4-ga4-bug_unmirrored_default_clipping@clipped",
    )


def batch_keys(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    for key in BATCH_KEYS:
        if key == "gradient_accumulation_steps" and config.get(key) == 1:
            yield Finding(
                key=key,
                value="1",
                effect="risk",
                why="a loop that accumulates by hand (several engine.backward per engine.step) makes every backward "
                "the engine's boundary: at ZeRO-1/2 only the last micro-batch reaches the step (open-instruct#1498, "
                "DeepSpeed 0.19.8) — write the real GA, or call engine.set_gradient_accumulation_boundary, or set "
                "managed_gradient_accumulation: false",
                evidence="experiments/pitfalls.yaml: deepspeed-z1-acc_manual-w2-mb4-ga4",
            )
        elif key == "train_batch_size" and key in config:
            why = "what every split holds fixed: the matrix's train_batch_size is written in its place"
            yield Finding(key=key, value=repr(config[key]), effect="fine", why=why)
        elif key in config:
            why = f"what a split changes: each cell's own {key} is written in its place"
            yield Finding(key=key, value=repr(config[key]), effect="fine", why=why)


def optimizer(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    opt = config.get("optimizer") or {}
    params = opt.get("params") or {}
    if m is None or not m.optimizer.adam:
        return
    if str(opt.get("type")).lower() == "adam" and params.get("adam_w_mode", True):
        yield Finding(
            key="optimizer.type",
            value="Adam",
            effect="fine",
            why="DeepSpeed's Adam is AdamW (decoupled weight decay) unless adam_w_mode: false — mirrored as such",
        )
    if "weight_decay" not in params and not params.get("torch_adam"):
        yield Finding(
            key="optimizer.params.weight_decay",
            value="absent → DeepSpeed's FusedAdam uses 0",
            effect="fine",
            why="torch.optim.AdamW would use 0.01; gaeq mirrors DeepSpeed's default",
        )
    if not params.get("torch_adam"):
        yield Finding(
            key="optimizer.params.torch_adam",
            value="absent → FusedAdam (CPU Adam under offload)",
            effect="fine",
            why="the same Adam update as torch.optim.AdamW up to float rounding: the config's cells match the torch "
            "mirror",
            evidence="experiments/your_config.yaml: deepspeed-z2-w2-mb2-ga4",
        )


def loss_scale(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    fp16 = config.get("fp16") or {}
    if fp16.get("enabled") is True and fp16.get("loss_scale", 0) == 0:
        yield Finding(
            key="fp16.loss_scale",
            value="0 (dynamic)",
            effect="risk",
            why="a step whose scaled gradients overflow is skipped and the scale lowered: compared runs must skip the "
            "same steps (gaeq reports which side skipped which)",
            evidence="experiments/fp16.yaml: deepspeed-z1-w2-mb2-ga4-ds_fp16@ds",
        )


BF16_ACCUMULATION = "experiments/pitfalls.yaml: deepspeed-z1-w1-mb2-ga16-ds_bf16-bug_grad_accum_bf16@bf16_accum"


def grad_accum_dtype(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    bf16 = enabled(config, "bf16")
    if accum in LOW:
        yield Finding(
            key="data_types.grad_accum_dtype",
            value=repr(accum),
            effect="risk",
            why="micro-step gradients pile up in 16 bits and every addition rounds: measured |Δloss| 1.7e-4 at GA 16 "
            "against fp32 accumulation's 1.1e-4 — within bf16's own noise at this scale, and it grows with GA",
            evidence=BF16_ACCUMULATION,
        )
    elif bf16 and accum is None:
        yield Finding(
            key="data_types.grad_accum_dtype",
            value="absent (bf16 enabled)",
            effect="risk",
            why="DeepSpeed then picks where bf16 gradients accumulate; below fp32 they drift as GA grows — write fp32",
            evidence=BF16_ACCUMULATION,
        )


def communication(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    """How gradients are reduced over ranks: their dtype, and where the mean's division happens."""
    comm = config.get("communication_data_type")
    if comm in LOW:
        yield Finding(
            key="communication_data_type",
            value=repr(comm),
            effect="breaks",
            why="gradients are all-reduced in 16 bits: every reduction rounds them (rel 1e-4 on the first step's "
            "grad norm at world 2, above fp32's tolerance)",
            evidence="experiments/your_config.yaml: deepspeed-z2-w2-mb2-ga4@comm_bf16",
        )
    if config.get("prescale_gradients") is True:
        yield Finding(
            key="prescale_gradients",
            value="true",
            effect="risk",
            why="divides by the world size before the all-reduce instead of after: the same mean up to rounding at "
            "ZeRO-0 (measured: it matches), but DeepSpeed refuses it at ZeRO-2/3 with reduce_scatter (an "
            "assertion at start-up)",
            evidence="experiments/your_config.yaml: deepspeed-z0-w2-mb2-ga4@prescale",
        )
    factor = config.get("gradient_predivide_factor", 1.0)
    if factor != 1.0:
        yield Finding(
            key="gradient_predivide_factor",
            value=repr(factor),
            effect="risk",
            why="the same mean up to rounding at ZeRO-0 (measured: it matches), but DeepSpeed refuses it at "
            "ZeRO-2/3 with reduce_scatter (an assertion at start-up)",
            evidence="experiments/your_config.yaml: deepspeed-z0-w2-mb2-ga4@predivide",
        )


def untested_optimizer(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    if config.get("zero_allow_untested_optimizer") is True and m is not None:
        yield Finding(
            key="zero_allow_untested_optimizer",
            value="true",
            effect="fine",
            why="the optimizers gaeq mirrors (Adam, AdamW, SGD) are elementwise: ZeRO's partitioning leaves their "
            "update exact",
        )


ZERO_TUNING = ("overlap_comm", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_bucket_size")
"""ZeRO's communication scheduling and buffer sizes: where and when, not what, it sums."""


def zero(config: dict[str, Any], m: Mirror | None) -> Iterator[Finding]:
    section = config.get("zero_optimization") or {}
    if tuning := [k for k in ZERO_TUNING if k in section]:
        yield Finding(
            key="zero_optimization." + "/".join(tuning),
            value="as written",
            effect="fine",
            why="communication scheduling and buffer sizes: the same sums in another order (the config's cells match)",
            evidence="experiments/your_config.yaml: deepspeed-z2-w2-mb2-ga4",
        )
    if m is not None:
        yield Finding(
            key="zero_optimization.stage",
            value=str(m.zero_stage),
            effect="fine",
            why="the cells' stage unless the matrix has a zero_stage axis (then overridden, and said)",
        )
