"""The ranks' fork server: what it imports before it forks a rank, and the context ranks start from.

Importing torch (and DeepSpeed, accelerate, transformers) takes seconds; a rank forked from a server
that imported them once starts in a moment. Which modules a run needs comes from its cells'
trainers (gaeq/registry.py) and models, and from what a user's script lists (`script.imports`).
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Mapping, Sequence

from gaeq.matrix import Cell
from gaeq.problem.spec import HFModelSpec, ProblemSpec
from gaeq.registry import TRAINERS

PRELOAD = "gaeq.runtime.preload"
"""What every fork server imports: torch and the manual trainer."""
PRELOAD_DEEPSPEED = "gaeq.runtime.preload_deepspeed"
"""DeepSpeed, for its trainers (gaeq/registry.py) and wherever its Muon is the optimizer."""
PRELOAD_HF = "gaeq.runtime.preload_hf"
"""transformers, for a cell whose model is a transformers class (whatever its trainer)."""
SCRIPT_PRELOADS = {
    "deepspeed": (PRELOAD_DEEPSPEED,),
    "accelerate": ("gaeq.runtime.preload_accelerate",),
    "transformers": ("gaeq.runtime.preload_accelerate", PRELOAD_HF),  # the Trainer imports accelerate
}
"""What the fork server imports for a user's script that imports one of these libraries (ScriptSpec.libraries):
gaeq's own preload of it. Any other module a script lists is imported as is, after gaeq's."""
PRELOAD_ORDER = tuple(dict.fromkeys([PRELOAD, *(m for spec in TRAINERS.values() for m in spec.preload), PRELOAD_HF]))
"""Every module a fork server may import, in the order it imports them."""


def warm_up(cells: Sequence[Cell], problems: Mapping[str, ProblemSpec], *, isolate: bool = False) -> None:
    """Start the fork server now (its imports take seconds), so that it is ready by the time the
    first process group is launched; call it before other start-up work."""
    if not isolate and sys.platform == "linux":
        start(preload_modules(cells, problems))


def start(preload: Sequence[str]) -> None:
    """Start the fork server with these imports (Linux), unless it runs already."""
    from multiprocessing import forkserver

    rank_context(isolate=False, preload=preload)
    forkserver.ensure_running()


def preload_modules(cells: Sequence[Cell], problems: Mapping[str, ProblemSpec]) -> list[str]:
    """What the fork server imports before it forks a rank: torch and the manual trainer always;
    what each cell's trainer needs (gaeq/registry.py: DeepSpeed, accelerate, transformers),
    transformers for a transformers model and what a user's script imports, only when a cell needs
    them (the server's imports are on the critical path of every run: the first group cannot start
    before they are done). gaeq's own come first, in PRELOAD_ORDER (preload.py sets the environment
    DeepSpeed reads at import); then a script's other modules, in the order it lists them."""
    wanted = {PRELOAD, *(module for c in cells for module in TRAINERS[c.trainer].preload)}
    if any(isinstance(problems[c.variant].model, HFModelSpec) for c in cells):
        wanted.add(PRELOAD_HF)
    if any(problems[c.variant].optimizer.name == "muon" or c.sequence_parallel > 1 for c in cells):
        wanted.add(PRELOAD_DEEPSPEED)  # DeepSpeed's Muon on every trainer, its Ulysses attention
    scripts = [problems[c.variant].script for c in cells if problems[c.variant].script is not None]
    listed = [
        module for script in scripts for name in script.libraries() for module in SCRIPT_PRELOADS.get(name, (name,))
    ]
    wanted.update(listed)
    ours = [module for module in PRELOAD_ORDER if module in wanted]
    return ours + [module for module in dict.fromkeys(listed) if module not in PRELOAD_ORDER]


def rank_context(*, isolate: bool, preload: Sequence[str]):
    """Ranks fork from a server that has imported torch (and what the cells need, `preload`) once
    (Linux); with `isolate`, every group is a fresh interpreter — exactly what one launch per config
    costs."""
    if isolate or sys.platform != "linux":
        return mp.get_context("spawn")
    # DS_ACCELERATOR: set by the fork server's preload (and by a spawned rank) before DeepSpeed
    # is imported — not here, where asking torch about CUDA would import it before the server starts.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx
