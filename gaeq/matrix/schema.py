"""The matrix file's schema: pydantic at the YAML boundary, `extra="forbid"` (a typo is an error,
never a silently ignored knob). Each model documents its fields; the CLI's `validate` and the
matrix reference (docs/matrix.md) are written from them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, NonNegativeInt, ValidationError, model_validator

from gaeq.bug_catalogue import BUGS
from gaeq.problem.spec import Dtype, PositiveInt, ProblemSpec, Samples
from gaeq.problem.spec import Spec as _Spec
from gaeq.registry import DEEPSPEED_ACCUMULATION, PIPELINE_SCHEDULES, TRAINER_NAMES

WorldSize = Annotated[int, Field(gt=0, le=4096)]
TensorParallel = Annotated[int, Field(gt=0, le=4096)]
PipelineParallel = Annotated[int, Field(gt=0, le=64)]
Replicas = Annotated[int, Field(gt=0, le=4096)]
SequenceParallel = Annotated[int, Field(gt=0, le=4096)]

Trainer = Literal[TRAINER_NAMES]  # gaeq/registry.py: one entry per trainer
PipelineSchedule = Literal[tuple(PIPELINE_SCHEDULES)]
DeepSpeedAccumulation = Literal[tuple(DEEPSPEED_ACCUMULATION)]
Expect = Literal["match", "diverge"]
ZeroStage = Literal[0, 1, 2, 3]
Offload = Literal["none", "cpu", "nvme"]
Tracked = Literal["loss", "grad_norm", "params", "grads"]
TENSOR_METRICS = ("grads", "params")
METRICS = (
    *("split", "data", "init", "events", "grads", "params", "skipped", "loss", "grad_norm", "lr", "update"),
    "weights",
)
"""What can be compared at every step (gaeq.results.compare), in the order a tie is reported: what a
script's probe saw first (another split than the cell's, other samples, other initial weights, other
calls explain every number after them); then tensors, because they localise a divergence to one
parameter; then an fp16 update skipped on one side only, because it explains the rest; the targets'
weights last (gaeq.results.weighing): they name a weighting the numbers did not show at that step. Here,
on the matrix's floor, because an `expect` names them."""
Metric = Literal[METRICS]
ALWAYS_COMPARED = ("skipped", "lr")
"""Metrics every cell's trace is compared on, whatever the matrix tracks."""
SCRIPT_METRICS = ("split", "data", "init", "events", "update", "weights")
"""Metrics only a script cell's probe records (gaeq.results.script_checks)."""
VariantName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+$")]
BASE = "base"
"""The variant name of the matrix's own `problem`."""


MATRIX_FILE = "matrix.yaml"
"""The matrix as run, kept in its run directory (what `gaeq report` and `gaeq worker` read)."""


class MatrixError(ValueError):
    """A matrix file a user can fix. The message says what to change."""


