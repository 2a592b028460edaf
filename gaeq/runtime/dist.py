"""Backend and device choice, and process-group set-up for one rank."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


def has_cuda() -> bool:
    return torch.cuda.is_available()


def backend() -> str:
    """nccl with CUDA devices; gloo on CPU."""
    return "nccl" if has_cuda() else "gloo"


def device_for(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if has_cuda() else torch.device("cpu")


def set_accelerator_env() -> None:
    """Tell DeepSpeed which accelerator to use before it is imported (users export nothing)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if has_cuda() else "cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(*, rank: int, world_size: int, port: int, with_deepspeed: bool, timeout_s: float) -> None:
    """Join the group of `world_size` local ranks on 127.0.0.1:`port`.

    With DeepSpeed cells ahead, DeepSpeed initialises the group itself, so its one-off set-up
    (including the JIT build of its shared-memory comm op on a fresh machine) happens here, at
    group start-up, and not inside the first cell's time budget.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        # DeepSpeed's launcher sets it; without it the CPU accelerator's device_count() runs
        # `numactl --hardware` in a subprocess on every ZeRO-3 gradient reduction.
        LOCAL_SIZE=str(world_size),
    )
    timeout = timedelta(seconds=timeout_s)
    if has_cuda():
        torch.cuda.set_device(rank)
    if with_deepspeed:
        set_accelerator_env()
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend(), auto_mpi_discovery=False, timeout=timeout)
    else:
        dist.init_process_group(backend(), rank=rank, world_size=world_size, timeout=timeout)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
