"""The matrix file (``ga.yaml``): one training problem and the ways to split its global batch.

The YAML boundary is pydantic (``extra="forbid"``: a typo is an error, never a silently ignored
knob). The problem specs stay frozen pydantic models inside the lab; a :class:`Cell` is a frozen
dataclass that everyone may import. Gradient accumulation is never chosen, always derived::

    grad_accum_steps = train_batch_size // (micro_batch_size * world_size)
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, ValidationError

from gaeq.bugs import BUGS
from gaeq.problem.spec import Dtype, PositiveInt, ProblemSpec, Samples

WorldSize = Annotated[int, Field(gt=0, le=4096)]
from gaeq.problem.spec import Spec as _Spec

Trainer = Literal["torch", "deepspeed"]
Expect = Literal["match", "diverge"]
ZeroStage = Literal[0, 1, 2, 3]
Offload = Literal["none", "cpu"]
Tracked = Literal["loss", "grad_norm", "params", "grads"]
TENSOR_METRICS = ("grads", "params")
VariantName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_]+$")]
BASE = "base"
"""The variant name of the matrix's own `problem`."""


MATRIX_FILE = "matrix.yaml"
"""The matrix as run, kept in its run directory (what `gaeq report` and `gaeq worker` read)."""


class MatrixError(ValueError):
    """A matrix file a user can fix. The message says what to change."""


# ---------------------------------------------------------------------------------------------
# The matrix: HOW the global batch is split, and what each cell is expected to show.
# ---------------------------------------------------------------------------------------------


class AxesSpec(_Spec):
    trainer: list[Trainer] = Field(["torch", "deepspeed"], min_length=1)
    world_size: list[WorldSize] = Field([1], min_length=1)
    micro_batch_size: list[Samples] = Field(min_length=1)
    zero_stage: list[ZeroStage] = Field([0], min_length=1, description="DeepSpeed cells only.")
    offload: list[Offload] = Field(
        ["none"], min_length=1, description="DeepSpeed cells only: ZeRO-Offload of the optimizer (and of parameters at ZeRO-3)."
    )
    dtype: list[Dtype] | None = Field(None, min_length=1, description="Default: [problem.dtype].")
    variant: list[VariantName] = Field([BASE], min_length=1, description="Problem variants the axes apply to.")


class FaultSpec(_Spec):
    """Fault injection, for tests of the runtime: a rank that fails at a given step."""

    rank: int = Field(0, ge=0)
    step: int = Field(0, ge=0)
    kind: Literal["raise", "exit", "hang"] = "raise"


class CellSpec(_Spec):
    """One explicit cell, e.g. a control with a planted bug."""

    trainer: Trainer
    world_size: WorldSize = 1
    micro_batch_size: Samples
    zero_stage: ZeroStage | None = None
    offload: Offload = "none"
    dtype: Dtype | None = None
    variant: VariantName = BASE
    bug: str | None = Field(None, description=f"A planted bug: one of {sorted(BUGS)}.")
    expect: Expect | None = Field(None, description="Default: 'diverge' with a bug, else 'match'.")
    fault: FaultSpec | None = None


class BaselineSpec(_Spec):
    trainer: Trainer = "torch"
    world_size: WorldSize = 1
    micro_batch_size: Samples | None = Field(None, description="Default: train_batch_size (GA = 1).")
    zero_stage: ZeroStage | None = None


class ResumeTargetSpec(_Spec):
    """Where a checkpoint is resumed: the source's trainer, dtype and variant, another split."""

    world_size: WorldSize = 1
    micro_batch_size: Samples
    zero_stage: ZeroStage | None = None
    offload: Offload = "none"
    drop: list[Literal["optimizer", "schedule"]] = Field(
        [], description="Negative controls: resume without the optimizer state, or with the LR schedule restarted."
    )
    expect: Expect | None = Field(None, description="Default: 'diverge' when something is dropped, else 'match'.")


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
    resume: list[ResumeSpec] = Field([], description="Checkpoint → resume experiments; resumed cells are compared from their resume step on.")
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
    timeout_s: float = Field(300.0, gt=0, le=86400, description="Per cell; a rank silent for longer makes the cell `error`.")


