"""The libraries' process-wide state, reset before each cell: a rank trains cell after cell in one
process, and accelerate and DeepSpeed keep singletons that the previous cell's objects left behind.
Imported by every trainer that builds such objects (its own, or inside the transformers Trainer);
each library is imported only when its reset is asked for.
"""

from __future__ import annotations


def reset_accelerate_state() -> None:
    """accelerate keeps process-wide singletons (its state, the accumulation counter): the previous
    cell's are reset before a cell builds its Accelerator (in its trainer, or inside the
    transformers Trainer) — except the distributed state, which is the process group gaeq already
    joined."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def forget_parallel_groups() -> None:
    """Each DeepSpeed engine finds its own groups: AutoTP leaves its (dp, tp) groups in DeepSpeed's
    process-wide state, where the next engine of the process group would take them — a plain
    DeepSpeed cell would average over a data-parallel group of one, an AutoTP cell of another size
    would reuse the old split (DeepSpeed keeps the first tensor-parallel group it made)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    # ... and the Trainer's sequence parallelism makes its (sp, sequence-data) groups once per process
    parallel_state_sp._release_sequence_parallel_groups()
    groups.mpu = None
    groups._TENSOR_MODEL_PARALLEL_GROUP = None
    groups._MODEL_PARALLEL_GROUP = None
    groups._DATA_PARALLEL_GROUP = None


def forget_ulysses_attention() -> None:
    """DeepSpeed's UlyssesSPAttentionHF takes a transformers attention over by writing its wrapper under
    that attention's own name ("sdpa") in transformers' process-wide ALL_ATTENTION_FUNCTIONS (its
    "Being John Malkovich"): left there, every later model of the process with that attention — any
    trainer's cell — would run through the finished cell's all-to-alls. Its overrides are removed."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, function in list(ALL_ATTENTION_FUNCTIONS._local_mapping.items()):
        if function.__module__.startswith("deepspeed."):
            del ALL_ATTENTION_FUNCTIONS[name]
