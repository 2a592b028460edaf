"""A script made float32, for a cell labelled fp32: the same accumulation, measured where rounding is small.

Its autocast is switched off, its ``GradScaler`` disabled (``enabled=False``: its ``scale`` returns the loss
as it is, its ``step`` steps) and FSDP2's mixed precision left out (``fully_shard`` without its
``mp_policy``). A DeepSpeed config's bf16/fp16 section gaeq writes is switched off by the launch
(gaeq.script.launch). A cast the script writes itself (``model.to(torch.bfloat16)``) cannot be undone: its
parameters' dtype says so, and the label check (gaeq.script.precision) says why. `switched_off` names what
was switched off, for the report.
"""

from __future__ import annotations

import functools

import torch

SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
"""torch's float dtypes by gaeq's names for them."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Float32:
    def __init__(self) -> None:
        self.switched_off: list[str] = []
        """What was switched off (``autocast bf16 (cpu)``, ``GradScaler``, an FSDP2 policy, a config's section)."""

    def said(self, what: str) -> None:
        if what not in self.switched_off:
            self.switched_off.append(what)

    def install(self) -> None:
        """autocast, GradScaler and FSDP2's ``fully_shard`` as the script will call them, made float32."""
        autocast, float32 = torch.amp.autocast_mode.autocast, self
        init = autocast.__init__

        @functools.wraps(init)
        def float32_init(ctx, device_type, dtype=None, enabled=True, cache_enabled=None):
            low = dtype if dtype is not None else torch.get_autocast_dtype(device_type)
            if enabled and low in (torch.bfloat16, torch.float16):
                float32.said(f"autocast {SHORT[low]} ({device_type})")
                enabled = False
            return init(ctx, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

        autocast.__init__ = float32_init
        scaler_init = torch.amp.GradScaler.__init__

        @functools.wraps(scaler_init)
        def float32_scaler_init(gs, *args, **kwargs):
            scaler_init(gs, *args, **kwargs)
            if gs._enabled:
                gs._enabled = False  # as GradScaler(enabled=False): scale() returns the loss, step() steps
                float32.said("GradScaler")

        torch.amp.GradScaler.__init__ = float32_scaler_init
        self._without_fsdp_mixed_precision()

    def _without_fsdp_mixed_precision(self) -> None:
        """FSDP2's ``fully_shard`` as the script imports it, its ``mp_policy`` left out (float32 compute)."""
        try:
            import torch.distributed.fsdp as fsdp
        except ImportError:  # a torch without distributed
            return
        shard, float32 = fsdp.fully_shard, self

        @functools.wraps(shard)
        def float32_shard(module, *args, mp_policy=None, **kwargs):
            if mp_policy is not None and mp_policy.param_dtype in (torch.bfloat16, torch.float16):
                float32.said(f"FSDP2 MixedPrecisionPolicy(param_dtype={dtype_name(mp_policy.param_dtype)})")
                mp_policy = None
            if mp_policy is not None:
                kwargs["mp_policy"] = mp_policy
            return shard(module, *args, **kwargs)

        fsdp.fully_shard = float32_shard
