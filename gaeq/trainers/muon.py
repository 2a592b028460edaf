"""Muon in a rank (``optimizer.name: muon`` — DeepSpeed's — or ``torch_muon``): how often its
Newton–Schulz ran.

Muon orthogonalises each matrix's momentum once per optimizer step. Where that happens depends on
the engine — in ``step()`` at ZeRO-0 and in a torch loop (every rank, every matrix), in the
reduction of each rank's partition at ZeRO-1/2, in ``step()`` at ZeRO-3 (each matrix by its owner) —
and it is where the reported bugs live: never at ZeRO-0 (Muon became SGD, DeepSpeed#8441), once per
micro-batch at ZeRO-3 (DeepSpeed#8443). A cell's label promises each matrix orthogonalised once per
step, and the first step's calls, over every rank, are measured against it (torch's Muon, in a torch
loop, orthogonalises every matrix on every rank, as DeepSpeed's at ZeRO-0).
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

import gaeq.newton_schulz as newton_schulz
from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.optim import NS_METHOD
from gaeq.problem.spec import ProblemSpec

MUONS = ("muon", "torch_muon")
"""The problem optimizers that orthogonalise (gaeq/problem/optim.py)."""


ONCE, NEVER, TWICE, SOME = (
    "each matrix once a step",
    "never",
    "more than once a step on a rank",
    "fewer calls than matrices",
)
"""What the first step's Newton–Schulz calls, over every rank, say (``ran.newton_schulz``)."""


def label(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What a Muon cell's label promises: each matrix orthogonalised once per step — by every rank
    that updates it whole (a torch loop, ZeRO-0), by the ranks holding a part of it (ZeRO-1/2: a
    matrix across two ranks' partitions is orthogonalised by both) or by its owner (ZeRO-3); never
    twice on a rank, never by none. Nothing for another optimizer."""
    if problem.optimizer.name not in MUONS:
        return {}
    return {"newton_schulz": NEVER if cell.bug == Bug.MUON_WITHOUT_NEWTON_SCHULZ else ONCE}


def watch(ran, *, matrices: int, optimizer: str) -> None:
    """Count this cell's Newton–Schulz calls; `ran` reads them after the first step, over every rank
    — and, for DeepSpeed's Muon, the dtype its Newton–Schulz ran in (the accelerator's fp16 answer
    decides it: gaeq/accelerator.py)."""
    newton_schulz.count()
    start = newton_schulz.calls()
    seen: dict[str, int] = {}

    def count() -> dict[str, int]:
        if not seen:
            calls = torch.tensor([newton_schulz.calls() - start], dtype=torch.int64)
            most, total = calls.clone(), calls.clone()
            if dist.is_initialized():  # every rank reads it at the same point: the end of the first step
                dist.all_reduce(most, op=dist.ReduceOp.MAX)
                dist.all_reduce(total)
            seen.update(total=total.item(), most=most.item())
        return seen

    def said() -> str:
        total, most = count()["total"], count()["most"]
        return NEVER if total == 0 else TWICE if most > matrices else SOME if total < matrices else ONCE

    ran.read_at_first_step(
        muon_matrices=lambda: matrices, newton_schulz=said, newton_schulz_calls=lambda: count()["total"]
    )
    if optimizer == "muon":
        ran.read_at_first_step(newton_schulz_dtype=deepspeeds_dtype)


def deepspeeds_dtype() -> str:
    """The dtype DeepSpeed's Newton–Schulz runs in, by its own rule (``ns_compute_dtype``, for gaeq's
    method, gram): float16 where the accelerator answers yes to fp16, float32 where no."""
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    return str(ns_compute_dtype(NS_METHOD)).removeprefix("torch.")


def matrices(optimizer: torch.optim.Optimizer) -> int:
    """The matrices a torch loop's Muon orthogonalises: DeepSpeed's Muon groups, or torch's Muon's."""
    inner = getattr(optimizer, "muon", None)  # TorchMuonWithAdamW
    groups = inner.param_groups if inner is not None else [g for g in optimizer.param_groups if g["use_muon"]]
    return sum(len(g["params"]) for g in groups)


def without_newton_schulz(optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed#8441's step: each matrix moved by its raw gradient, as if already orthogonalised (the
    planted bug muon_without_newton_schulz; Muon becomes SGD without momentum)."""
    from deepspeed.runtime.zero.muon import muon_optimizer

    step = optimizer.step

    def sgd_step(self, *args, **kwargs):
        update, muon_optimizer.muon_update = muon_optimizer.muon_update, lambda grad, momentum, **_: grad
        try:
            return step(*args, **kwargs)
        finally:
            muon_optimizer.muon_update = update

    optimizer.step = types.MethodType(sgd_step, optimizer)  # a method: the LR scheduler wraps its __func__