# ---------------------------------------------------------------------------------------------
# Cells
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Fault:
    rank: int
    step: int
    kind: str


@dataclass(frozen=True, kw_only=True)
class Resume:
    source: str
    """Id of the cell whose checkpoint is resumed."""
    step: int
    """Optimizer steps the checkpoint holds; the resumed cell trains steps `step`..end."""
    universal: bool
    drop: tuple[str, ...] = ()


def group_key(*, dtype: str, variant: str) -> str:
    """Cells are judged against the baseline of their group: same problem variant, same dtype."""
    return dtype if variant == BASE else f"{dtype}@{variant}"


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One way of splitting the global batch. Plain data: it crosses process boundaries."""

    trainer: str
    world_size: int
    micro_batch_size: int
    train_batch_size: int
    zero_stage: int | None
    """ZeRO stage for DeepSpeed cells; None for the torch trainer."""
    offload: str = "none"
    dtype: str = "fp32"
    variant: str = BASE
    bug: str | None = None
    expect: str = "match"
    fault: Fault | None = None
    snapshots: tuple[str, ...] = ()
    """Tensors saved at boundaries ("grads", "params"): what the matrix tracks beyond the trace."""
    snapshot_every: int = 1
    save_at: tuple[int, ...] = ()
    """Checkpoint after these many optimizer steps (for resume experiments)."""
    resume: Resume | None = None
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
        if self.offload != "none":
            parts.append(f"{self.offload}off")
        ga = self.grad_accum_steps if self.divisible else "NA"
        parts += [f"w{self.world_size}", f"mb{self.micro_batch_size}", f"ga{ga}"]
        if self.dtype != "fp32":
            parts.append(self.dtype)
        if self.bug:
            parts.append(f"bug_{self.bug}")
        if self.fault:
            parts.append(f"fault_{self.fault.kind}_r{self.fault.rank}_s{self.fault.step}")
        if self.resume:
            parts.append(f"from_s{self.resume.step}_{'universal' if self.resume.universal else 'plain'}")
            parts += [f"drop_{d}" for d in self.resume.drop]
        suffix = "" if self.variant == BASE else f"@{self.variant}"
        return "-".join(parts) + suffix

    @property
    def group(self) -> str:
        return group_key(dtype=self.dtype, variant=self.variant)

    @property
    def first_step(self) -> int:
        """The first optimizer step this cell trains (and is compared on)."""
        return self.resume.step if self.resume else 0

    def _indivisible(self) -> str:
        return indivisible_message(
            train_batch_size=self.train_batch_size, micro_batch_size=self.micro_batch_size, world_size=self.world_size
        )


def indivisible_message(*, train_batch_size: int, micro_batch_size: int, world_size: int) -> str:
    return (
        f"train_batch_size {train_batch_size} is not divisible by "
        f"micro_batch_size {micro_batch_size} × world_size {world_size}"
    )


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """A validated matrix: its problems (one per variant) and expanded cells, baselines included."""

    spec: MatrixSpec
    problems: dict[str, ProblemSpec]
    """variant name → problem ('base' is the matrix's own)."""
    cells: tuple[Cell, ...]
    baselines: dict[str, str]
    """group (dtype[@variant]) → id of its baseline cell."""
    plugin_dirs: tuple[str, ...] = ()
    """Folders searched for plugin modules: the matrix file's folder and the working directory."""
    source: dict = field(default_factory=dict, compare=False, repr=False)
    """The mapping it was validated from (kept with a run, to judge it again later)."""

    @property
    def problem(self) -> ProblemSpec:
        return self.problems[BASE]

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
    except OSError as exc:
        raise MatrixError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return matrix_from_dict(raw, plugin_dirs=(str(path.resolve().parent), str(Path.cwd())))
    except MatrixError as exc:
        raise MatrixError(f"{path}: {exc}") from None


def matrix_from_dict(raw: object, *, plugin_dirs: tuple[str, ...] | None = None) -> Matrix:
    """Validate and expand a matrix given as data (what a YAML file parses to). Plugins are
    imported from `plugin_dirs` (default: the working directory)."""
    if not isinstance(raw, dict):
        raise MatrixError("the top level must be a mapping of keys (name, problem, axes, ...)")
    try:
        spec = MatrixSpec.model_validate(raw)
        matrix = expand(spec, plugin_dirs=plugin_dirs if plugin_dirs is not None else (str(Path.cwd()),))
        return dataclasses.replace(matrix, source=copy.deepcopy(raw))
    except ValidationError as exc:
        raise MatrixError(_describe(exc)) from None


def _variant_problems(spec: MatrixSpec) -> dict[str, ProblemSpec]:
    problems = {BASE: spec.problem}
    base = spec.problem.model_dump(by_alias=True, exclude_unset=True)
    for name, variant in spec.variants.items():
        if name == BASE:
            raise MatrixError(f"variant name {BASE!r} is reserved for the matrix's own problem")
        try:
            problems[name] = ProblemSpec.model_validate(_deep_merge(base, variant.problem))
        except ValidationError as exc:
            raise MatrixError(f"variants.{name}.problem: {_describe(exc)}") from None
    return problems


def _deep_merge(base: dict, override: dict) -> dict:
    """`override` onto `base`, mapping by mapping — except where a mapping names another built-in
    (`kind`) or another plugin (`import`): that one starts afresh, its old keys (`args`) belong to
    something else."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and _same_thing(merged[key], value):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _same_thing(base: dict, override: dict) -> bool:
    return all(override.get(k, base.get(k)) == base.get(k) for k in ("kind", "import", "import_"))


def expand(spec: MatrixSpec, *, plugin_dirs: tuple[str, ...] = ()) -> Matrix:
    """Baselines + axes × variants + explicit cells → cells, in a stable order."""
    problems = _variant_problems(spec)
    if spec.axes is None and not spec.cells and not spec.resume:
        raise MatrixError("no cells: give axes, cells or resume (or several)")
    if spec.axes and spec.axes.dtype and "dtype" in spec.problem.model_fields_set:
        raise MatrixError("set dtype either in problem.dtype or in axes.dtype, not both")

    snapshots = tuple(m for m in TENSOR_METRICS if m in spec.track)

    def make(
        *, trainer, world_size, micro_batch_size, zero_stage, dtype, variant, offload="none", bug=None, expect=None, fault=None
    ) -> Cell:
        if variant not in problems:
            raise MatrixError(f"unknown variant {variant!r}; known: {', '.join(problems)}")
        problem = problems[variant]
        if trainer == "torch" and zero_stage is not None:
            raise MatrixError(f"zero_stage is a DeepSpeed setting; the torch cell w{world_size} mb{micro_batch_size} sets it")
        if trainer == "deepspeed" and zero_stage is None:
            zero_stage = 0
        if trainer == "torch" and offload != "none":
            raise MatrixError(f"offload is a DeepSpeed setting; the torch cell w{world_size} mb{micro_batch_size} sets it")
        if dtype == "ds_bf16" and not (trainer == "deepspeed" and zero_stage >= 1):
            raise MatrixError(
                "dtype ds_bf16 is DeepSpeed's bf16 mixed precision: DeepSpeed cells at ZeRO ≥ 1 only "
                "(at ZeRO-0 DeepSpeed 0.19 cannot accumulate bf16 gradients in fp32)"
            )
        if dtype == "ds_fp16" and trainer != "deepspeed":
            raise MatrixError("dtype ds_fp16 is DeepSpeed's fp16 mixed precision: DeepSpeed cells only (torch: fp16)")
        if bug is not None:
            if bug not in BUGS:
                raise MatrixError(f"unknown bug {bug!r}; known: {', '.join(sorted(BUGS))}")
            if trainer not in BUGS[bug].trainers:
                raise MatrixError(f"bug {bug!r} exists only in the {'/'.join(BUGS[bug].trainers)} trainer")
            if BUGS[bug].dtypes and dtype not in BUGS[bug].dtypes:
                raise MatrixError(f"bug {bug!r} exists only in {'/'.join(BUGS[bug].dtypes)} cells, not {dtype}")
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
            offload=offload,
            dtype=dtype,
            variant=variant,
            bug=bug,
            expect=expect or ("diverge" if bug else "match"),
            fault=Fault(**fault.model_dump()) if fault else None,
            snapshots=snapshots,
            snapshot_every=spec.track_every,
        )
        if offload != "none" and zero_stage == 0:
            cell = dataclasses.replace(cell, skip_reason="offload needs ZeRO ≥ 1 (ZeRO-0 has no partitioned optimizer to offload)")
        elif dtype in ("fp16", "ds_fp16") and (reason := _fp16_unsupported()):
            cell = dataclasses.replace(cell, skip_reason=reason)
        if not cell.divisible:
            if spec.on_indivisible == "error":
                raise MatrixError(cell._indivisible() + " (or set on_indivisible: skip)")
            cell = dataclasses.replace(cell, skip_reason=cell._indivisible())
        return cell

    cells: list[Cell] = []
    baselines: dict[str, str] = {}

    def ensure_baseline(*, dtype: str, variant: str) -> None:
        if variant not in problems:
            raise MatrixError(f"unknown variant {variant!r}; known: {', '.join(problems)}")
        key = group_key(dtype=dtype, variant=variant)
        if key in baselines:
            return
        b = (spec.variants[variant].baseline if variant in spec.variants else None) or spec.baseline
        baseline = make(
            trainer=b.trainer,
            world_size=b.world_size,
            micro_batch_size=b.micro_batch_size or problems[variant].train_batch_size,
            zero_stage=b.zero_stage,
            dtype=dtype,
            variant=variant,
        )
        if not baseline.divisible:  # (a baseline skipped for want of fp16 skips its group with it)
            raise MatrixError(f"the baseline of {key} cannot run: {baseline.skip_reason}")
        baselines[key] = baseline.id
        cells.append(baseline)

    axes = spec.axes

    def dtypes_of(variant: str) -> list[str]:
        if variant not in problems:
            raise MatrixError(f"unknown variant {variant!r}; known: {', '.join(problems)}")
        return list(axes.dtype) if axes and axes.dtype else [problems[variant].dtype]

    if axes is not None:
        for variant in axes.variant:
            for dtype in dtypes_of(variant):
                ensure_baseline(dtype=dtype, variant=variant)
                for trainer, world, micro in itertools.product(axes.trainer, axes.world_size, axes.micro_batch_size):
                    ds = trainer == "deepspeed"
                    for stage, offload in itertools.product(axes.zero_stage if ds else [None], axes.offload if ds else ["none"]):
                        cells.append(
                            make(
                                trainer=trainer,
                                world_size=world,
                                micro_batch_size=micro,
                                zero_stage=stage,
                                offload=offload,
                                dtype=dtype,
                                variant=variant,
                            )
                        )

    for c in spec.cells:
        dtype = c.dtype or dtypes_of(c.variant)[0]
        ensure_baseline(dtype=dtype, variant=c.variant)
        cells.append(
            make(
                trainer=c.trainer,
                world_size=c.world_size,
                micro_batch_size=c.micro_batch_size,
                zero_stage=c.zero_stage,
                offload=c.offload,
                dtype=dtype,
                variant=c.variant,
                bug=c.bug,
                expect=c.expect,
                fault=c.fault,
            )
        )

    for r in spec.resume:
        _add_resume(r, cells=cells, make=make, ensure_baseline=ensure_baseline, dtypes_of=dtypes_of, problems=problems)

    unique: dict[str, Cell] = {}
    for cell in cells:
        if cell.id in unique and unique[cell.id] != cell:
            raise MatrixError(f"two different cells share the id {cell.id}")
        unique.setdefault(cell.id, cell)
    return Matrix(spec=spec, problems=problems, cells=tuple(unique.values()), baselines=baselines, plugin_dirs=plugin_dirs)


def _add_resume(r: ResumeSpec, *, cells: list[Cell], make, ensure_baseline, dtypes_of, problems) -> None:
    """The source cell (found or added, marked to checkpoint at `at_step`) and its resumed targets."""
    src = r.from_
    if src.bug or src.fault:
        raise MatrixError("a resume source is a plain cell: no bug, no fault")
    dtype = src.dtype or dtypes_of(src.variant)[0]
    steps = problems[src.variant].steps
    if not 0 < r.at_step < steps:
        raise MatrixError(f"resume at_step {r.at_step} must lie between 1 and steps - 1 = {steps - 1}")
    ensure_baseline(dtype=dtype, variant=src.variant)
    source = make(
        trainer=src.trainer,
        world_size=src.world_size,
        micro_batch_size=src.micro_batch_size,
        zero_stage=src.zero_stage,
        offload=src.offload,
        dtype=dtype,
        variant=src.variant,
    )
    if source.skip_reason:
        raise MatrixError(f"the resume source {source.id} cannot run: {source.skip_reason}")
    if r.universal and (source.trainer != "deepspeed" or source.zero_stage == 0):
        raise MatrixError(
            f"universal checkpoints are DeepSpeed ZeRO ≥ 1 checkpoints; source {source.id} cannot write one "
            "(use universal: false: a torch cell resumes its own state dicts at any world size)"
        )
    same = [i for i, c in enumerate(cells) if c.id == source.id]
    if same:
        source = cells[same[0]]
    else:
        cells.append(source)
    marked = dataclasses.replace(source, save_at=tuple(sorted({*source.save_at, r.at_step})))
    cells[same[0] if same else -1] = marked
    for t in r.to:
        target = make(
            trainer=source.trainer,
            world_size=t.world_size,
            micro_batch_size=t.micro_batch_size,
            zero_stage=t.zero_stage,
            offload=t.offload,
            dtype=dtype,
            variant=src.variant,
            expect=t.expect or ("diverge" if t.drop else "match"),
        )
        if r.universal and target.zero_stage == 0:
            raise MatrixError(f"a universal checkpoint loads into ZeRO ≥ 1; target {target.id} is ZeRO-0")
        if r.universal and target.zero_stage == 3 and source.zero_stage != 3:
            raise MatrixError(
                f"DeepSpeed 0.19 loads a universal checkpoint into ZeRO-3 only when it was saved at ZeRO-3 "
                f"(source {source.id} is ZeRO-{source.zero_stage}: the ZeRO-3 loader finds no model-state files)"
            )
        if r.universal and "optimizer" in t.drop:
            raise MatrixError("DeepSpeed always loads the optimizer state of a universal checkpoint: drop it only with universal: false")
        if not r.universal and source.trainer == "deepspeed" and (
            target.world_size, target.zero_stage) != (source.world_size, source.zero_stage):
            raise MatrixError(
                f"a plain DeepSpeed checkpoint resumes at the same world size and ZeRO stage "
                f"(source w{source.world_size} z{source.zero_stage}); use universal: true to change them"
            )
        cells.append(
            dataclasses.replace(
                target, resume=Resume(source=source.id, step=r.at_step, universal=r.universal, drop=tuple(t.drop))
            )
        )


def _fp16_unsupported() -> str | None:
    from gaeq.accelerator import fp16_unsupported_reason  # imports torch/DeepSpeed: only for fp16 cells

    return fp16_unsupported_reason()


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
    got = repr(err.get("input"))
    got = got if len(got) <= 80 else got[:77] + "..."
    return f"{where}: {err['msg']}, got {got}{more}"
