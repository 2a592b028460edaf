"""What the machine's accelerator can do, asked of torch and DeepSpeed only when it matters."""

from __future__ import annotations

import os
from functools import lru_cache


@lru_cache(maxsize=1)
def fp16_unsupported_reason() -> str | None:
    """None when fp16 compute is available; otherwise why not (for a `skipped` cell's reason)."""
    import torch

    if torch.cuda.is_available():
        return None
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.is_fp16_supported():
        return None
    return f"the {accelerator.device_name()} accelerator has no fp16 support (DeepSpeed: is_fp16_supported() is False)"
