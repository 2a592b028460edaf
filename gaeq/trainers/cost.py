"""What a cell costs, counted the same way for every trainer: bytes through the collectives, memory.

Bytes follow the nccl-tests convention for a collective's *size*: all-reduce, reduce and broadcast
count their tensor; reduce-scatter its whole input buffer; all-gather its whole output buffer. So
an all-reduce of P bytes counts P, a ZeRO reduce-scatter of the same gradients P, the all-gather of
the parameters back P. DDP is counted in a communication hook (its reducer bypasses Python);
DeepSpeed at its collective layer (the `deepspeed.comm` backend every ZeRO stage calls); FSDP2 at
the torch.distributed functions it calls; DTensor tensor parallelism at the functional collectives
its layers call (the activations' all-reduces) and the data-parallel all-reduce of the gradients.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist


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
    "all_reduce": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),  # HSDP: the replicas' average
}


# torch.distributed._functional_collectives function DTensor calls → size of one call
_DTENSOR_SIZES: dict[str, Callable] = {
    "all_reduce": lambda a, k: _nbytes(_arg(a, k, 0, "self")),
    "reduce_scatter_single": lambda a, k: _nbytes(_arg(a, k, 0, "self")),
    "all_gather_single": lambda a, k: _nbytes(_arg(a, k, 0, "self")) * _group_size(_arg(a, k, 2, "group")),
}


def _group_size(group) -> int:
    """Ranks in a functional collective's group (a name, a process group, or (mesh, dim))."""
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    return torch.distributed.get_world_size(_resolve_process_group(funcol._resolve_group_name(group)))


def _alone(args, kwargs) -> bool:
    """A collective over a group of one rank (DeepSpeed calls them, e.g. ZeRO on a data-parallel
    group of one beside tensor parallelism): nothing is sent."""
    group = kwargs.get("group", next((a for a in args if isinstance(a, torch.distributed.ProcessGroup)), None))
    return isinstance(group, torch.distributed.ProcessGroup) and group.size() == 1


class Patches:
    """Attributes replaced by wrappers of themselves, each put back by :meth:`restore` (last first)."""

    def __init__(self) -> None:
        self._originals: list[tuple[object, str, object]] = []

    def patch(self, owner, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """Replace `owner.name` by ``wrap(original)``."""
        original = getattr(owner, name)
        setattr(owner, name, wrap(original))
        self._originals.append((owner, name, original))

    def restore(self) -> None:
        while self._originals:
            owner, name, original = self._originals.pop()
            setattr(owner, name, original)


class CommCounter:
    """Bytes this rank put through collectives since the last :meth:`take`."""

    def __init__(self) -> None:
        self.bytes = 0
        self.all_to_all_bytes = 0
        """Of :attr:`bytes`, those through all-to-alls (Ulysses' attention)."""
        self.attached = False
        """Whether :meth:`attach` found what to count (a wrapper it knows, on more than one process)."""
        self._paused = 0
        self._patches = Patches()

    def add(self, nbytes: int) -> None:
        if not self._paused:
            self.bytes += nbytes

    def take(self) -> int:
        nbytes, self.bytes = self.bytes, 0
        return nbytes

    def take_all_to_all(self) -> int:
        nbytes, self.all_to_all_bytes = self.all_to_all_bytes, 0
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
        """Count what `wrapper` sends: a DDP module (comm hook), a DeepSpeed engine (its backend),
        an FSDP2 module or a TensorParallel split (the torch.distributed functions they call).

        A single process sends nothing, whatever collectives it calls on its group of one."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return
        if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
            self._attach_ddp(wrapper)
        elif wrapper is not None and hasattr(wrapper, "zero_optimization_stage"):
            self._attach_deepspeed()
        elif wrapper is not None and hasattr(wrapper, "set_requires_gradient_sync"):  # FSDP2's FSDPModule
            self._patch(torch.distributed, _FSDP_SIZES)
        elif wrapper is not None and hasattr(wrapper, "average_gradients"):  # gaeq's TensorParallel split
            from torch.distributed import _functional_collectives as funcol

            self._patch(funcol, _DTENSOR_SIZES)
            self._patch(torch.distributed, {"all_reduce": _DEEPSPEED_SIZES["all_reduce"]})
        else:
            return
        self.attached = True

    def detach(self) -> None:
        self._patches.restore()

    def _attach_ddp(self, ddp) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_allreduce(state, bucket):
            self.add(_nbytes(bucket.buffer()))
            return allreduce_hook(state, bucket)  # DDP's own averaging all-reduce

        ddp.register_comm_hook(state=None, hook=counting_allreduce)

    def _attach_deepspeed(self) -> None:
        self.count_deepspeed(tuple(_DEEPSPEED_SIZES))

    def count_deepspeed(self, names: tuple[str, ...]) -> None:
        """Count these collectives of DeepSpeed's backend (deepspeed.comm) — an engine's, or a module's
        that talks through it (Ulysses' all-to-alls)."""
        from deepspeed.comm import comm as ds_comm

        sizes = {name: _DEEPSPEED_SIZES[name] for name in names}
        if "all_to_all_single" in sizes:  # counted twice: in the total, and on their own
            sizes["all_to_all_single"] = functools.partial(self._all_to_all, sizes["all_to_all_single"])
        self._patch(ds_comm.cdb, sizes)

    def _all_to_all(self, size: Callable, args, kwargs) -> int:
        nbytes = size(args, kwargs)
        if not self._paused:
            self.all_to_all_bytes += nbytes
        return nbytes

    def _patch(self, owner, sizes: dict[str, Callable]) -> None:
        """Wrap `owner`'s collectives (a DeepSpeed backend's methods, torch.distributed's functions)
        so that each call adds its size; :meth:`detach` puts the originals back."""
        for name, size in sizes.items():
            if getattr(owner, name, None) is not None:
                self._patches.patch(owner, name, functools.partial(self._counting, size=size))

    def _counting(self, method: Callable, *, size: Callable) -> Callable:
        def counting(*args, **kwargs):
            if not _alone(args, kwargs):
                self.add(size(args, kwargs))
            return method(*args, **kwargs)

        return counting


class PipelineCost:
    """What a pipeline stage costs beyond collectives, per optimizer step: the bytes it sends to and
    receives from its neighbouring stages (activations forward, their gradients back; the shapes a
    library exchanges once, before the first transfer, are not counted), and the time it spent
    computing (its forwards and backwards) within the span from the schedule's start to its last
    backward. The pipeline's bubble is then 1 − compute ÷ the longest span of the pipeline's ranks
    (StepRecorder.record): what every stage waits while the schedule fills and drains."""

    def __init__(self) -> None:
        self.p2p_bytes = 0
        self._busy = 0.0
        self._started: float | None = None
        self._last_end = 0.0
        self._patches = Patches()

    def start(self) -> None:
        """The step's schedule begins (call it right before the library's step/train_batch)."""
        self._busy, self._started = 0.0, time.perf_counter()

    def computing(self, fn: Callable) -> Callable:
        """`fn` (a stage's forward or backward of one micro-batch), timed as the stage's work."""

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._last_end = time.perf_counter()
                self._busy += self._last_end - started

        return timed

    def sending(self, fn: Callable, tensors: Callable) -> Callable:
        """`fn`, a point-to-point transfer; `tensors(args, kwargs, result)` names what it moves."""

        def counted(*args, **kwargs):
            result = fn(*args, **kwargs)
            self.p2p_bytes += sum(_nbytes(t) for t in tensors(args, kwargs, result))
            return result

        return counted

    def patch(self, owner, name: str, wrap: Callable[[Callable], Callable]) -> None:
        """Replace `owner.name` by ``wrap(original)`` until :meth:`detach`."""
        self._patches.patch(owner, name, wrap)

    def take(self) -> tuple[int, float, float]:
        """(p2p bytes, seconds computing, seconds from the start to the last backward) since the last
        :meth:`start` (zeros where nothing was computed: not a pipeline)."""
        span = self._last_end - self._started if self._started is not None and self._busy else 0.0
        taken = (self.p2p_bytes, self._busy, span)
        self.p2p_bytes, self._busy, self._started = 0, 0.0, None
        return taken

    def detach(self) -> None:
        self._patches.restore()


def model_state_bytes(model: torch.nn.Module, optimizer: object) -> int:
    """Bytes of model state this rank holds — parameters, gradients, optimizer state (the ZeRO
    paper's "model states"; communication buffers are not) — counted from the tensors themselves:
    the model's parameters (the slice a rank holds of a DTensor or a ZeRO-3 partition) and their
    gradients (FSDP2's unsharded ones too, held between no-sync micro-steps), and every tensor the
    optimizer object reaches (torch's state, ZeRO's flat buffers, master partitions and gradient
    partitions). Each storage counts once, whole: parameters that are views into one flat buffer
    count as that buffer."""
    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor: the slice this rank holds
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()

    def children(obj: object) -> Iterator[object]:
        if isinstance(obj, torch.Tensor):
            add(obj)
            yield from (getattr(obj, attr, None) for attr in ("grad", "ds_tensor"))  # ZeRO-3: the partition
        elif isinstance(obj, torch.nn.Module):
            yield from obj.parameters()
            # FSDP2 accumulates unsharded gradients outside .grad (no-sync micro-steps)
            yield from (m._get_fsdp_state() for m in obj.modules() if hasattr(m, "_get_fsdp_state"))
        elif isinstance(obj, dict):
            yield from itertools.chain.from_iterable(obj.items())
        elif isinstance(obj, (list, tuple, set)):
            yield from obj
        elif type(obj).__module__.startswith(_STATE_OWNERS) and hasattr(obj, "__dict__"):
            yield from (value for name, value in vars(obj).items() if not any(b in name for b in _BUFFERS))

    # breadth first, a bounded number of hops from the model and the optimizer
    seen: set[int] = set()
    frontier: list[object] = [model, optimizer]
    for _ in range(10):
        reached = []
        for obj in frontier:
            if id(obj) not in seen:
                seen.add(id(obj))
                reached.extend(children(obj))
        frontier = reached
    return sum(storages.values())


_STATE_OWNERS = ("torch.optim", "torch.distributed.fsdp", "deepspeed.runtime", "deepspeed.ops")
"""Modules whose objects may hold optimizer state or ZeRO's partitions (walked attribute by attribute)."""
_BUFFERS = ("ipg",)
"""Attributes that are communication buffers, not model state (the ZeRO paper's "residual states"):
DeepSpeed's gradient-reduction buckets — ZeRO-3's is reduce_bucket_size elements (5e8: 2 GB in fp32)
whatever the model's size."""


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


def watch_cost(model: torch.nn.Module) -> tuple[PeakMemory, CommCounter | None]:
    """A script's model (gaeq.script.probe): this process's peak memory from now on, and what its training
    wrapper sends (attached before its first backward: DDP takes a comm hook only then) — None where it
    cannot be counted (DDP with a comm hook of the script's own: one hook per model)."""
    memory = PeakMemory(next(model.parameters()).device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return memory, CommCounter()  # a single process sends nothing
    counter = CommCounter()
    try:
        counter.attach(model)
    except RuntimeError:
        return memory, None
    return memory, counter if counter.attached else None
