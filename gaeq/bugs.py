"""Planted bugs: deliberate mistakes a cell can switch on, so the lab proves it can see them.

A bug is a member of :class:`Bug`, its entry in gaeq/bug_catalogue.py (a :class:`PlantedBug`: where it
exists, what it does), and ``if cell.bug == Bug.X`` at the line of the trainer where the mistake would
be made (a label that depends on it may read it too). Adding one is those three;
tests/unit/test_house.py checks that every member has its entry and a site, and that every site names
a member.
"""

from __future__ import annotations

from dataclasses import dataclass

from gaeq.names import Name

GENERATION_STEPS = 2
"""Optimizer steps one generation batch spans in the planted pg_normalised_over_generation (TRL's sampler
diagram: steps_per_generation 4, GA 2)."""


class Bug(Name):
    """A planted bug's name. Compares, hashes and prints as the name itself, so matrix files, cells
    and report.json keep plain strings; code names it ``Bug.X``, which a typo cannot silently miss."""

    NO_LOSS_DIVISION = "no_loss_division"
    MEAN_OF_MEANS = "mean_of_means"
    CLIP_EVERY_MICRO_STEP = "clip_every_micro_step"
    SCHEDULER_EVERY_MICRO_STEP = "scheduler_every_micro_step"
    DEEPSPEED_DEFAULT_CLIPPING = "deepspeed_default_clipping"
    GRAD_ACCUM_BF16 = "grad_accum_bf16"
    LOSS_SCALE_NOT_UNSCALED_BEFORE_CLIP = "loss_scale_not_unscaled_before_clip"
    UNMIRRORED_DEFAULT_CLIPPING = "unmirrored_default_clipping"
    HF_NUM_ITEMS_PER_MICRO_BATCH = "hf_num_items_per_micro_batch"
    ACCELERATE_SCHEDULER_PER_PROCESS = "accelerate_scheduler_per_process"
    ACCELERATE_LOSS_DIVIDED_TWICE = "accelerate_loss_divided_twice"
    HF_LOSS_PER_MICRO_BATCH = "hf_loss_per_micro_batch"
    HF_TOKENS_PER_DEVICE = "hf_tokens_per_device"
    HF_DEEPSPEED_LOSS_DIVIDED_TWICE = "hf_deepspeed_loss_divided_twice"
    ONE_GRAD_SCALED = "one_grad_scaled"
    TP_GRAD_NORM_PER_SHARD = "tp_grad_norm_per_shard"
    PIPE_LOSS_SUMMED_OVER_GA = "pipe_loss_summed_over_ga"
    PIPE_RESCALED_EVERY_STAGE = "pipe_rescaled_every_stage"
    PIPELINING_STEP_PER_MICRO_BATCH = "pipelining_step_per_micro_batch"
    HSDP_GRAD_NORM_OVER_REPLICAS = "hsdp_grad_norm_over_replicas"
    TOKENS_ALL_REDUCED_THEN_DDP_AVERAGED = "tokens_all_reduced_then_ddp_averaged"
    MOE_AUX_LOSS_NOT_DIVIDED_BY_GA = "moe_aux_loss_not_divided_by_ga"
    EMPTY_MICRO_BATCH_COUNTED = "empty_micro_batch_counted"
    PACKED_SEQUENCES_WEIGHTED_PER_PACK = "packed_sequences_weighted_per_pack"
    PARTIAL_LAST_WINDOW = "partial_last_window"
    MOE_AUX_LOSS_AVERAGED_TWICE = "moe_aux_loss_averaged_twice"
    LR_ZERO = "lr_zero"
    PG_DIVIDED_BY_GA_TWICE = "pg_divided_by_ga_twice"
    PG_NORMALISED_OVER_GENERATION = "pg_normalised_over_generation"
    PG_TOKENS_PER_RANK = "pg_tokens_per_rank"
    MUON_WITHOUT_NEWTON_SCHULZ = "muon_without_newton_schulz"
    SP_TOKENS_OVER_DATA_RANKS_ONLY = "sp_tokens_over_data_ranks_only"
    COMPILED_GUARDS_SKIPPED = "compiled_guards_skipped"
    MOE_COUNTS_OVER_MICRO_BATCH_TOKENS = "moe_counts_over_micro_batch_tokens"
    LOSS_PARALLEL_SHARD_SOFTMAX = "loss_parallel_shard_softmax"


@dataclass(frozen=True)
class PlantedBug:
    name: Bug
    trainers: tuple[str, ...]
    """Trainers that implement the bug (the line where the mistake happens exists only there)."""
    description: str
    dtypes: tuple[str, ...] = ()
    """Dtypes the bug exists in (empty: any)."""
    needs_deepspeed_config: bool = False
    """The bug exists only where the problem has a user's deepspeed_config."""
    loss: str | None = None
    """The problem loss the bug exists in (None: any)."""
    optimizer: str | None = None
    """The problem optimizer the bug exists in (None: any)."""
    min_world_size: int = 1
    """The bug exists only from this many ranks on (a per-process mistake needs several processes)."""
    min_grad_accum: int = 1
    """The bug exists only from this many micro-steps a step on (a second ÷ GA is nothing at GA 1)."""
    min_tensor_parallel: int = 1
    """The bug exists only where layers are split over this many ranks or more."""
    moe: bool = False
    """The bug exists only in a mixture of experts (model.moe)."""
    moe_balance: tuple[str, ...] = ()
    """The balance modes (model.moe.balance) it exists in (empty: any)."""
    packed: bool = False
    """The bug exists only in packed token data (data.packed)."""
    short_step: bool = False
    """The bug exists only at an epoch's short last step (epoch_end: short_step), which the run must reach."""
    min_sequence_parallel: int = 1
    """The bug exists only where each sample's tokens are split over this many ranks or more."""
    min_hsdp_replicas: int = 1
    """The bug exists only where a hybrid-sharded model has this many replicas or more."""
    compiled: bool = False
    """The bug exists only in a compiled cell (`compile: true`): a mistake of the compiled path."""
    loss_parallel: bool = False
    """The bug exists only where the head is split by vocabulary (model.loss_parallel)."""
    pipeline: bool = False
    """The bug lives in a trainer's pipeline module (its schedule): it exists only in cells with
    pipeline stages — and no other bug does (a pipeline cell does not run the accumulation loop)."""
    pipeline_calls: int = 1
    """Schedule runs (``schedule.step()``) per optimizer step the bug makes, GA ÷ this micro-batches each."""
    reported: str = ""
    """Where the mistake was seen in the wild (an issue of the library's tracker), if anywhere."""
