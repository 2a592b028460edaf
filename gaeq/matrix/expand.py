"""Axes × variants + explicit cells + resume experiments → cells, baselines included, in a stable
order. One :class:`Expander` owns what is being built (cells, baselines, problems); every source of
cells (the axes product, explicit cells, baselines, resume sources and targets) hands it a
:class:`Split`, and :meth:`Expander.cell` is the one place a split is checked and becomes a cell.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

from pydantic import ValidationError

from gaeq.bug_catalogue import BUGS
from gaeq.matrix.cell import (
    DEEPSPEED_ONLY,
    SPLIT_AXES,
    Cell,
    Expectation,
    Fault,
    Matrix,
    Perturbation,
    Reference,
    Resume,
    Role,
    Split,
    group_key,
)
from gaeq.matrix.resume import at_step_inside, epochs_run_on, plain_source, source_rules, target_rules
from gaeq.matrix.rules import (
    bug_rules,
    expect_rules,
    fault_rules,
    script_rules,
    skip_reason,
    split_rules,
)
from gaeq.matrix.schema import (
    BASE,
    TENSOR_METRICS,
    ExpectSpec,
    FaultSpec,
    MatrixError,
    MatrixSpec,
    ResumeSpec,
    baseline_spec,
    describe,
)
from gaeq.problem.spec import ProblemSpec
from gaeq.registry import (
    COMPILING_TRAINERS,
    DEEPSPEED_TRAINERS,
    PIPELINE_TRAINERS,
    SEQUENCE_PARALLEL_TRAINERS,
    TENSOR_PARALLEL_TRAINERS,
    TRAINERS,
)

SENSITIVITY_WEIGHT = 1e-2
"""The error the detection limit is measured with: each batch's rows reweighed 1 ± this (the step's even
rows' gradient × (1 + this), its odd rows' × (1 − this), the total weight unchanged: perturb.row_weights) — large
enough that its effect stands far above rounding at every size of the scale ladder, small enough that the
effect is still proportional to it (docs/verdicts.md: the detection limit, checked both ways)."""
MIXED_SENSITIVITY_WEIGHT = 1e-1
"""The same for a mixed-precision group (bf16, fp16, ds_*): at 1e-2 its effect stood only a few times above
bf16's rounding, and the limit it measured was 2.3 × too small (your_amp_script.yaml: a split planted at
3 × it matched)."""


class Expander:
    def __init__(self, spec: MatrixSpec, *, references: Mapping[str, Reference] | None = None) -> None:
        self.spec = spec
        self.references = dict(references or {})
        """group → the split its `baseline: auto` chose (a group not in it has its first candidate, no instruments)."""
        self.problems = _variant_problems(spec)
        self.cells: list[Cell] = []
        self.baselines: dict[str, str] = {}
        self.unreferenced: list[str] = []
        """group (dtype[@variant]) → id of its baseline cell."""
        self.floors: dict[str, tuple[str, ...]] = {}
        """group → ids of the twins that measure its noise floor."""
        self.sensitivities: dict[str, str] = {}
        """group → id of the cell that measures its detection limit."""

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
                    if split["trainer"] != "deepspeed":
                        split["deepspeed_accumulation"] = "managed"  # the deepspeed trainer's loop only
                    if split["trainer"] != "fsdp":
                        split["hsdp_replicas"] = 1
                    if split["trainer"] not in COMPILING_TRAINERS:
                        split["compile"] = False  # eager: the others' loops are not compiled
                    replicas = split["hsdp_replicas"]
                    if replicas > 1 and (split["world_size"] % replicas or split["world_size"] == replicas):
                        continue  # no such split: replicas that leave no shard group of two ranks or more
                    if split["trainer"] not in TENSOR_PARALLEL_TRAINERS:
                        split["tensor_parallel"] = 1
                    if split["trainer"] not in PIPELINE_TRAINERS:
                        split["pipeline_parallel"] = 1
                    if split["trainer"] not in SEQUENCE_PARALLEL_TRAINERS:
                        split["sequence_parallel"] = 1
                    if split["pipeline_parallel"] == 1:
                        split["pipeline_schedule"] = None
                    elif split["pipeline_schedule"] not in TRAINERS[split["trainer"]].pipeline_schedules:
                        continue  # a schedule this trainer's pipelines do not run
                    if split["world_size"] % (split["tensor_parallel"] * split["pipeline_parallel"]):
                        continue  # no such split: model-parallel groups of that size do not fit the world
                    splits.setdefault(tuple(split.items()), split)  # torch: one cell, not one per ZeRO stage
                for split in splits.values():
                    for bug in axes.bug:
                        if bug is None or self.bug_exists(bug, Split(**split)):
                            self.add(Split(**split), bug=bug)

    def bug_exists(self, bug: str, split: Split) -> bool:
        """Whether a bug of the `bug` axis exists in `split`: where its entry says (gaeq/bugs.py), and where
        something is split (the whole batch in one micro-batch on one rank is the baseline's computation)."""
        problem = self.problem(split.variant)
        if bug not in BUGS:
            raise MatrixError(f"axes.bug: unknown bug {bug!r}; known: {', '.join(sorted(BUGS))}")
        try:
            bug_rules(bug, split, problem)
        except MatrixError:
            return False
        return split.world_size > 1 or split.micro_batch_size < problem.train_batch_size

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
        if key in self.baselines or key in self.unreferenced:
            return
        b = baseline_spec(self.spec, variant)
        if b.none:  # judged by its weights alone: no reference, and nothing to measure one by
            if not self.problems[variant].script:
                raise MatrixError("baseline: none judges a script's splits by the weights its probe reads: a script "
                                  "matrix only (gaeq's own trainers have a reference)")  # fmt: skip
            self.unreferenced.append(key)
            return
        micro = b.micro_batch_size or self.problems[variant].train_batch_size
        chosen = {}
        if (reference := self.references.get(key)) is not None:
            micro, chosen = reference.micro_batch_size, {"world_size": reference.world_size}
        split = self.split_of(b, micro_batch_size=micro, dtype=dtype, variant=variant, **chosen)
        try:
            baseline = dataclasses.replace(self.cell(split), role=Role.BASELINE)
        except MatrixError as exc:  # the group's reference at fault, not its splits: said, with the way out
            raise MatrixError(
                f"the baseline of group {key} ({split.trainer}, world {split.world_size} × micro "
                f"{split.micro_batch_size}): {exc} — give the group a baseline that can run it, e.g. `baseline: "
                "{trainer: deepspeed, zero_stage: 1}` (a variant's own: variants.<name>.baseline)"
            ) from None
        if not baseline.divisible:  # (a baseline skipped for want of fp16 skips its group with it)
            raise MatrixError(f"the baseline of {key} cannot run: {baseline.skip_reason}")
        self.baselines[key] = baseline.id
        self.cells.append(baseline)

    def add_instruments(self, *, twins: int, detection_limit: bool) -> None:
        """After every cell: each group's instruments, right after its baseline — `twins` noise-floor
        twins and, with `detection_limit`, the cell that measures it. Each is the baseline's own split
        (one process, the whole batch): none runs the accumulation code its group is judged on."""
        for key, base_id in self.baselines.items():
            baseline = next(c for c in self.cells if c.id == base_id)
            judged = (c for c in self.cells if c.group == key and c.role == Role.CELL and c.id != base_id)
            if not any(c.skip_reason is None for c in judged):
                continue  # nothing of the group is judged but its baseline (the axes' copy of it)
            if baseline_spec(self.spec, baseline.variant).auto and key not in self.references:
                continue  # measured on the reference the run chooses, once it has chosen it
            instruments = [self.instrument(baseline, Role.FLOOR, twin_seed=k) for k in range(twins)]
            if instruments:
                self.floors[key] = tuple(c.id for c in instruments)
            if detection_limit:  # (its error is meant to be caught: that is what it measures)
                weight = SENSITIVITY_WEIGHT if baseline.dtype == "fp32" else MIXED_SENSITIVITY_WEIGHT
                instruments.append(self.instrument(baseline, Role.SENSITIVITY, weight=weight))
                self.sensitivities[key] = instruments[-1].id
            at = self.cells.index(baseline) + 1
            self.cells[at:at] = instruments

    def instrument(self, baseline: Cell, role: Role, **perturbation) -> Cell:
        """The baseline's split, perturbed (gaeq.perturb), in `role`: gaeq's instrument, not a claim
        (what it shows is reported, whatever it is; its `expect` is what it is built to show)."""
        split = Split(**{a: getattr(baseline, a) for a in SPLIT_AXES})
        expect = Expectation(verdict="diverge" if role == Role.SENSITIVITY else "match")
        return dataclasses.replace(
            self.cell(split), role=role, perturbation=Perturbation(**perturbation), expectation=expect
        )

    def add(self, split: Split, **planted) -> Cell:
        """Check `split` (and what is planted in it), append its cell after its group's baseline."""
        self.ensure_baseline(dtype=split.dtype, variant=split.variant)
        cell = self.cell(split, **planted)
        self.cells.append(cell)
        return cell

    def add_resume(self, r: ResumeSpec) -> None:
        """The source cell (found or added, marked to checkpoint at `at_step`) and its resumed targets
        (the rules: gaeq/matrix/resume.py)."""
        src = r.from_
        plain_source(r)
        split = self.split_of(src)
        at_step_inside(r, steps=self.problem(src.variant).steps)
        epochs_run_on(self.problem(src.variant))
        self.ensure_baseline(dtype=split.dtype, variant=src.variant)
        source = self.cell(split)
        source_rules(source, r)
        source = self.save_at(source, step=r.at_step)
        for t in r.to:
            target = self.cell(
                self.split_of(t, trainer=source.trainer, dtype=split.dtype, variant=src.variant),
                expect=t.expect or ExpectSpec(verdict="diverge" if t.drop else "match"),
            )
            target_rules(source, target, t, r)
            resumed = Resume(source=source.id, step=r.at_step, universal=r.universal, drop=tuple(t.drop))
            self.cells.append(dataclasses.replace(target, resume=resumed))

    def save_at(self, cell: Cell, *, step: int) -> Cell:
        """`cell` — the one already in the matrix if there is one, else appended — marked to write a
        checkpoint after `step`."""
        at = next((i for i, c in enumerate(self.cells) if c.id == cell.id), None)
        if at is None:
            self.cells.append(cell)
            at = len(self.cells) - 1
        marked = dataclasses.replace(self.cells[at], save_at=tuple(sorted({*self.cells[at].save_at, step})))
        self.cells[at] = marked
        return marked

    def cell(
        self,
        split: Split,
        *,
        bug: str | None = None,
        expect: ExpectSpec | None = None,
        fault: FaultSpec | None = None,
        args: tuple[str, ...] = (),
        weight_error: float | None = None,
    ) -> Cell:
        """The one place a split is checked and becomes a cell (or a skipped cell, with the reason)."""
        problem = self.problem(split.variant)
        split = split_rules(split, problem, self.spec)
        if bug is not None:
            bug_rules(bug, split, problem)
        if fault is not None:
            fault_rules(fault, split, problem)
        script_rules(split, problem, args=args)
        expectation = expect_rules(
            expect or ExpectSpec(verdict="diverge" if bug or weight_error else "match"), split, problem, self.spec
        )
        cell = Cell(
            **{a: getattr(split, a) for a in SPLIT_AXES},
            train_batch_size=problem.train_batch_size,
            bug=bug,
            script_args=args,
            expectation=expectation,
            perturbation=Perturbation(weight=weight_error) if weight_error is not None else None,
            fault=Fault(**fault.model_dump()) if fault else None,
            snapshots=tuple(m for m in TENSOR_METRICS if m in self.spec.track),
            snapshot_every=self.spec.track_every,
            keep_nvme_swap=self.spec.keep_nvme_swap and split.offload == "nvme",
        )
        if (reason := skip_reason(split, problem)) is not None:
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
            unreferenced=tuple(self.unreferenced),
            floors=self.floors,
            sensitivities=self.sensitivities,
            references=self.references,
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
