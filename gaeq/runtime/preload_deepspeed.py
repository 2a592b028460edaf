"""Imported by the fork server as well when a matrix has DeepSpeed cells (paid once instead of by
every rank of every group; see preload.py)."""

import deepspeed  # noqa: F401
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (ZeRO's optimizer check: torch.compile)
import deepspeed.runtime.zero.stage3  # noqa: F401
import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401

import gaeq.trainers.deepspeed_native  # noqa: F401