class AxesSpec(_Spec):
    trainer: list[Trainer] = Field(["torch", "deepspeed"], min_length=1)
    world_size: list[WorldSize] = Field(
        [1], min_length=1, description="Ranks in all (pipeline stages × data-parallel × tensor-parallel)."
    )
    tensor_parallel: list[TensorParallel] = Field(
        [1],
        min_length=1,
        description="Ranks each layer is split over (torch, fsdp, deepspeed); data-parallel ranks = world_size ÷ this.",
    )
    pipeline_parallel: list[PipelineParallel] = Field(
        [1],
        min_length=1,
        description="Pipeline stages the model is split into (torch: torch.distributed.pipelining; deepspeed: "
        "PipelineModule); data-parallel ranks = world_size ÷ (tensor_parallel × this).",
    )
    pipeline_schedule: list[PipelineSchedule] = Field(
        ["1f1b"],
        min_length=1,
        description="Pipeline cells only: the order of the micro-batches' forwards and backwards (torch: "
        f"{', '.join(PIPELINE_SCHEDULES)}; deepspeed: 1f1b). A schedule a trainer does not run is skipped for it.",
    )
    sequence_parallel: list[SequenceParallel] = Field(
        [1],
        min_length=1,
        description="Ranks each sample's tokens are split over — DeepSpeed-Ulysses (torch cells, gaeq's GPT): "
        "attention through DeepSpeed's DistributedAttention, an all-to-all each way; data-parallel ranks = "
        "world_size ÷ (tensor_parallel × pipeline_parallel × this).",
    )
    hsdp_replicas: list[Replicas] = Field(
        [1],
        min_length=1,
        description="fsdp cells only: FSDP2 on a 2-D (replicate × shard) mesh — HSDP — with this many replicas, "
        "each sharding the model over data-parallel ranks ÷ this (1: plain FSDP, every rank one shard).",
    )
    micro_batch_size: list[Samples] = Field(min_length=1)
    zero_stage: list[ZeroStage] = Field([0], min_length=1, description="DeepSpeed cells only.")
    offload: list[Offload] = Field(
        ["none"],
        min_length=1,
        description="DeepSpeed cells only: ZeRO-Offload of the optimizer (and of parameters at ZeRO-3) to CPU memory, "
        "or to files (nvme: ZeRO-3, needs libaio).",
    )
    deepspeed_accumulation: list[DeepSpeedAccumulation] = Field(
        ["managed"],
        min_length=1,
        description="The deepspeed trainer's cells only: who ends a step's accumulation — the engine (managed), or "
        "a loop that runs GA backwards with GA 1 in the config (manual; manual_with_boundary and manual_unmanaged: "
        "DeepSpeed's remedies for it).",
    )
    compile: list[bool] = Field(
        [False],
        min_length=1,
        description="The model under torch.compile (inductor; a DeepSpeed engine's through engine.compile()) — the "
        "torch and deepspeed trainers; the baseline stays eager. Others: eager whatever this says.",
    )
    dtype: list[Dtype] | None = Field(None, min_length=1, description="Default: [problem.dtype].")
    variant: list[VariantName] = Field([BASE], min_length=1, description="Problem variants the axes apply to.")
    bug: list[str | None] = Field(
        [None],
        min_length=1,
        description="Planted bugs in EVERY split of the product, as users have them (null: none): a split where the "
        "bug cannot exist — another trainer, or the whole batch in one micro-batch on one rank — is left out for it.",
    )


class FaultSpec(_Spec):
    """Fault injection, for tests of the runtime: a rank that fails at a given step."""

    rank: int = Field(0, ge=0)
    step: int = Field(0, ge=0)
    kind: Literal["raise", "exit", "crash", "hang", "oom"] = Field(
        "raise",
        description="raise: an exception; exit: os._exit(17); crash: a segmentation fault in native code "
        "(a read of address 0); hang: a rank that never answers again; oom: an allocation that fails (an "
        "exbibyte asked of torch's allocator).",
    )


class ExpectSpec(_Spec):
    """What a cell is expected to show: a verdict and, for `diverge`, what must catch it. The matrix
    file may write the verdict alone (`expect: diverge`)."""

    verdict: Expect = Field(description="match: within tolerance at every step; diverge: some metric leaves it.")
    caught_by: Metric | None = Field(
        None,
        description="diverge only: the metric that must be the first to diverge (the comparison's caught_by; "
        f"on a tie at one step, the first of {', '.join(METRICS)}). Default: any.",
    )
    step: NonNegativeInt | None = Field(
        None, description="diverge only: the optimizer step at which caught_by (else any metric) first diverges."
    )
    holds: list[Metric] = Field(
        [], description="diverge only: metrics that must not diverge at any step (each one compared by the cell)."
    )

    @model_validator(mode="after")
    def _check(self) -> ExpectSpec:
        if self.verdict == "match":
            said = [k for k in ("caught_by", "step", "holds") if getattr(self, k) not in (None, [])]
            if said:
                raise ValueError(f"{said[0]} says what catches a divergence: only with verdict diverge")
        if self.caught_by is not None and self.caught_by in self.holds:
            raise ValueError(f"caught_by {self.caught_by!r} cannot also be in holds (it must diverge)")
        if len(set(self.holds)) != len(self.holds):
            raise ValueError(f"holds names a metric twice: {self.holds}")
        return self


