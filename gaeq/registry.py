"""What each trainer is and can do: one :class:`TrainerSpec` per trainer, everything else derived.

The matrix's rules (which axes a cell may set, which dtypes it runs, which cells can be a resume
source), the trainer a rank imports, what the ranks' fork server preloads and which libraries a
verdict certifies all read these entries. Adding a trainer is one entry here and one module in
`gaeq/trainers/` with ``train(*, cell, problem, ctx) -> dict`` (docs/architecture.md, recipes).

A leaf: no torch, no gaeq imports — the matrix (below the trainers) reads it too.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_DTYPES = ("fp32", "bf16", "fp16", "ds_bf16", "ds_fp16")
AUTOCAST_DTYPES = ("fp32", "bf16")
"""fp32, and bf16 autocast over fp32 weights: what a trainer without a loss scaler runs."""


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    name: str
    """The matrix's `trainer` value, and part of each cell's id."""
    module: str
    """The module whose ``train(*, cell, problem, ctx)`` trains a cell on one rank."""
    description: str
    deepspeed: bool = False
    """Trains through a DeepSpeed engine: the `zero_stage` and `offload` axes apply, the ranks join
    their group through DeepSpeed, and the fork server preloads it."""
    tensor_parallel: bool = False
    """Runs cells whose layers are split over ranks (`tensor_parallel` > 1)."""
    pipeline: str | None = None
    """The module whose ``train`` runs its cells with `pipeline_parallel` > 1 (its library's pipeline
    schedule: the loop is not the accumulation loop of `module`); None: it does not pipeline."""
    pipeline_schedules: tuple[str, ...] = ()
    """The pipeline schedules its pipeline cells may run (:data:`PIPELINE_SCHEDULES`), its default first."""
    short_steps: bool = False
    """Runs an epoch's short last step (`epoch_end: short_step`): its loop asks the data plan how many
    micro-steps each step has, instead of running GA of them."""
    checkpoints: bool = False
    """Writes and resumes checkpoints: a resume experiment's source (and a plain resume's target)."""
    dtypes: tuple[str, ...] = ALL_DTYPES
    """The dtypes its cells may run (the matrix refuses the others)."""
    sequence_parallel: str | None = None
    """Runs cells whose samples' tokens are split over ranks (`sequence_parallel` > 1) with DeepSpeed-Ulysses
    around the attention of: "gpt" — gaeq's GPT (DeepSpeed's DistributedAttention, in gaeq's loop); "hf" — a
    transformers causal LM (the Trainer's ParallelismConfig(sp_backend="deepspeed"): UlyssesSPAttentionHF and its
    data-loader adapter, as users switch it on). None: it does not split sequences."""
    muon: bool = False
    """Builds DeepSpeed's Muon (`optimizer.name: muon`): the engine from its config, a torch loop the same
    class over whole matrices (gaeq/problem/optim.py)."""
    package: str | None = None
    """The library it needs beyond gaeq's own dependencies (`pip install 'gaeq[hf]'`)."""
    preload: tuple[str, ...] = ()
    """Modules the ranks' fork server imports for its cells, beyond torch (a rank then forks with them)."""
    compiles: bool = False
    """Runs cells with `compile: true`: its model under torch.compile (inductor) — a DeepSpeed engine's through
    its own ``engine.compile()`` — against an eager baseline."""
    script: bool = False
    """Runs a user's own script under its launcher (gaeq.script), not a loop gaeq wrote: its module
    launches a cell (``run_script_cell``) instead of training one on a rank."""


PIPELINE_SCHEDULES = {
    "1f1b": "one forward, one backward: after pp − 1 warm-up forwards, each stage alternates (GA ≥ pp)",
    "gpipe": "every micro-batch's forward, then every backward (activations of all GA micro-batches held)",
    "interleaved_1f1b": "1F1B over two model chunks per rank (stage s and s + pp): a smaller bubble, more p2p",
}
"""The `pipeline_schedule` axis: the order in which a pipeline runs its GA micro-batches' forwards and
backwards. Every schedule computes the same gradient; the bubble (time a stage waits) differs."""

DEEPSPEED_ACCUMULATION = {
    "managed": "the engine counts GA (the config's gradient_accumulation_steps) and reduces at its own boundary",
    "manual": "the config says GA 1; the loop runs GA backwards (loss ÷ GA by hand) then one engine.step() — "
    "every backward is then a boundary (open-instruct#1498)",
    "manual_with_boundary": "the manual loop, telling the engine engine.set_gradient_accumulation_boundary(False) "
    "before each backward but the last (True) — DeepSpeed's remedy",
    "manual_unmanaged": "the manual loop with managed_gradient_accumulation: false in the config — DeepSpeed's "
    "other remedy: backward() only accumulates, step() reduces",
}
"""The `deepspeed_accumulation` axis (the deepspeed trainer): who decides where a DeepSpeed step's
accumulation ends — the engine, or a loop that accumulates by hand with GA 1 in the config."""

