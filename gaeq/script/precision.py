"""The arithmetic a script's training really ran, as the probe (gaeq.script.probe) sees it; for a cell
labelled fp32, gaeq.script.float32 makes the same script float32 first and says what it switched off.

What ran: autocast as the model's training forward saw it (entered around the call, or inside it as
accelerate's wrapped forward enters it) with its dtype, the dtypes of the model's parameters, the lowest
float dtype any module inside the model produced in that forward (what FSDP2's ``MixedPrecisionPolicy``
computes in: its parameters stay float32 DTensors outside the forward), an enabled loss scaler (torch's
``GradScaler``) and a DeepSpeed engine's bf16/fp16 section. :meth:`Precision.label` names it as gaeq's
dtypes do (fp32, bf16, fp16, ds_bf16, ds_fp16): the cell's label is checked against it.

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

from gaeq.script.float32 import SHORT, Float32, dtype_name


class Precision:
    def __init__(self, *, force_float32: bool) -> None:
        self.float32 = Float32() if force_float32 else None
        """What makes the run float32 (a cell labelled fp32), and says what it switched off."""
        self.autocast: str | None = None
        """The dtype autocast computed the model's first training forward in (None: no autocast)."""
        self.parameters: list[str] = []
        self.loss_scaler: str | None = None
        """An enabled loss scaler that scaled a loss: ``GradScaler``, ``DeepSpeed fp16``."""
        self.deepspeed: str | None = None
        """A DeepSpeed engine's mixed-precision section: bf16 or fp16."""
        self._scaled: dict[int, torch.Tensor] = {}
        """id of a scaled loss → the scale it was multiplied by (until its backward)."""
        self.produced: str | None = None
        """The lowest-precision float dtype a module inside the model produced in its first training forward."""
        self._inside = 0
        self._seen_forward = False
        self._engine = None
        """A DeepSpeed fp16 engine (its loss scale divides the losses handed to backward)."""
        self._on_skipped: Callable[[Any], None] | None = None
        self._switched_by_launch: list[str] = []
        self.scale: float | torch.Tensor = 1.0
        """The loss scale of the last loss handed to backward (1: none), which its gradients carry."""

    @property
    def switched_off(self) -> list[str]:
        """What gaeq switched off to make the run float32 (``autocast bf16 (cpu)``, ``GradScaler``): said, and
        added to by the launch (a DeepSpeed config's sections)."""
        return self.float32.switched_off if self.float32 is not None else self._switched_by_launch

    # --- what the probe tells it ----------------------------------------------------------------

    def entered(self, model: torch.nn.Module) -> None:
        """The model's first training call begins: autocast around it, the parameters' dtypes."""
        self._inside += 1
        if self._seen_forward:
            return
        params = list(model.parameters())
        self.parameters = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        if params and torch.is_autocast_enabled(params[0].device.type):
            self.autocast = dtype_name(torch.get_autocast_dtype(params[0].device.type))
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
                    self.produced = dtype_name(t.dtype)

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
            self.scale = float(engine_scale) if engine_scale else 1.0
            return value / float(engine_scale) if engine_scale else value
        self.scale = 1.0 if scale is None else scale.double()
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
        enter = autocast.__enter__
        precision = self
        self._on_skipped = on_skipped
        if self.float32 is not None:
            self.float32.install()  # (first: the hooks below then see the run as it is made)

        @functools.wraps(enter)
        def probed_enter(ctx):
            result = enter(ctx)
            if precision._inside and not precision._seen_forward and precision.autocast is None:
                if getattr(ctx, "_enabled", False):  # entered inside the model's call (accelerate's wrapper)
                    precision.autocast = dtype_name(ctx.fast_dtype)
            return result

        autocast.__enter__ = probed_enter

        scaler = torch.amp.GradScaler
        scale, step = scaler.scale, scaler.step

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

        scaler.scale, scaler.step = probed_scale, probed_step

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
