"""The matrix file (``ga.yaml``): one training problem and the ways to split its global batch.

The YAML boundary is pydantic (``extra="forbid"``: a typo is an error, never a silently ignored
knob). The problem specs stay frozen pydantic models inside the lab; a :class:`Cell` is a frozen
dataclass that everyone may import. Gradient accumulation is never chosen, always derived::

    grad_accum_steps = train_batch_size // (micro_batch_size * world_size)
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gaeq.bugs import BUGS

Trainer = Literal["torch", "deepspeed"]
Dtype = Literal["fp32", "bf16"]
Expect = Literal["match", "diverge"]
ZeroStage = Literal[0, 1, 2, 3]
PositiveInt = Annotated[int, Field(gt=0)]


class MatrixError(ValueError):
    """A matrix file a user can fix. The message says what to change."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------------------------------------
# The problem: WHAT is trained. Identical for every cell of the matrix.
# ---------------------------------------------------------------------------------------------


class ModelSpec(_Spec):
    kind: Literal["mlp"] = "mlp"
    in_features: PositiveInt = 16
    hidden: PositiveInt = 64
    out_features: PositiveInt = 4
    depth: PositiveInt = Field(2, description="Hidden layers. Small enough that a step is dominated by accumulation logic.")


class DataSpec(_Spec):
    kind: Literal["regression"] = "regression"
    noise: float = Field(0.1, ge=0, description="Std of the label noise; > 0 keeps the loss away from 0.")
    num_samples: PositiveInt | None = Field(
        None,
        description="Finite dataset size: global positions walk a seeded permutation per epoch. "
        "None: an endless stream, sample i at position i.",
    )


class OptimizerSpec(_Spec):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (after warmup).")
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW only.")
    eps: float = Field(1e-8, gt=0, description="AdamW only. Makes Adam *almost* scale-invariant.")
    momentum: float = Field(0.0, ge=0, description="SGD only.")


class ScheduleSpec(_Spec):
    name: Literal["constant", "warmup_cosine"] = "warmup_cosine"
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps (never micro-steps).")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of the peak lr.")


class ProblemSpec(_Spec):
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    loss: Literal["mse"] = Field("mse", description="Normalised over the global batch (sample count).")
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    gradient_clipping: float = Field(
        0.0, ge=0, description="Max global grad norm at the boundary; 0 disables. Set explicitly on both trainers."
    )
    steps: PositiveInt = Field(50, description="Optimizer steps (not micro-steps).")
    seed: int = Field(0, ge=0, description="Seeds the model init and every sample (sample = f(seed, index)).")
    dtype: Dtype = Field("fp32", description="Compute dtype when the axes do not list dtypes.")
    train_batch_size: PositiveInt = Field(description="Global batch B: samples per optimizer step, fixed for all cells.")

    @model_validator(mode="after")
    def _check(self) -> ProblemSpec:
        if self.schedule.warmup_steps > self.steps:
            raise ValueError(f"schedule.warmup_steps {self.schedule.warmup_steps} exceeds steps {self.steps}")
        return self


# ---------------------------------------------------------------------------------------------
# The matrix: HOW the global batch is split, and what each cell is expected to show.
# ---------------------------------------------------------------------------------------------


class AxesSpec(_Spec):
    trainer: list[Trainer] = Field(["torch", "deepspeed"], min_length=1)
    world_size: list[PositiveInt] = Field([1], min_length=1)
    micro_batch_size: list[PositiveInt] = Field(min_length=1)
    zero_stage: list[ZeroStage] = Field([0], min_length=1, description="DeepSpeed cells only.")
    dtype: list[Dtype] | None = Field(None, min_length=1, description="Default: [problem.dtype].")


class FaultSpec(_Spec):
    """Fault injection, for tests of the runtime: a rank that fails at a given step."""

    rank: int = Field(0, ge=0)
    step: int = Field(0, ge=0)
    kind: Literal["raise", "exit", "hang"] = "raise"


class CellSpec(_Spec):
    """One explicit cell, e.g. a control with a planted bug."""

    trainer: Trainer
    world_size: PositiveInt = 1
    micro_batch_size: PositiveInt
    zero_stage: ZeroStage | None = None
    dtype: Dtype | None = None
    bug: str | None = Field(None, description=f"A planted bug: one of {sorted(BUGS)}.")
    expect: Expect | None = Field(None, description="Default: 'diverge' with a bug, else 'match'.")
    fault: FaultSpec | None = None