def _verdict_alone(value: Any) -> Any:
    """`expect: diverge` is `expect: {verdict: diverge}`."""
    if isinstance(value, str):
        return {"verdict": value}
    if value is not None and not isinstance(value, dict):
        raise ValueError("expect is match, diverge or a mapping {verdict, caught_by, step, holds}")
    return value


ExpectGiven = Annotated[ExpectSpec | None, BeforeValidator(_verdict_alone)]


class CellSpec(_Spec):
    """One explicit cell, e.g. a control with a planted bug: a split, and what is planted in it."""

    trainer: Trainer
    world_size: WorldSize = 1
    tensor_parallel: TensorParallel = 1
    pipeline_parallel: PipelineParallel = 1
    pipeline_schedule: PipelineSchedule | None = Field(None, description="Pipeline cells only. Default: 1f1b.")
    sequence_parallel: SequenceParallel = 1
    hsdp_replicas: Replicas = 1
    micro_batch_size: Samples
    zero_stage: ZeroStage | None = None
    offload: Offload = "none"
    deepspeed_accumulation: DeepSpeedAccumulation = "managed"
    compile: bool = Field(False, description="The model under torch.compile (the torch and deepspeed trainers).")
    dtype: Dtype | None = Field(None, description="Default: the variant's dtype (or the first of axes.dtype).")
    variant: VariantName = BASE
    bug: str | None = Field(None, description=f"A planted bug: one of {sorted(BUGS)}.")
    expect: ExpectGiven = Field(
        None,
        description="match or diverge, or {verdict: diverge, caught_by, step, holds}. Default: 'diverge' with a "
        "bug, else 'match'.",
    )
    fault: FaultSpec | None = None
    args: list[str] = Field(
        [], description="Script cells only: arguments after the script's own (a mistake behind a flag, say)."
    )
    weight_error: float | None = Field(
        None,
        gt=0,
        le=1,
        description="A planted error of known size: every micro-batch's rows reweighed 1 ± this — the first "
        "half's gradient × (1 + this), the rest's less, the total weight unchanged (the shape of a mean of "
        "means) —, in any trainer or script (expects 'diverge' unless told). What a run's detection limit "
        "means, tried directly.",
    )


class BaselineSpec(_Spec):
    """The reference every split of its group is compared with: a split of its own (`baseline: auto` — or
    `{auto: true}` — lets the run choose it)."""

    trainer: Trainer = "torch"
    world_size: WorldSize = 1
    micro_batch_size: Samples | None = Field(None, description="Default: train_batch_size (GA = 1).")
    zero_stage: ZeroStage | None = None
    auto: bool = Field(
        False,
        description="The fewest ranks at GA 1 whose micro batch fits, found from what ran: world 1 with the whole "
        "batch, else — where that ran out of memory — the largest micro batch a split of the group ran at.",
    )
    none: bool = Field(
        False,
        description="No reference (`baseline: none`, a script's only): each split judged by the weights its "
        "targets got in one run of it (gaeq.objective.weighting) — the objective's weighting, not the optimizer, "
        "the data or the schedule.",
    )

    @model_validator(mode="before")
    @classmethod
    def _auto(cls, given: Any) -> Any:
        return {"auto": True} if given == "auto" else {"none": True} if given == "none" else given

    @model_validator(mode="after")
    def _auto_alone(self) -> BaselineSpec:
        if self.auto and {"world_size", "micro_batch_size"} & self.model_fields_set:
            raise ValueError("auto chooses world_size and micro_batch_size: give them, or auto, not both")
        if self.none and ({"world_size", "micro_batch_size", "zero_stage"} & self.model_fields_set or self.auto):
            raise ValueError("none is no reference: give a reference's split, or none, not both")
        return self


class ResumeTargetSpec(_Spec):
    """Where a checkpoint is resumed: the source's trainer, dtype and variant, another split."""

    world_size: WorldSize = 1
    micro_batch_size: Samples
    zero_stage: ZeroStage | None = None
    offload: Offload = "none"
    drop: list[Literal["optimizer", "schedule"]] = Field(
        [], description="Negative controls: resume without the optimizer state, or with the LR schedule restarted."
    )
    expect: ExpectGiven = Field(
        None,
        description="match or diverge, or {verdict: diverge, caught_by, step, holds}. Default: 'diverge' when "
        "something is dropped, else 'match'.",
    )


