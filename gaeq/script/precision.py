"""The arithmetic a script's training really ran, as the probe (gaeq.script.probe) sees it — and, for a
cell labelled fp32, the same script made float32.

What ran: autocast as the model's training forward saw it (entered around the call, or inside it as
accelerate's wrapped forward enters it) with its dtype, the dtypes of the model's parameters, the lowest
float dtype any module inside the model produced in that forward (what FSDP2's ``MixedPrecisionPolicy``
computes in: its parameters stay float32 DTensors outside the forward), an enabled loss scaler (torch's
``GradScaler``) and a DeepSpeed engine's bf16/fp16 section. :meth:`Precision.label` names it as gaeq's
dtypes do (fp32, bf16, fp16, ds_bf16, ds_fp16): the cell's label is checked against it.

A cell labelled fp32 runs the script with its autocast switched off, its ``GradScaler`` disabled
(``enabled=False``: its ``scale`` returns the loss as it is, its ``step`` steps) and FSDP2's mixed precision
left out (``fully_shard`` without its ``mp_policy``) — the same accumulation, measured where rounding is
small (a DeepSpeed config's bf16/fp16 section gaeq writes is switched off by the launch, gaeq.script.launch).
A cast the script writes itself (``model.to(torch.bfloat16)``) cannot be undone: its parameters' dtype says
so, and the label check says why.

A loss scaler's skipped update (inf or NaN in the gradients: ``scaler.step`` steps no optimizer; a DeepSpeed
fp16 engine's step that counts a skipped step) is a training step without an update: the probe is told
(``on_skipped``) and records it ``skipped``. The objective of a scaled loss is read unscaled (the scale it
was multiplied by at ``scaler.scale``, or the engine's loss scale).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


class Precision:
    def __init__(self, *, force_float32: bool) -> None:
        self.force_float32 = force_float32
        self.autocast: str | None = None
        """The dtype autocast computed the model's first training forward in (None: no autocast)."""
        self.parameters: list[str] = []
        self.loss_scaler: str | None = None
        """An enabled loss scaler that scaled a loss: ``GradScaler``, ``DeepSpeed fp16``."""
        self.deepspeed: str | None = None
        """A DeepSpeed engine's mixed-precision section: bf16 or fp16."""
        self.switched_off: list[str] = []
        """What gaeq switched off to make the run float32 (``autocast bf16 (cpu)``, ``GradScaler``)."""
        self._scaled: dict[int, torch.Tensor] = {}
        """id of a scaled loss → the scale it was multiplied by (until its backward)."""
        self.produced: str | None = None
        """The lowest-precision float dtype a module inside the model produced in its first training forward."""
        self._inside = 0
        self._seen_forward = False
        self._engine = None
        """A DeepSpeed fp16 engine (its loss scale divides the losses handed to backward)."""
        self._on_skipped: Callable[[Any], None] | None = None

    # --- what the probe tells it ----------------------------------------------------------------

    def entered(self, model: torch.nn.Module) -> None:
        """The model's first training call begins: autocast around it, the parameters' dtypes."""
        self._inside += 1
        if self._seen_forward:
            return
        params = list(model.parameters())
        self.parameters = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        if params and torch.is_autocast_enabled(params[0].device.type):
            self.autocast = _name(torch.get_autocast_dtype(params[0].device.type))
        for name in ("bf16", "fp16"):
            enabled = getattr(model, f"{'bfloat16' if name == 'bf16' else 'fp16'}_enabled", None)
            if callable(enabled) and enabled():  # a DeepSpeed engine
                self.deepspeed = name
                if name == "fp16":
                    self.loss_scaler, self._engine = "DeepSpeed fp16", model
                    self._watch_engine_steps(model)

    def _watch_engine_steps(self, engine) -> None:
        """A DeepSpeed fp16 engine's step that overflowed steps no optimizer and counts `skipped_steps`:
        the probe is told, with the optimizer the engine wraps (its client optimizer)."""
        take, precision = engine._take_model_step, self

        @functools.wraps(take)
        def probed_take(*args, **kwargs):
            before = engine.skipped_steps
            result = take(*args, **kwargs)
            if engine.skipped_steps > before and precision._on_skipped is not None:
                precision._on_skipped(engine.basic_optimizer)
            return result

        engine._take_model_step = probed_take

    def output(self, output) -> None:
        """A module's output inside the model's first training forward: its lowest float dtype noted."""
        if not self._inside or self._seen_forward:
            return
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype in SHORT:
                if self.produced is None or torch.finfo(t.dtype).eps > torch.finfo(getattr(torch, self.produced)).eps:
                    self.produced = _name(t.dtype)

    def left(self) -> None:
        self._inside -= 1
        self._seen_forward = True

    def unscaled(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss handed to backward, without the loss scale it was multiplied by (if it was)."""
        scale = self._scaled.pop(id(loss), None)
        value = loss.detach().double()
        if scale is None and self._engine is not None:  # a DeepSpeed fp16 engine's backward: loss × its scale
            optimizer = self._engine.optimizer
            engine_scale = getattr(optimizer, "loss_scale", None) or getattr(optimizer, "cur_scale", None)
            return value / float(engine_scale) if engine_scale else value
        return value if scale is None else value / scale.double()

    def loss_dtype(self, loss: torch.Tensor) -> torch.dtype | None:
        """The low precision a loss handed to backward was computed in, if any: its own dtype, or — where the
        model's parameters are bf16/fp16 (DeepSpeed's bf16, a cast model: no autocast to take the loss to
        float32) — theirs, which its forward and the loss on its logits computed in. Its value is known to
        half a unit of it; None: float32 or better."""
        if loss.dtype in (torch.bfloat16, torch.float16):
            return loss.dtype
        low = self._low_parameters()
        return getattr(torch, low) if low else None

    def _low_parameters(self) -> str | None:
        """The model's parameters' low-precision dtype (bfloat16, float16: a cast model, DeepSpeed's), if any."""
        return next((d for d in self.parameters if d in ("bfloat16", "float16")), None)

    def _computed_in(self) -> str | None:
        """The low precision the forward ran in without autocast: the parameters', else what the modules
        produced with float32 parameters (FSDP2's mixed precision, say)."""
        return self._low_parameters() or (self.produced if self.produced in ("bfloat16", "float16") else None)

    def label(self) -> str:
        """gaeq's dtype for what ran."""
        if self.deepspeed:
            return f"ds_{self.deepspeed}"
        if self.autocast in ("bfloat16", "float16"):
            return SHORT[getattr(torch, self.autocast)]
        low = self._computed_in()
        return SHORT[getattr(torch, low)] if low else "fp32"

    def compute_dtype(self) -> str:
        """The dtype the forward computed in (the report's `ran` column)."""
        if self.autocast:
            return self.autocast
        if self.deepspeed:
            return "bfloat16" if self.deepspeed == "bf16" else "float16"
        return self._computed_in() or "float32"

    def facts(self) -> dict[str, Any]:
        return {
            "dtype": self.label(),
            "compute_dtype": self.compute_dtype(),
            "autocast": self.autocast,
            "parameters": self.parameters,
            "produced": self.produced,
            "loss_scaler": self.loss_scaler,
            "deepspeed": self.deepspeed,
            "switched_off": self.switched_off,
        }

    # --- the hooks ------------------------------------------------------------------------------

    def install(self, *, on_skipped: Callable[[Any], None], steps_taken: Callable[[], int]) -> None:
        """Hooks on autocast and torch's GradScaler: `on_skipped(optimizer)` for a scaler step that stepped
        no optimizer (`steps_taken()` counts the optimizer steps begun)."""
        autocast = torch.amp.autocast_mode.autocast
        init, enter = autocast.__init__, autocast.__enter__
        precision = self
        self._on_skipped = on_skipped

        @functools.wraps(init)
        def probed_init(ctx, device_type, dtype=None, enabled=True, cache_enabled=None):
            if precision.force_float32 and enabled:
                low = dtype if dtype is not None else torch.get_autocast_dtype(device_type)
                if low in (torch.bfloat16, torch.float16):
                    said = f"autocast {SHORT[low]} ({device_type})"
                    if said not in precision.switched_off:
                        precision.switched_off.append(said)
                    enabled = False
            return init(ctx, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        @functools.wraps(enter)
        def probed_enter(ctx):
            result = enter(ctx)
            if precision._inside and not precision._seen_forward and precision.autocast is None:
                if getattr(ctx, "_enabled", False):  # entered inside the model's call (accelerate's wrapper)
                    precision.autocast = _name(ctx.fast_dtype)
            return result

        autocast.__init__, autocast.__enter__ = probed_init, probed_enter

        scaler = torch.amp.GradScaler
        scaler_init, scale, step = scaler.__init__, scaler.scale, scaler.step

        @functools.wraps(scaler_init)
        def probed_scaler_init(gs, *args, **kwargs):
            scaler_init(gs, *args, **kwargs)
            if precision.force_float32 and gs._enabled:
                gs._enabled = False  # as GradScaler(enabled=False): scale() returns the loss, step() steps
                if "GradScaler" not in precision.switched_off:
                    precision.switched_off.append("GradScaler")

        @functools.wraps(scale)
        def probed_scale(gs, outputs):
            scaled = scale(gs, outputs)
            if gs.is_enabled() and isinstance(scaled, torch.Tensor) and gs._scale is not None:
                precision.loss_scaler = "GradScaler"
                precision._scaled[id(scaled)] = gs._scale.detach().clone()
            return scaled

        @functools.wraps(step)
        def probed_step(gs, optimizer, *args, **kwargs):
            before = steps_taken()
            result = step(gs, optimizer, *args, **kwargs)
            if gs.is_enabled() and steps_taken() == before:
                on_skipped(optimizer)  # inf/NaN found: the update skipped, the scale lowered by update()
            return result

        scaler.__init__, scaler.scale, scaler.step = probed_scaler_init, probed_scale, probed_step
        if self.force_float32:
            self._without_fsdp_mixed_precision()

    @staticmethod
    def read_fused(optimizer, read) -> None:
        """Where GradScaler steps an optimizer that unscales inside its own kernel (fused AdamW:
        `_step_supports_amp_scaling`), it steps it every time, handing it `grad_scale` and `found_inf`: the
        gradients read before its step are still scaled (the norm is divided by `read.scale`), and an update it
        skips is a skipped step all the same."""
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return
        if (scale := getattr(optimizer, "grad_scale", None)) is not None:
            read.scale = float(scale)
        if (found := getattr(optimizer, "found_inf", None)) is not None and float(found) > 0:
            read.skipped = True

    def _without_fsdp_mixed_precision(self) -> None:
        """FSDP2's ``fully_shard`` as the script imports it, its ``mp_policy`` left out (float32 compute)."""
        try:
            import torch.distributed.fsdp as fsdp
        except ImportError:  # a torch without distributed
            return
        shard, precision = fsdp.fully_shard, self

        @functools.wraps(shard)
        def float32_shard(module, *args, mp_policy=None, **kwargs):
            if mp_policy is not None and mp_policy.param_dtype in (torch.bfloat16, torch.float16):
                said = f"FSDP2 MixedPrecisionPolicy(param_dtype={_name(mp_policy.param_dtype)})"
                if said not in precision.switched_off:
                    precision.switched_off.append(said)
                mp_policy = None
            if mp_policy is not None:
                kwargs["mp_policy"] = mp_policy
            return shard(module, *args, **kwargs)

        fsdp.fully_shard = float32_shard


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
