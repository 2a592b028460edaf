"""Imported once by the fork server (`gaeq run` without --isolate), so that every rank it forks
starts with torch and the trainers already loaded: a process group then starts in a fraction of a
second instead of paying seconds of imports per rank, and the first cell of a group no longer pays the
lazy imports (torch._dynamo, which torch's optimizer constructors pull in). What they cost: docs/costs-and-speed.md,
How fast the lab is.

What else the server imports depends on the matrix (`server.preload_modules`): DeepSpeed
(preload_deepspeed.py), accelerate (preload_accelerate.py), transformers (preload_hf.py) — each only
when a cell needs it, since the ranks cannot start before the server has finished.
"""

from gaeq.runtime import lifeline
from gaeq.runtime.dist import set_accelerator_env

lifeline.bind_to_parent()  # the fork server exits the moment `gaeq` does, however it ends
set_accelerator_env()  # before DeepSpeed is imported (here or later)

import torch._dynamo  # noqa: E402,F401

import gaeq.trainers.torch_manual  # noqa: E402,F401
