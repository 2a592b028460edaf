"""The torch functions a training loop calls that the probe (gaeq.script.probe) counts or reads at: autograd's
backward (``loss.backward()`` ends there; DeepSpeed's and accelerate's ``backward`` too), gradient
clipping (``clip_grad_norm_``, and torchtitan's ``get_total_norm`` + ``clip_grads_with_norm_``),
``zero_grad``, the LR schedulers' ``step`` — a library wrapper's repeats of one call counted once —,
``torch.distributed.all_reduce`` on a gradient (the ranks' gradients combined by hand: summed or averaged) and
``pad_sequence`` (the collation's padding value). Each is replaced by a function that tells the probe,
then calls the original."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch


def patch(probe) -> None:
    backward = torch.autograd.backward

    @functools.wraps(backward)
    def probed_backward(tensors, *args, **kwargs):
        probe._before_backward(tensors)
        done = backward(tensors, *args, **kwargs)
        probe._after_backward()  # where the gradients are as the backward left them
        return done

    torch.autograd.backward = probed_backward  # Tensor.backward calls it too

    def read_before(clip):
        """A clipping function that tells the probe first (it reads the gradients' norm before they are clipped)."""

        @functools.wraps(clip)
        def probed_clip(parameters, *args, **kwargs):
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            probe._before_clip(parameters)
            return clip(parameters, *args, **kwargs)

        return probed_clip

    torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = read_before(
        torch.nn.utils.clip_grad_norm_
    )
    # torchtitan's clipping: get_total_norm, then this (clip_grad_norm_ calls its own module's, not this name)
    torch.nn.utils.clip_grads_with_norm_ = read_before(torch.nn.utils.clip_grads_with_norm_)

    zero_grad = torch.optim.Optimizer.zero_grad

    @functools.wraps(zero_grad)  # its signature too: libraries inspect it (accelerate's zero_grad)
    def probed_zero_grad(optimizer, *args, **kwargs):
        probe.events["zero_grad"] += 1
        return zero_grad(optimizer, *args, **kwargs)

    torch.optim.Optimizer.zero_grad = probed_zero_grad

    scheduler_step = torch.optim.lr_scheduler.LRScheduler.step
    schedulers = Schedulers(probe)

    @functools.wraps(scheduler_step)
    def probed_scheduler_step(scheduler, *args, **kwargs):
        if not schedulers.depth:
            probe.events["schedule_advanced"] += 1
            if schedulers.called_by_script(scheduler, sys._getframe(1)):
                probe.events["scheduler"] += 1
        schedulers.depth += 1
        try:
            return scheduler_step(scheduler, *args, **kwargs)
        finally:
            schedulers.depth -= 1

    torch.optim.lr_scheduler.LRScheduler.step = probed_scheduler_step

    if torch.distributed.is_available():
        _patch_all_reduce(probe)

    pad_sequence = torch.nn.utils.rnn.pad_sequence

    @functools.wraps(pad_sequence)
    def probed_pad_sequence(sequences, batch_first=False, padding_value=0.0, *args, **kwargs):
        probe.samples.pad_values.add(padding_value)  # the collation's padding: removed before hashing
        return pad_sequence(sequences, batch_first, padding_value, *args, **kwargs)

    torch.nn.utils.rnn.pad_sequence = probed_pad_sequence


class Schedulers:
    """Which scheduler steps are the script's calls."""

    def __init__(self, probe) -> None:
        self.probe = probe
        self.depth = 0
        """Scheduler steps in progress (a scheduler stepping others inside its own step is one call)."""
        self._wrapper_call: Any = None
        """The frame of the library wrapper's step that stepped the scheduler last (one call of the script's)."""

    def called_by_script(self, scheduler, caller) -> bool:
        """Whether this scheduler step is a call of the script's: not a library wrapper's repeat of
        one call (accelerate's prepared scheduler steps the one it wraps once per process)."""
        owner = caller.f_locals.get("self")
        if owner is None or owner is scheduler or getattr(owner, "scheduler", None) is not scheduler:
            return True
        if caller is self._wrapper_call:
            return False  # the same call of the wrapper, stepping again
        self._wrapper_call = caller
        self.probe.events[f"wrapper:{type(owner).__module__}.{type(owner).__qualname__}"] = 1
        return True


def _patch_all_reduce(probe) -> None:
    """`all_reduce` on a gradient as the last backward left it: the script combines the ranks' gradients by hand
    (torchtune's and hand-written loops: SUM, then a division — or AVG). DDP's and FSDP's own reductions run inside
    the backward, not through this function; a DeepSpeed engine's gradients are not read."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    all_reduce = distributed_c10d.all_reduce
    ops = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean"}

    @functools.wraps(all_reduce)
    def probed_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        held = probe._all_reduce(tensor)
        done = all_reduce(tensor, op, group, async_op)
        if held:  # (one left running is combined when it is waited on: not read)
            probe._all_reduce(tensor, None if async_op else ops.get(op), done=True)
        return done

    dist.all_reduce = distributed_c10d.all_reduce = probed_all_reduce
