"""A compiled cell (the `compile` axis): its model under torch.compile — inductor, as training scripts
compile by default in 2026 (nanoGPT's `compile=True`, torchtitan) — a DeepSpeed engine's through its own
``engine.compile()``; and what really ran: the graphs compiled, the graph breaks, the seconds compiling.

Every cell of the torch and deepspeed trainers starts from a clean compiler (:func:`start`): the graphs,
guards and counters of an earlier cell in the same rank never reach it (inductor's cache of compiled
code, keyed by the graph, is kept: a later cell of the same shapes loads its kernels instead of building
them). The compile time is dynamo's and inductor's own accounting, apart from the steps' time.
"""

from __future__ import annotations

from typing import Any

import torch


def start(compile: bool, model: torch.nn.Module | None = None) -> None:
    """Before a cell trains: a clean compiler, and `model` compiled in place (its parameter names kept)
    when the cell asks for it (a DeepSpeed engine is compiled with :func:`compile_engine`)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.utils.compilation_time_metrics.clear()
    if compile and model is not None:
        model.compile()


def compile_engine(engine) -> None:
    """A DeepSpeed engine compiled as its users compile it."""
    engine.compile()


def facts() -> dict[str, Any]:
    """What the compiler did in this cell so far: read at the first step for the label check (compiled
    or not), and at the end for the report (graphs, graph breaks, seconds compiling)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    phases = ("_compile.compile_inner", "backward._backward_impl")  # the forward's graphs, the backward's
    seconds = sum(sum(compilation_time_metrics.get(phase, ())) for phase in phases)
    return {
        "compiled": counters["stats"]["unique_graphs"] > 0,
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "compile_seconds": round(seconds, 3),
    }


def divided_with_guards_skipped():
    """The planted bug compiled_guards_skipped: ``loss_sum / normaliser`` compiled with every guard skipped
    (``guard_filter_fn=torch.compiler.skip_all_guards_unsafe``, what a script does to save the guards'
    cost): the normaliser of the first call is traced in as a constant and never checked again."""

    def divide(loss_sum: torch.Tensor, normaliser: int) -> torch.Tensor:
        return loss_sum / normaliser

    return torch.compile(divide, backend="eager", options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})
