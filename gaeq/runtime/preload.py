"""Imported once by the fork server (`gaeq run` without --isolate), so that every rank it forks
starts with torch, DeepSpeed and the trainers already loaded: a process group then starts in a
fraction of a second instead of paying ~2 s of imports per rank, and the first cell of a group no
longer pays the lazy imports (torch._dynamo on the first optimizer, ~1.7 s; DeepSpeed's ZeRO stages).
"""

from gaeq.runtime import lifeline
from gaeq.runtime.dist import set_accelerator_env

lifeline.bind_to_parent()  # the fork server exits the moment `gaeq` does, however it ends
set_accelerator_env()  # before DeepSpeed is imported

import deepspeed  # noqa: E402,F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401  (ZeRO's optimizer check: torch.compile, ~1.4 s)
import deepspeed.runtime.zero.stage3  # noqa: E402,F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401

import gaeq.trainers.deepspeed_native  # noqa: E402,F401
import gaeq.trainers.torch_manual  # noqa: E402,F401
