"""What the machine's accelerator can do, asked of torch and DeepSpeed only when it matters: fp16,
and the async I/O nvme offload swaps with.

fp16 on a CPU: DeepSpeed's CPU accelerator answers ``is_fp16_supported()`` from oneDNN (true on
CPUs with AMX/avx512_fp16); without it, fp16 cells are skipped with that reason. Torch itself
computes float16 on any CPU (emulated: float16 storage, rounding after every op), so
``GAEQ_FP16_EMULATION=1`` runs fp16 cells there too — slower, and recorded as emulated in each
cell's ``ran`` — so that the fp16 code paths can be exercised on machines without fp16 kernels.
"""

from __future__ import annotations

import os
from functools import lru_cache

FP16_EMULATION_ENV = "GAEQ_FP16_EMULATION"


def fp16_emulated() -> bool:
    """True when fp16 cells run although the accelerator has no fp16 (GAEQ_FP16_EMULATION=1)."""
    return os.environ.get(FP16_EMULATION_ENV) == "1" and _native_fp16_missing() is not None


@lru_cache(maxsize=1)
def _native_fp16_missing() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return None
    return (
        f"the {accelerator.device_name()} accelerator has no fp16 support (DeepSpeed: is_fp16_supported() answers "
        f"no; {FP16_EMULATION_ENV}=1 runs these cells in emulated fp16)"
    )


def fp16_unsupported_reason() -> str | None:
    """None when fp16 cells can run; otherwise why not (for a `skipped` cell's reason)."""
    return None if fp16_emulated() else _native_fp16_missing()


def allow_emulated_fp16() -> None:
    """In a rank, before a DeepSpeed fp16 engine is built: under GAEQ_FP16_EMULATION=1, let
    DeepSpeed's CPU accelerator say yes to fp16 (its engine refuses fp16 otherwise). Torch's own
    float16 kernels do the work."""
    if not fp16_emulated():
        return
    from deepspeed.accelerator import get_accelerator

    type(get_accelerator()).is_fp16_supported = lambda self: True


NVME_ENABLE = "apt-get install libaio-dev"
"""The one command that makes nvme offload cells runnable on a Debian/Ubuntu machine (as root)."""


@lru_cache(maxsize=1)
def nvme_unsupported_reason() -> str | None:
    """None when DeepSpeed's async-I/O op (the one nvme offload swaps with) can be built here;
    otherwise why not, naming the command that enables it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible():
        return None
    return f"nvme offload needs DeepSpeed's async_io op, which needs libaio (headers and library): {NVME_ENABLE}"
