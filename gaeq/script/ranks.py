"""A script rank's place among the others, as the probe needs it: its rank (the process group's, else the
launcher's), the ranks' records gathered, the library versions that ran."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


def rank() -> int:
    """This rank: the process group's, or — before it is joined or after it is destroyed — the launcher's."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("torch", "deepspeed", "accelerate", "transformers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found