class BaselineSpec(_Spec):
    trainer: Trainer = "torch"
    world_size: PositiveInt = 1
    micro_batch_size: PositiveInt | None = Field(None, description="Default: train_batch_size (GA = 1).")
    zero_stage: ZeroStage | None = None


class ToleranceSpec(_Spec):
    """Overrides of the per-dtype tolerance ladder (gaeq.results.compare.DEFAULT_TOLERANCES)."""

    loss_atol: float | None = Field(None, ge=0)
    loss_rtol: float | None = Field(None, ge=0)
    grad_norm_rtol: float | None = Field(None, ge=0)


class MatrixSpec(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    problem: ProblemSpec
    axes: AxesSpec
    cells: list[CellSpec] = []
    baseline: BaselineSpec = BaselineSpec()
    on_indivisible: Literal["error", "skip"] = Field(
        "error", description="A split where B is not divisible by micro × world: fail validation, or skip the cell."
    )
    tolerances: dict[Dtype, ToleranceSpec] = {}
    timeout_s: float = Field(300.0, gt=0, description="Per cell; a rank silent for longer makes the cell `error`.")


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Fault:
    rank: int
    step: int
    kind: str


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One way of splitting the global batch. Plain data: it crosses process boundaries."""

    trainer: str
    world_size: int
    micro_batch_size: int
    train_batch_size: int
    zero_stage: int | None
    """ZeRO stage for DeepSpeed cells; None for the torch trainer."""
    dtype: str = "fp32"
    bug: str | None = None
    expect: str = "match"
    fault: Fault | None = None
    skip_reason: str | None = field(default=None, compare=False)

    @property
    def divisible(self) -> bool:
        return self.train_batch_size % (self.micro_batch_size * self.world_size) == 0

    @property
    def grad_accum_steps(self) -> int:
        if not self.divisible:
            raise MatrixError(self._indivisible())
        return self.train_batch_size // (self.micro_batch_size * self.world_size)

    @property
    def id(self) -> str:
        parts = [self.trainer]
        if self.zero_stage is not None:
            parts.append(f"z{self.zero_stage}")
        ga = self.grad_accum_steps if self.divisible else "NA"
        parts += [f"w{self.world_size}", f"mb{self.micro_batch_size}", f"ga{ga}"]
        if self.dtype != "fp32":
            parts.append(self.dtype)
        if self.bug:
            parts.append(f"bug_{self.bug}")
        if self.fault:
            parts.append(f"fault_{self.fault.kind}_r{self.fault.rank}_s{self.fault.step}")
        return "-".join(parts)

    def _indivisible(self) -> str:
        return indivisible_message(
            train_batch_size=self.train_batch_size, micro_batch_size=self.micro_batch_size, world_size=self.world_size
        )

    @property
    def group(self) -> str:
        """Cells are judged against the baseline of their dtype group."""
        return self.dtype


def indivisible_message(*, train_batch_size: int, micro_batch_size: int, world_size: int) -> str:
    return (
        f"train_batch_size {train_batch_size} is not divisible by "
        f"micro_batch_size {micro_batch_size} × world_size {world_size}"
    )


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """A validated matrix: the problem and its expanded cells, baselines included."""

    spec: MatrixSpec
    cells: tuple[Cell, ...]
    baselines: dict[str, str]
    """dtype group → id of its baseline cell."""

    @property
    def problem(self) -> ProblemSpec:
        return self.spec.problem

    def runnable(self) -> list[Cell]:
        return [c for c in self.cells if c.skip_reason is None]


def load_matrix(path: str | Path) -> Matrix:
    """Read, validate and expand a matrix file. Raises :class:`MatrixError` with one readable line."""
    path = Path(path)
    if path.is_dir():
        raise MatrixError(f"{path}: is a directory, not a matrix file")
    if not path.is_file():
        raise MatrixError(f"{path}: no such file")
    try:
        raw = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise MatrixError(f"{path}: not valid YAML ({_first_line(exc)})") from None
    if not isinstance(raw, dict):
        raise MatrixError(f"{path}: the top level must be a mapping of keys (name, problem, axes, ...)")
    try:
        spec = MatrixSpec.model_validate(raw)
    except ValidationError as exc:
        raise MatrixError(f"{path}: {_describe(exc)}") from None
    try:
        return expand(spec)
    except MatrixError as exc:
        raise MatrixError(f"{path}: {exc}") from None


def expand(spec: MatrixSpec) -> Matrix:
    """Axes × explicit cells + one baseline per dtype group → cells, in a stable order."""
    problem = spec.problem
    dtypes = spec.axes.dtype or [problem.dtype]
    if spec.axes.dtype and "dtype" in problem.model_fields_set:
        raise MatrixError("set dtype either in problem.dtype or in axes.dtype, not both")

    def make(*, trainer, world_size, micro_batch_size, zero_stage, dtype, bug=None, expect=None, fault=None) -> Cell:
        if trainer == "torch" and zero_stage is not None:
            raise MatrixError(f"zero_stage is a DeepSpeed setting; the torch cell w{world_size} mb{micro_batch_size} sets it")
        if trainer == "deepspeed" and zero_stage is None:
            zero_stage = 0
        if bug is not None:
            if bug not in BUGS:
                raise MatrixError(f"unknown bug {bug!r}; known: {', '.join(sorted(BUGS))}")
            if trainer not in BUGS[bug].trainers:
                raise MatrixError(f"bug {bug!r} exists only in the {'/'.join(BUGS[bug].trainers)} trainer")
        if fault is not None and fault.rank >= world_size:
            raise MatrixError(f"fault.rank {fault.rank} does not exist at world_size {world_size}")
        if fault is not None and fault.step >= problem.steps:
            raise MatrixError(f"fault.step {fault.step} is past the last step ({problem.steps - 1})")
        cell = Cell(
            trainer=trainer,
            world_size=world_size,
            micro_batch_size=micro_batch_size,
            train_batch_size=problem.train_batch_size,
            zero_stage=zero_stage,
            dtype=dtype,
            bug=bug,
            expect=expect or ("diverge" if bug else "match"),
            fault=Fault(**fault.model_dump()) if fault else None,
        )
        if not cell.divisible:
            if spec.on_indivisible == "error":
                raise MatrixError(cell._indivisible() + " (or set on_indivisible: skip)")
            cell = dataclasses.replace(cell, skip_reason=cell._indivisible())
        return cell

    cells: list[Cell] = []
    baselines: dict[str, str] = {}
    for dtype in dtypes:
        b = spec.baseline
        baseline = make(
            trainer=b.trainer,
            world_size=b.world_size,
            micro_batch_size=b.micro_batch_size or problem.train_batch_size,
            zero_stage=b.zero_stage,
            dtype=dtype,
        )
        if baseline.skip_reason:
            raise MatrixError(f"the baseline cannot run: {baseline.skip_reason}")
        baselines[dtype] = baseline.id
        cells.append(baseline)
        for trainer, world, micro in itertools.product(
            spec.axes.trainer, spec.axes.world_size, spec.axes.micro_batch_size
        ):
            stages = spec.axes.zero_stage if trainer == "deepspeed" else [None]
            for stage in stages:
                cells.append(make(trainer=trainer, world_size=world, micro_batch_size=micro, zero_stage=stage, dtype=dtype))

    for c in spec.cells:
        dtype = c.dtype or dtypes[0]
        if dtype not in baselines:
            raise MatrixError(f"cell dtype {dtype} has no baseline: add it to axes.dtype")
        cells.append(
            make(
                trainer=c.trainer,
                world_size=c.world_size,
                micro_batch_size=c.micro_batch_size,
                zero_stage=c.zero_stage,
                dtype=dtype,
                bug=c.bug,
                expect=c.expect,
                fault=c.fault,
            )
        )

    unique: dict[str, Cell] = {}
    for cell in cells:
        if cell.id in unique and unique[cell.id] != cell:
            raise MatrixError(f"two different cells share the id {cell.id}")
        unique.setdefault(cell.id, cell)
    return Matrix(spec=spec, cells=tuple(unique.values()), baselines=baselines)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _describe(exc: ValidationError) -> str:
    """The first pydantic error as one line that names the key: `problem.steps: ...`."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "top level"
    if err["type"] == "extra_forbidden":
        return f"unknown key {where!r} (check its spelling and where it sits)"
    if err["type"] == "missing":
        return f"missing key {where!r}"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {err['msg']}, got {err.get('input')!r}{more}"
