"""Backend and device choice, and process-group set-up for one rank.

torch is imported inside the functions that need it: `gaeq run`'s parent imports this module
before it starts the ranks' fork server, which should not wait for the parent's torch.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from gaeq.accelerator import NVML_CHECK, has_cuda  # noqa: F401 - this module's names too

if TYPE_CHECKING:
    import torch


def backend() -> str:
    """nccl with CUDA devices; gloo on CPU."""
    return "nccl" if has_cuda() else "gloo"


def device_for(local_rank: int) -> torch.device:
    import torch

    return torch.device("cuda", local_rank) if has_cuda() else torch.device("cpu")


def set_accelerator_env() -> None:
    """Tell DeepSpeed which accelerator to use before it is imported (users export nothing)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if has_cuda() else "cpu")


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A free port on 127.0.0.1 that this process has not handed out before: groups started side
    by side (lanes) bind theirs only once their ranks run, and must never be given the same one."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def init_process_group(
    *, rank: int, world_size: int, port: int, with_deepspeed: bool, with_nvme: bool = False, timeout_s: float
) -> None:
    """Join the group of `world_size` local ranks on 127.0.0.1:`port` (gaeq's own launcher)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    join_from_env(with_deepspeed=with_deepspeed, with_nvme=with_nvme, timeout_s=timeout_s)


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What a launcher (torchrun, deepspeed, mpirun wrappers) gives every rank."""


@dataclass(frozen=True, kw_only=True)
class LaunchedRank:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def rank_from_env() -> LaunchedRank:
    """This rank as a launcher described it; ValueError naming what is missing or malformed."""
    missing = [k for k in LAUNCHER_ENV if not os.environ.get(k)]
    if missing:
        raise ValueError(
            f"not started by a launcher: {', '.join(missing)} not set (use torchrun, deepspeed or `gaeq run`)"
        )
    try:
        rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        # torchrun sets LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE; a single node has all ranks.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)
    except ValueError as exc:
        raise ValueError(f"launcher environment is malformed: {exc}") from None
    if not (0 <= rank < world and 0 <= local < local_world):
        raise ValueError(f"launcher environment is inconsistent: RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local}")
    return LaunchedRank(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)


def join_from_env(*, with_deepspeed: bool, with_nvme: bool = False, timeout_s: float) -> None:
    """Join the process group the environment describes (MASTER_ADDR/PORT, RANK, WORLD_SIZE).

    With DeepSpeed cells ahead, DeepSpeed initialises the group itself, so its one-off set-up
    (including the JIT build of its shared-memory comm op on a fresh machine) happens here, at
    group start-up, and not inside the first cell's time budget — and so does, with nvme-offload
    cells ahead, the build of its async-I/O op (~3.5 min on a fresh 2-core machine).
    """
    import torch
    import torch.distributed as dist

    me = rank_from_env()
    # DeepSpeed's launcher sets it; without it the CPU accelerator's device_count() runs
    # `numactl --hardware` in a subprocess on every ZeRO-3 gradient reduction.
    os.environ.setdefault("LOCAL_SIZE", str(me.local_world_size))
    timeout = timedelta(seconds=timeout_s)
    if has_cuda():
        torch.cuda.set_device(me.local_rank)
    if with_deepspeed:
        set_accelerator_env()
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend(), auto_mpi_discovery=False, timeout=timeout)
        if with_nvme:
            from deepspeed.ops.op_builder import AsyncIOBuilder

            AsyncIOBuilder().load()
    else:
        dist.init_process_group(backend(), rank=me.rank, world_size=me.world_size, timeout=timeout)


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
