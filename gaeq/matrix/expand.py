"""Axes × variants + explicit cells + resume experiments → cells, baselines included, in a stable
order. One :class:`Expander` owns what is being built (cells, baselines, problems); every source of
cells (the axes product, explicit cells, baselines, resume sources and targets) hands it a
:class:`Split`, and :meth:`Expander.cell` is the one place a split is checked and becomes a cell.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools

from pydantic import ValidationError

from gaeq.bugs import BUGS
from gaeq.matrix.cell import DEEPSPEED_ONLY, SPLIT_AXES, Cell, Fault, Matrix, Role, Split, group_key
from gaeq.matrix.schema import BASE, TENSOR_METRICS, FaultSpec, MatrixError, MatrixSpec, describe
from gaeq.problem.spec import ProblemSpec
from gaeq.registry import DEEPSPEED_TRAINERS, INSTALL_HF, TENSOR_PARALLEL_TRAINERS, TRAINERS, dtypes_said


class Expander:
    def __init__(self, spec: MatrixSpec) -> None:
        self.spec = spec
        self.problems = _variant_problems(spec)
        self.cells: list[Cell] = []
        self.baselines: dict[str, str] = {}
        """group (dtype[@variant]) → id of its baseline cell."""
        self.floors: dict[str, str] = {}
        """group → id of the cell that measures its noise floor (its twin, or a cell that is that computation)."""

    def problem(self, variant: str) -> ProblemSpec:
        if variant not in self.problems:
            raise MatrixError(f"unknown variant {variant!r}; known: {', '.join(self.problems)}")
        return self.problems[variant]

    def dtypes_of(self, variant: str) -> list[str]:
        """The dtypes a variant's cells run in: axes.dtype, else the variant's problem.dtype."""
        problem = self.problem(variant)
        axes = self.spec.axes
        return list(axes.dtype) if axes and axes.dtype else [problem.dtype]

    def split_of(self, spec, **given) -> Split:
        """A Split from any spec with split fields (CellSpec, BaselineSpec, ResumeTargetSpec);
        `given` overrides them; a missing dtype is the variant's."""
        fields = {a: getattr(spec, a) for a in SPLIT_AXES if hasattr(spec, a)} | given
        fields = {k: v for k, v in fields.items() if v is not None or k == "zero_stage"}
        variant = fields.get("variant", BASE)
        fields.setdefault("dtype", self.dtypes_of(variant)[0])
        mirror = self.problem(variant).mirror
        if mirror is not None and fields.get("trainer") == "deepspeed":  # the file's stage and offload, unless given
            if fields.get("zero_stage") is None:
                fields["zero_stage"] = mirror.zero_stage
            if "offload" not in getattr(spec, "model_fields_set", ()) and "offload" not in given:
                fields["offload"] = mirror.offload
        return Split(**fields)

    def add_axes(self) -> None:
        """The cartesian product of the axes, per variant and dtype, each group after its baseline.
        Axes only DeepSpeed has collapse to one value for torch cells."""
        axes = self.spec.axes
        for variant in axes.variant:
            for dtype in self.dtypes_of(variant):
                self.ensure_baseline(dtype=dtype, variant=variant)
                names = [a for a in SPLIT_AXES if a not in ("dtype", "variant")]
                product = [self.axis_values(a, variant) for a in names]
                splits = {}
                for values in itertools.product(*product):
                    split = dict(zip(names, values), dtype=dtype, variant=variant)
                    if split["trainer"] not in DEEPSPEED_TRAINERS:
                        split |= DEEPSPEED_ONLY
                    if split["trainer"] not in TENSOR_PARALLEL_TRAINERS:
                        split["tensor_parallel"] = 1
                    if split["world_size"] % split["tensor_parallel"]:
                        continue  # no such split: tensor-parallel groups of that size do not fit the world
                    splits.setdefault(tuple(split.items()), split)  # torch: one cell, not one per ZeRO stage
                for split in splits.values():
                    self.add(Split(**split))

    def axis_values(self, axis: str, variant: str) -> list:
        """An axis's values. With a deepspeed_config, zero_stage and offload not written as axes
        are the file's own."""
        given = getattr(self.spec.axes, axis)
        mirror = self.problem(variant).mirror
        if mirror is None or axis not in ("zero_stage", "offload") or axis in self.spec.axes.model_fields_set:
            return given
        return [getattr(mirror, axis)]

    def ensure_baseline(self, *, dtype: str, variant: str) -> None:
        """The group's baseline (the matrix's, or its variant's), added once, before its cells."""
        self.problem(variant)  # an unknown variant is named here
        key = group_key(dtype=dtype, variant=variant)
        if key in self.baselines:
            return
        b = (self.spec.variants[variant].baseline if variant in self.spec.variants else None) or self.spec.baseline
        micro = b.micro_batch_size or self.problems[variant].train_batch_size
        baseline = dataclasses.replace(
            self.cell(self.split_of(b, micro_batch_size=micro, dtype=dtype, variant=variant)), role=Role.BASELINE
        )
        if not baseline.divisible:  # (a baseline skipped for want of fp16 skips its group with it)
            raise MatrixError(f"the baseline of {key} cannot run: {baseline.skip_reason}")
        self.baselines[key] = baseline.id
        self.cells.append(baseline)

    def add_floor_twins(self) -> None:
        """After every cell: what measures each group's noise floor. A cell of the group that already
        is the twin's computation (the baseline's split but for the micro-batch, no bug, no fault)
        measures it; otherwise the twin (`Role.FLOOR`) is added right after the baseline."""
        for key, base_id in self.baselines.items():
            baseline = next(c for c in self.cells if c.id == base_id)
            group = [c for c in self.cells if c.group == key and c.role == Role.CELL and c.skip_reason is None]
            twin = self.floor_twin(baseline, micro_batches=sorted({c.micro_batch_size for c in group}))
            if twin is None:
                continue
            same = [c for c in group if c == twin]  # a cell's role is not part of what it is
            if same:
                self.floors[key] = same[0].id
            else:
                self.floors[key] = twin.id
                self.cells.insert(self.cells.index(baseline) + 1, twin)

    def floor_twin(self, baseline: Cell, *, micro_batches: list[int]) -> Cell | None:
        """The baseline's split with micro-batches as small as the smallest of its group's cells
        (which sets how the gradient's sums round: a twin at half the batch may round like the
        baseline itself), else cut by the batch's smallest factor. The same optimisation, summed
        in another order. None when the baseline's micro-batch is a single sample."""
        micro = baseline.micro_batch_size
        rows = baseline.train_batch_size // baseline.data_parallel
        fits = [m for m in micro_batches if m < micro and rows % m == 0]
        smaller = fits[0] if fits else next((micro // f for f in range(2, micro + 1) if micro % f == 0), None)
        if smaller is None:
            return None
        split = Split(**{a: getattr(baseline, a) for a in SPLIT_AXES} | {"micro_batch_size": smaller})
        return dataclasses.replace(self.cell(split), role=Role.FLOOR)

    def add(self, split: Split, **planted) -> Cell:
        """Check `split` (and what is planted in it), append its cell after its group's baseline."""
        self.ensure_baseline(dtype=split.dtype, variant=split.variant)
        cell = self.cell(split, **planted)
        self.cells.append(cell)
        return cell

    def cell(
        self, split: Split, *, bug: str | None = None, expect: str | None = None, fault: FaultSpec | None = None
    ) -> Cell:
        """The one place a split is checked and becomes a cell (or a skipped cell, with the reason)."""
        problem = self.problem(split.variant)
        trainer, world, micro, dtype = split.trainer, split.world_size, split.micro_batch_size, split.dtype
        if trainer not in DEEPSPEED_TRAINERS and split.zero_stage is not None:
            raise MatrixError(f"zero_stage is a DeepSpeed setting; the {trainer} cell w{world} mb{micro} sets it")
        if trainer in DEEPSPEED_TRAINERS and split.zero_stage is None:
            split = dataclasses.replace(split, zero_stage=0)
        if trainer not in DEEPSPEED_TRAINERS and split.offload != "none":
            raise MatrixError(f"offload is a DeepSpeed setting; the {trainer} cell w{world} mb{micro} sets it")
        if split.tensor_parallel > 1:
            _check_tensor_parallel(split, problem)
        if dtype == "ds_bf16" and not (trainer == "deepspeed" and split.zero_stage >= 1):
            raise MatrixError(
                "dtype ds_bf16 is DeepSpeed's bf16 mixed precision: DeepSpeed cells at ZeRO ≥ 1 only "
                "(at ZeRO-0 DeepSpeed 0.19 cannot accumulate bf16 gradients in fp32)"
            )
        if (package := TRAINERS[trainer].package) and importlib.util.find_spec(package) is None:
            raise MatrixError(f"trainer {trainer} needs {package}: {INSTALL_HF}")
        if split.offload == "nvme" and problem.deepspeed_config is not None:
            raise MatrixError(
                "nvme offload runs gaeq's own DeepSpeed config (with its swap folder and aio section), not a "
                "deepspeed_config"
            )
        if trainer == "hf_deepspeed" and (dtype != "fp32" or split.offload != "none"):
            raise MatrixError(
                "the hf_deepspeed trainer runs fp32 without offload (the Trainer's DeepSpeed config: ZeRO stage only)"
            )
        if trainer == "hf_deepspeed" and split.zero_stage == 0:
            raise MatrixError(
                "the hf_deepspeed trainer needs ZeRO ≥ 1: at ZeRO-0 DeepSpeed's engine reports no global grad norm, "
                "so the Trainer logs none and the cell could not be compared"
            )
        if trainer in ("hf", "hf_deepspeed"):
            _check_hf_trainer(problem, self.spec)
        if dtype == "ds_fp16" and trainer != "deepspeed":
            raise MatrixError("dtype ds_fp16 is DeepSpeed's fp16 mixed precision: DeepSpeed cells only (torch: fp16)")
        if dtype not in TRAINERS[trainer].dtypes:
            raise MatrixError(f"the {trainer} trainer runs {dtypes_said(TRAINERS[trainer].dtypes)}, not {dtype}")
        if problem.mirror is not None and trainer == "deepspeed":
            _check_precision(problem.mirror.precision, dtype)
        if bug is not None:
            if bug not in BUGS:
                raise MatrixError(f"unknown bug {bug!r}; known: {', '.join(sorted(BUGS))}")
            if trainer not in BUGS[bug].trainers:
                raise MatrixError(f"bug {bug!r} exists only in the {'/'.join(BUGS[bug].trainers)} trainer")
            if BUGS[bug].needs_deepspeed_config and problem.deepspeed_config is None:
                raise MatrixError(f"bug {bug!r} exists only in a problem with a deepspeed_config")
            if world < BUGS[bug].min_world_size:
                raise MatrixError(f"bug {bug!r} needs world_size ≥ {BUGS[bug].min_world_size}, the cell has {world}")
            if split.tensor_parallel < BUGS[bug].min_tensor_parallel:
                raise MatrixError(
                    f"bug {bug!r} needs tensor_parallel ≥ {BUGS[bug].min_tensor_parallel}, the cell has "
                    f"{split.tensor_parallel}"
                )
            if BUGS[bug].loss is not None and problem.loss != BUGS[bug].loss:
                raise MatrixError(f"bug {bug!r} exists only with loss {BUGS[bug].loss}, not {problem.loss!r}")
            if BUGS[bug].dtypes and dtype not in BUGS[bug].dtypes:
                raise MatrixError(f"bug {bug!r} exists only in {'/'.join(BUGS[bug].dtypes)} cells, not {dtype}")
        if fault is not None and fault.rank >= world:
            raise MatrixError(f"fault.rank {fault.rank} does not exist at world_size {world}")
        if fault is not None and fault.step >= problem.steps:
            raise MatrixError(f"fault.step {fault.step} is past the last step ({problem.steps - 1})")
        cell = Cell(
            **{a: getattr(split, a) for a in SPLIT_AXES},
            train_batch_size=problem.train_batch_size,
            bug=bug,
            expect=expect or ("diverge" if bug else "match"),
            fault=Fault(**fault.model_dump()) if fault else None,
            snapshots=tuple(m for m in TENSOR_METRICS if m in self.spec.track),
            snapshot_every=self.spec.track_every,
            keep_nvme_swap=self.spec.keep_nvme_swap and split.offload == "nvme",
        )
        if split.offload != "none" and split.zero_stage == 0:
            cell = dataclasses.replace(
                cell, skip_reason="offload needs ZeRO ≥ 1 (ZeRO-0 has no partitioned optimizer to offload)"
            )
        elif split.offload == "nvme" and split.zero_stage < 3:
            cell = dataclasses.replace(cell, skip_reason=NVME_NEEDS_ZERO3)
        elif split.offload == "nvme" and (reason := _nvme_unsupported()):
            cell = dataclasses.replace(cell, skip_reason=reason)
        elif dtype in ("fp16", "ds_fp16") and (reason := _fp16_unsupported()):
            cell = dataclasses.replace(cell, skip_reason=reason)
        if not cell.divisible:
            if self.spec.on_indivisible == "error":
                raise MatrixError(cell._indivisible() + " (or set on_indivisible: skip)")
            cell = dataclasses.replace(cell, skip_reason=cell._indivisible())
        return cell

    def matrix(self, *, plugin_dirs: tuple[str, ...]) -> Matrix:
        unique: dict[str, Cell] = {}
        for cell in self.cells:
            if cell.id in unique and unique[cell.id] != cell:
                raise MatrixError(f"two different cells share the id {cell.id}")
            unique.setdefault(cell.id, cell)
        return Matrix(
            spec=self.spec,
            problems=self.problems,
            cells=tuple(unique.values()),
            baselines=self.baselines,
            floors=self.floors,
            plugin_dirs=plugin_dirs,
        )


def _variant_problems(spec: MatrixSpec) -> dict[str, ProblemSpec]:
    problems = {BASE: spec.problem}
    base = spec.problem.model_dump(by_alias=True, exclude_unset=True)
    for name, variant in spec.variants.items():
        if name == BASE:
            raise MatrixError(f"variant name {BASE!r} is reserved for the matrix's own problem")
        try:
            problems[name] = ProblemSpec.model_validate(_deep_merge(base, variant.problem))
        except ValidationError as exc:
            raise MatrixError(f"variants.{name}.problem: {describe(exc)}") from None
    return problems


def _deep_merge(base: dict, override: dict) -> dict:
    """`override` onto `base`, mapping by mapping — except where a mapping names another built-in
    (`kind`), another plugin (`import`) or another transformers class (`hf`): that one starts afresh,
    its old keys (`args`) belong to something else."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and _same_thing(merged[key], value):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _same_thing(base: dict, override: dict) -> bool:
    return all(override.get(k, base.get(k)) == base.get(k) for k in ("kind", "import", "import_", "hf"))


def _check_precision(precision: str, dtype: str) -> None:
    """A DeepSpeed cell of a deepspeed_config problem is labelled with the file's precision."""
    if precision == "fp32" and dtype in ("ds_bf16", "ds_fp16"):
        section = "bf16" if dtype == "ds_bf16" else "fp16"
        raise MatrixError(f"dtype {dtype} is DeepSpeed's {section} section, which deepspeed_config does not enable")
    if precision != "fp32" and dtype != precision:
        section = "bf16" if precision == "ds_bf16" else "fp16"
        raise MatrixError(
            f"deepspeed_config enables {section} ({section}.enabled: true): its DeepSpeed cells are {precision}, "
            f"not {dtype} — set dtype: {precision} (with a DeepSpeed baseline)"
        )


def _check_tensor_parallel(split: Split, problem: ProblemSpec) -> None:
    """A tensor-parallel split that can run exactly as labelled — else bad input, naming the numbers."""
    from gaeq.problem.tp import plan_problem

    where = f"the {split.trainer} cell w{split.world_size} tp{split.tensor_parallel} mb{split.micro_batch_size}"
    if split.trainer not in TENSOR_PARALLEL_TRAINERS:
        raise MatrixError(
            f"tensor_parallel runs in the {', '.join(sorted(TENSOR_PARALLEL_TRAINERS))} trainers, not "
            f"{split.trainer} ({where})"
        )
    if split.world_size % split.tensor_parallel:
        raise MatrixError(
            f"world_size {split.world_size} is not divisible by tensor_parallel {split.tensor_parallel} ({where})"
        )
    if split.dtype not in ("fp32", "bf16"):
        raise MatrixError(
            f"tensor-parallel cells run fp32 and bf16 (autocast over fp32 weights), not {split.dtype} ({where})"
        )
    if split.trainer == "deepspeed" and (problem.deepspeed_config is not None or split.offload != "none"):
        raise MatrixError(f"DeepSpeed AutoTP cells run gaeq's own DeepSpeed config, without offload ({where})")
    if why := plan_problem(problem, split.tensor_parallel):
        raise MatrixError(f"tensor_parallel {split.tensor_parallel}: {why}")


def _check_hf_trainer(problem: ProblemSpec, spec: MatrixSpec) -> None:
    """What the transformers Trainer can be set to from the problem, exactly — else bad input, why."""
    why = None
    if getattr(problem.data, "kind", None) != "tokens":
        why = "it counts num_items_in_batch as the labels that are not -100: token data only"
    elif problem.deepspeed_config is not None:
        why = "a deepspeed_config goes to the Trainer through TrainingArguments(deepspeed=...), not offered yet"
    elif problem.optimizer.name != "adamw":
        why = f"its optimizer is AdamW (optim=adamw_torch), the problem's is {problem.optimizer.name}"
    elif problem.schedule.warmup_steps:
        why = (
            "transformers' linear warmup starts at lr 0 at step 0, gaeq's at lr / warmup_steps: "
            "no lr_scheduler_type gives this schedule (use warmup_steps: 0)"
        )
    elif "grads" in spec.track:
        why = "the Trainer clips before a callback sees the gradients: track params, not grads"
    if why:
        raise MatrixError(f"trainer hf / hf_deepspeed: {why}")


NVME_NEEDS_ZERO3 = (
    "nvme offload needs ZeRO-3: DeepSpeed 0.19's ZeRO-1/2 optimizer takes device nvme for cpu "
    "(the state stays in memory, no file is written)"
)


def _nvme_unsupported() -> str | None:
    from gaeq.accelerator import nvme_unsupported_reason  # imports DeepSpeed: only for nvme cells

    return nvme_unsupported_reason()


def _fp16_unsupported() -> str | None:
    from gaeq.accelerator import fp16_unsupported_reason  # imports torch/DeepSpeed: only for fp16 cells

    return fp16_unsupported_reason()
