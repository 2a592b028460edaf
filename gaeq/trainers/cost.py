"""What a cell costs, counted the same way for both trainers: bytes through the collectives, memory.

Bytes follow the nccl-tests convention for a collective's *size*: all-reduce, reduce and broadcast
count their tensor; reduce-scatter its whole input buffer; all-gather its whole output buffer. So
an all-reduce of P bytes counts P, a ZeRO reduce-scatter of the same gradients P, the all-gather of
the parameters back P. DDP is counted in a communication hook (its reducer bypasses Python);
DeepSpeed at its collective layer (the `deepspeed.comm` backend every ZeRO stage calls).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _arg(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs[name]


# deepspeed.comm backend method → size of one call
_DEEPSPEED_SIZES: dict[str, Callable] = {
    "all_reduce": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "inference_all_reduce": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "all_reduce_coalesced": lambda a, k: sum(map(_nbytes, _arg(a, k, 0, "tensors"))),
    "reduce": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "broadcast": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "reduce_scatter": lambda a, k: sum(map(_nbytes, _arg(a, k, 1, "input_list"))),
    "reduce_scatter_tensor": lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor")),
    "all_gather": lambda a, k: sum(map(_nbytes, _arg(a, k, 0, "tensor_list"))),
    "all_gather_into_tensor": lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
    "all_gather_base": lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
    "all_gather_coalesced": lambda a, k: sum(map(_nbytes, _arg(a, k, 0, "output_tensors"))),
    "all_to_all_single": lambda a, k: _nbytes(_arg(a, k, 0, "output")),
}


# torch.distributed function FSDP2 calls → size of one call (the full tensor: as ZeRO-3's all-gather
# of the parameters and reduce-scatter of the gradients are counted)
_FSDP_SIZES: dict[str, Callable] = {
    "all_gather_single": lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")),
    "reduce_scatter_single": lambda a, k: _nbytes(_arg(a, k, 1, "input")),
}


class CommCounter:
    """Bytes this rank put through collectives since the last :meth:`take`."""

    def __init__(self) -> None:
        self.bytes = 0
        self._paused = 0
        self._restore: Callable[[], None] = lambda: None

    def add(self, nbytes: int) -> None:
        if not self._paused:
            self.bytes += nbytes

    def take(self) -> int:
        nbytes, self.bytes = self.bytes, 0
        return nbytes

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives of the lab itself (gathering snapshots) are not training traffic."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def attach(self, wrapper) -> None:
        """Count what `wrapper` sends: a DDP module (comm hook) or a DeepSpeed engine (its backend).

        A single process sends nothing, whatever collectives it calls on its group of one."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return
        if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
            self._attach_ddp(wrapper)
        elif wrapper is not None and hasattr(wrapper, "zero_optimization_stage"):
            self._attach_deepspeed()
        elif wrapper is not None and hasattr(wrapper, "set_requires_gradient_sync"):  # FSDP2's FSDPModule
            self._patch(torch.distributed, _FSDP_SIZES)

    def detach(self) -> None:
        self._restore()
        self._restore = lambda: None

    def _attach_ddp(self, ddp) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_allreduce(state, bucket):
            self.add(_nbytes(bucket.buffer()))
            return allreduce_hook(state, bucket)  # DDP's own averaging all-reduce

        ddp.register_comm_hook(state=None, hook=counting_allreduce)

    def _attach_deepspeed(self) -> None:
        from deepspeed.comm import comm as ds_comm

        self._patch(ds_comm.cdb, _DEEPSPEED_SIZES)

    def _patch(self, owner, sizes: dict[str, Callable]) -> None:
        """Wrap `owner`'s collectives (a DeepSpeed backend's methods, torch.distributed's functions)
        so that each call adds its size; :meth:`detach` puts the originals back."""
        originals = {}
        for name, size in sizes.items():
            method = getattr(owner, name, None)
            if method is None:
                continue

            def counting(*args, _method=method, _size=size, **kwargs):
                self.add(_size(args, kwargs))
                return _method(*args, **kwargs)

            originals[name] = method
            setattr(owner, name, counting)

        def restore() -> None:
            for name, method in originals.items():
                setattr(owner, name, method)

        self._restore = restore


class PeakMemory:
    """Peak memory of this process during one cell: CUDA max allocated, or the RSS high-water mark
    (Linux: reset per cell through /proc/self/clear_refs; elsewhere the process-lifetime peak)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._status: int | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
            self._status = os.open("/proc/self/status", os.O_RDONLY)  # re-read with pread: ~µs a step

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._status is not None:
            status = os.pread(self._status, 8192, 0)
            start = status.find(b"VmHWM:")
            if start >= 0:
                return int(status[start + 6 : status.index(b"kB", start)]) * 1024
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def close(self) -> None:
        if self._status is not None:
            os.close(self._status)
            self._status = None