INSTALL_HF = "pip install 'gaeq[hf]'"
"""The install line of every trainer's `package` (the `hf` extra pins them)."""


def dtypes_said(dtypes: tuple[str, ...]) -> str:
    """A trainer's dtypes, as its error messages say them."""
    if dtypes == AUTOCAST_DTYPES:
        return "fp32 and bf16 (autocast over fp32 weights)"
    return " and ".join(dtypes)


TRAINERS: dict[str, TrainerSpec] = {
    spec.name: spec
    for spec in (
        TrainerSpec(
            name="torch",
            module="gaeq.trainers.torch_manual",
            description="manual PyTorch accumulation: loss ÷ GA, DDP no_sync until the boundary micro-step",
            tensor_parallel=True,
            pipeline="gaeq.trainers.torch_pipeline",
            pipeline_schedules=("1f1b", "gpipe", "interleaved_1f1b"),
            short_steps=True,
            checkpoints=True,
            dtypes=("fp32", "bf16", "fp16"),
            sequence_parallel="gpt",
            muon=True,
            compiles=True,
        ),
        TrainerSpec(
            name="deepspeed",
            module="gaeq.trainers.deepspeed_native",
            description="DeepSpeed's own micro-step accumulation (engine.backward / engine.step), ZeRO 0-3",
            deepspeed=True,
            tensor_parallel=True,
            pipeline="gaeq.trainers.deepspeed_pipeline",
            pipeline_schedules=("1f1b",),  # its TrainSchedule
            short_steps=True,  # its boundary told every micro-step (set_gradient_accumulation_boundary)
            checkpoints=True,
            preload=("gaeq.runtime.preload_deepspeed",),
            muon=True,
            compiles=True,
        ),
        TrainerSpec(
            name="script",
            module="gaeq.script.launch",
            description="the user's own training script, unchanged, under its launcher, watched by gaeq's probe",
            # fp32: the script made float32 (autocast and loss scaler off); the others: as it trains, checked
            dtypes=("fp32", "bf16", "fp16", "ds_bf16", "ds_fp16"),
            script=True,
        ),
        TrainerSpec(
            name="fsdp",
            module="gaeq.trainers.fsdp",
            description="torch FSDP2 (fully_shard), gradients reduce-scattered on the boundary micro-step only",
            tensor_parallel=True,
            short_steps=True,
            dtypes=AUTOCAST_DTYPES,
        ),
        TrainerSpec(
            name="accelerate",
            module="gaeq.trainers.accelerate_native",
            description="accelerate's own loop: Accelerator(gradient_accumulation_steps), accumulate(), backward()",
            dtypes=AUTOCAST_DTYPES,
            package="accelerate",
            preload=("gaeq.runtime.preload_accelerate",),
        ),
        TrainerSpec(
            name="hf",
            module="gaeq.trainers.hf_trainer",
            description="the transformers Trainer, which owns its loop (TrainingArguments from the problem)",
            dtypes=AUTOCAST_DTYPES,
            package="transformers",
            preload=("gaeq.runtime.preload_accelerate", "gaeq.runtime.preload_hf", "gaeq.trainers.hf_trainer"),
        ),
        TrainerSpec(
            name="hf_deepspeed",
            module="gaeq.trainers.hf_trainer",
            description="the transformers Trainer with TrainingArguments(deepspeed=...): its DeepSpeed integration",
            deepspeed=True,
            sequence_parallel="hf",
            dtypes=("fp32",),
            package="transformers",
            preload=(
                "gaeq.runtime.preload_deepspeed",
                "gaeq.runtime.preload_accelerate",
                "gaeq.runtime.preload_hf",
                "gaeq.trainers.hf_trainer",
            ),
        ),
    )
}
"""Every trainer, by name, in the order the schema lists them."""

TRAINER_NAMES = tuple(TRAINERS)
DEEPSPEED_TRAINERS = frozenset(name for name, spec in TRAINERS.items() if spec.deepspeed)
TENSOR_PARALLEL_TRAINERS = frozenset(name for name, spec in TRAINERS.items() if spec.tensor_parallel)
PIPELINE_TRAINERS = frozenset(name for name, spec in TRAINERS.items() if spec.pipeline)
SEQUENCE_PARALLEL_TRAINERS = frozenset(name for name, spec in TRAINERS.items() if spec.sequence_parallel)
COMPILING_TRAINERS = frozenset(name for name, spec in TRAINERS.items() if spec.compiles)
CHECKPOINT_TRAINERS = tuple(name for name, spec in TRAINERS.items() if spec.checkpoints)
