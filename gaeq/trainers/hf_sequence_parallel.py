"""The transformers Trainer's own sequence parallelism (hf_deepspeed cells with `sequence_parallel` > 1):
DeepSpeed's Ulysses (ALST) switched on through accelerate's ParallelismConfig, as users do — and what
gaeq reads back from it. The Trainer module (gaeq/trainers/hf_trainer.py) configures it with these."""

from __future__ import annotations

from typing import Any

import torch

from gaeq.matrix import Cell


def sequence_parallel_args(cell: Cell, *, seq_len: int) -> dict[str, Any]:
    """TrainingArguments' `parallelism_config` for a cell with sequence_parallel > 1: DeepSpeed's Ulysses
    (ALST) through accelerate, as users switch it on — sp ranks per sample, the data-parallel replicas
    beside them (what DeepSpeed's batch arithmetic reads), sdpa under the all-to-alls, `seq_len` fixed."""
    if cell.sequence_parallel == 1:
        return {}
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length=seq_len, sp_seq_length_is_variable=False, sp_attn_implementation="sdpa"
    )
    config = ParallelismConfig(
        sp_size=cell.sequence_parallel, sp_backend="deepspeed", sp_handler=handler, dp_replicate_size=cell.data_parallel
    )
    return {"parallelism_config": config}


def padded_length(task, cell: Cell) -> int:
    """Tokens of each sample the Trainer is given: the data's, and under sequence parallelism `sp` more.
    DeepSpeed's data-loader adapter shifts `labels` itself (its shift_labels replace any given), which
    drops the last target: each sample is given sp pad tokens longer, their labels ignored — causal
    attention keeps them out of every real token's output — so that no target is lost."""
    seq_len = task.built.dataset.seq_len
    return seq_len + cell.sequence_parallel if cell.sequence_parallel > 1 else seq_len


def averaged_over(engine) -> int:
    """The ranks a DeepSpeed engine divides the sum of its ranks' gradients by under sequence parallelism
    (0.19.8, read in its source; each case a cell of experiments/sequence_parallel.yaml): ZeRO 0–2 by the
    data-parallel ranks — world ÷ sp, so the sequence ranks' slices add up (engine.py, stage_1_and_2.py) —;
    ZeRO-3 by every rank of the sequence-data group when it reduce-scatters (its default, stage3.py
    __avg_scatter_grads), by world ÷ sp when it does not (__avg_scatter_contiguous_grads)."""
    dp = engine.seq_dp_world_size // engine.sequence_parallel_size
    if engine.zero_optimization_stage() == 3 and engine.zero_reduce_scatter():
        return dp * engine.sequence_parallel_size
    return dp


def attention_function(model: torch.nn.Module) -> str:
    """The function a transformers model's attention calls, as module.name (read in transformers' registry)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    function = ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation]
    return f"{function.__module__}.{function.__name__}"
