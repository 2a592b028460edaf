"""A script made float32, for a cell labelled fp32: the same accumulation, measured where rounding is small.

Its autocast is switched off, its ``GradScaler`` disabled (``enabled=False``: its ``scale`` returns the loss
as it is, its ``step`` steps) and FSDP2's mixed precision left out (``fully_shard`` without its
``mp_policy``). A DeepSpeed config's bf16/fp16 section gaeq writes is switched off by the launch
(gaeq.script.launch). A cast the script writes itself is kept float32: a module's ``.to(torch.bfloat16)``,
``.bfloat16()`` and ``.half()`` (a tensor's cast is left as it is), and ``torch.set_default_dtype`` to a half
precision, which transformers' ``from_pretrained``/``from_config`` call with their ``dtype``/``torch_dtype``.
`switched_off` names what was switched off, for the report.
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
        self._without_module_casts()

    def _without_module_casts(self) -> None:
        """A module's casts to a half precision, and a half-precision default dtype, left float32 (a device move
        in the same call still moves it)."""
        module, float32 = torch.nn.Module, self
        to = module.to

        @functools.wraps(to)
        def float32_to(m, *args, **kwargs):
            device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            if dtype not in SHORT or SHORT[dtype] not in ("bf16", "fp16"):
                return to(m, *args, **kwargs)
            float32.said(f"{type(m).__name__}.to({dtype_name(dtype)})")
            if device is None:
                return m
            moved = {"non_blocking": non_blocking} | ({"memory_format": memory_format} if memory_format else {})
            return to(m, device, **moved)

        module.to = float32_to
        for name in ("bfloat16", "half"):

            def kept(m, name=name):
                float32.said(f"{type(m).__name__}.{name}()")
                return m

            setattr(module, name, functools.wraps(getattr(module, name))(kept))
        set_default = torch.set_default_dtype

        @functools.wraps(set_default)
        def float32_default(d):
            if d in (torch.bfloat16, torch.float16):
                float32.said(f"torch.set_default_dtype({dtype_name(d)}) (transformers' dtype=, torch_dtype=)")
                d = torch.float32
            return set_default(d)

        torch.set_default_dtype = float32_default

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