class ResumeSpec(_Spec):
    """Train `from` to step `at_step`, checkpoint, (convert,) and resume in every `to` cell."""

    from_: CellSpec = Field(alias="from", description="The source cell (added to the matrix if it is not there).")
    at_step: PositiveInt = Field(description="Optimizer steps completed before the checkpoint.")
    universal: bool = Field(
        True, description="Convert with DeepSpeed's ds_to_universal and load with load_universal (DeepSpeed, ZeRO ≥ 1)."
    )
    to: list[ResumeTargetSpec] = Field(min_length=1)


class VariantSpec(_Spec):
    """Another problem in the same matrix: the matrix's `problem` with these keys replaced."""

    problem: dict[str, Any] = Field(default_factory=dict, description="Deep-merged onto the matrix's problem.")
    baseline: BaselineSpec | None = Field(None, description="Default: the matrix's baseline.")


class ToleranceSpec(_Spec):
    """Overrides of the per-dtype tolerance ladder (gaeq.results.compare.DEFAULT_TOLERANCES)."""

    loss_atol: float | None = Field(None, ge=0)
    loss_rtol: float | None = Field(None, ge=0)
    grad_norm_rtol: float | None = Field(None, ge=0)
    tensor_atol: float | None = Field(None, ge=0)
    tensor_rtol: float | None = Field(None, ge=0)


class MatrixSpec(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    problem: ProblemSpec
    variants: dict[VariantName, VariantSpec] = {}
    axes: AxesSpec | None = Field(None, description="The cartesian product of splits; optional with explicit cells.")
    cells: list[CellSpec] = []
    resume: list[ResumeSpec] = Field(
        [], description="Checkpoint → resume experiments; resumed cells are compared from their resume step on."
    )
    baseline: BaselineSpec = BaselineSpec()
    on_indivisible: Literal["error", "skip"] = Field(
        "error", description="A split where B is not divisible by micro × world: fail validation, or skip the cell."
    )
    tolerances: dict[Dtype, ToleranceSpec] = {}
    track: list[Tracked] = Field(
        ["loss", "grad_norm"],
        min_length=1,
        description="What is compared with the baseline. params/grads also save full (ZeRO-gathered) tensors "
        "at every boundary: gradients before the update, parameters after it.",
    )
    track_every: PositiveInt = Field(1, description="Save params/grads every N optimizer steps (and at the last).")
    timeout_s: float = Field(
        300.0, gt=0, le=86400, description="Per cell; a rank silent for longer makes the cell `error`."
    )
    keep_nvme_swap: bool = Field(
        False,
        description="Keep each nvme cell's swap folder (cells/<id>/nvme_swap) when the cell ends; default: removed.",
    )
    noise_floor: bool = Field(
        True,
        description="Train twins of each group's baseline (its own split, every gradient nudged by a unit in the "
        "last place before each step) and widen the loss and grad norm tolerances to what rounding alone does to "
        "this problem (never below the dtype's constants, never above 1000 × them).",
    )
    floor_twins: int = Field(
        2,
        ge=1,
        le=8,
        description="Noise-floor twins per group, each nudged with its own signs: the floor is their most.",
    )
    detection_limit: bool = Field(
        True,
        description="Train each group's baseline once more with an error of known size planted (half of each "
        "batch's gradient × 1.01) and report the smallest such error the run would have caught.",
    )


def baseline_spec(spec: MatrixSpec, variant: str) -> BaselineSpec:
    """The baseline a variant's groups are judged against: its own, else the matrix's."""
    given = spec.variants.get(variant)
    return (given.baseline if given is not None else None) or spec.baseline


def describe(exc: ValidationError) -> str:
    """The first pydantic error as one line that names the key: `problem.steps: ...`."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "top level"
    if err["type"] == "extra_forbidden":
        return f"unknown key {where!r} (check its spelling and where it sits)"
    if err["type"] == "missing":
        return f"missing key {where!r}"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{where}: {err['msg']}, got {got}{more}"
