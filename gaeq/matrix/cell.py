"""A cell — one way of splitting the global batch — and the matrix of them, as plain data.

Frozen dataclasses that cross process boundaries (ranks receive their cells pickled). Gradient
accumulation is never chosen, always derived::

    data_parallel    = world_size // (tensor_parallel * pipeline_parallel * sequence_parallel)
                       (ranks that see different samples)
    grad_accum_steps = train_batch_size // (micro_batch_size * data_parallel)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gaeq.matrix.schema import BASE, MatrixError, MatrixSpec, Offload, Trainer, baseline_spec
from gaeq.problem.spec import Dtype, ProblemSpec
from gaeq.problem.split import indivisible_message
from gaeq.registry import TRAINERS


class Role(str, Enum):
    """What a cell is for in its group (dtype[@variant])."""

    CELL = "cell"
    """A split under test, judged against the baseline."""
    BASELINE = "baseline"
    """The group's reference: plain full-batch training, its grad norm computed as accurately as gaeq
    can (float64 in the torch trainer), whatever the cells do."""
    FLOOR = "floor"
    """A twin of the baseline: its very split, the grad norm summed as users sum it, every gradient
    nudged by a unit in the last place before each step (gaeq.perturb). Nothing but rounding separates
    it from the baseline, and none of the code under test runs in it: how far it drifts is this
    problem's noise floor, measured in this run (gaeq.results.floor)."""
    SENSITIVITY = "sensitivity"
    """The baseline's split with an error of known size planted (each batch's rows reweighed 1 ± δ, the
    batch's total weight unchanged: gaeq.perturb): how far that moves it says the smallest error the run
    detects (gaeq.results.floor)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    rank: int
    step: int
    kind: str


@dataclass(frozen=True, kw_only=True)
class Perturbation:
    """What an instrument — or a control of tunable size — changes in its split (gaeq.perturb)."""

    twin_seed: int | None = None
    """Every gradient × (1 ± eps) before each optimizer step, signs seeded by this: a noise-floor twin."""
    weight: float | None = None
    """The gradient of the step's even rows × (1 + weight), its odd rows' × (1 − weight): an error of known size."""

    @property
    def id_part(self) -> str:
        parts = [f"floor{self.twin_seed}"] if self.twin_seed is not None else []
        return "-".join(parts + ([f"weight{self.weight:.0e}"] if self.weight is not None else []))


@dataclass(frozen=True, kw_only=True)
class Resume:
    source: str
    """Id of the cell whose checkpoint is resumed."""
    step: int
    """Optimizer steps the checkpoint holds; the resumed cell trains steps `step`..end."""
    universal: bool
    drop: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """What a cell is expected to show (the matrix's `expect`): its verdict and, for a divergence,
    what must catch it — plain data, pickled to the ranks with the cell."""

    verdict: str = "match"
    """match | diverge."""
    caught_by: str | None = None
    """The metric that must diverge first (the comparison's `caught_by`); None: any."""
    step: int | None = None
    """The step at which `caught_by` (else the cell's first divergence) must first diverge; None: any."""
    holds: tuple[str, ...] = ()
    """Metrics that must not diverge at any step."""

    @property
    def detail(self) -> dict | None:
        """What it says beyond its verdict (report.json's `expect_detail`); None: the verdict alone."""
        if self.caught_by is None and self.step is None and not self.holds:
            return None
        return {"caught_by": self.caught_by, "step": self.step, "holds": list(self.holds)}

    def __str__(self) -> str:
        """Short, for a table: `diverge`, `diverge:grad_norm@0`, `diverge:grad_norm@0 holds:loss`."""
        said = self.verdict
        if self.caught_by is not None or self.step is not None:
            said += f":{self.caught_by or 'any'}" + (f"@{self.step}" if self.step is not None else "")
        return said + (f" holds:{','.join(self.holds)}" if self.holds else "")


@dataclass(frozen=True, kw_only=True)
class Reference:
    """The split `baseline: auto` chose for a group (GA 1: the whole batch over `world_size` ranks), and why."""

    world_size: int
    micro_batch_size: int
    why: str


def group_key(*, dtype: str, variant: str) -> str:
    """Cells are judged against the baseline of their group: same problem variant, same dtype."""
    return dtype if variant == BASE else f"{dtype}@{variant}"


SPLIT_AXES = (
    "trainer",
    "world_size",
    "tensor_parallel",
    "pipeline_parallel",
    "pipeline_schedule",
    "sequence_parallel",
    "hsdp_replicas",
    "micro_batch_size",
    "zero_stage",
    "offload",
    "deepspeed_accumulation",
    "compile",
    "dtype",
    "variant",
)
"""The matrix's axes: the fields of a :class:`Split`, in the order the axes are expanded. A new axis
is a field here, in :class:`Split`, in the schema (AxesSpec, CellSpec) and in :attr:`Cell.id`."""

DEEPSPEED_ONLY = {"zero_stage": None, "offload": "none"}
"""Axes only DeepSpeed cells have, and what a torch cell has instead."""
DEFAULT_PIPELINE_SCHEDULE = "1f1b"
"""A pipeline cell's schedule when none is given (every pipeline trainer runs it)."""


@dataclass(frozen=True)
class Place:
    """A rank's place in its cell: its pipeline stage, data-parallel, tensor-parallel and sequence-parallel rank."""

    stage: int
    data: int
    tensor: int
    sequence: int = 0


@dataclass(frozen=True, kw_only=True)
class Split:
    """How a cell splits the global batch (and in which dtype, for which problem variant): one
    value of each axis."""

    trainer: Trainer
    world_size: int
    """Ranks in all: pipeline stages × data-parallel × tensor-parallel."""
    tensor_parallel: int = 1
    """Ranks each layer is split over; the ranks of one tensor-parallel group share micro-batches."""
    pipeline_parallel: int = 1
    """Pipeline stages the model's layers are split into, one per rank of a pipeline; a pipeline runs
    its GA micro-batches per optimizer step through the stages (accumulation is its schedule)."""
    pipeline_schedule: str | None = None
    """The order a pipeline runs its micro-batches in (gaeq.registry.PIPELINE_SCHEDULES); None
    without stages."""
    sequence_parallel: int = 1
    """Ranks each sample's tokens are split over (DeepSpeed-Ulysses); the ranks of one sequence-parallel
    group share micro-batches, each holding a contiguous slice of every sample's tokens."""
    hsdp_replicas: int = 1
    """FSDP2 cells: replicas of a hybrid-sharded model (HSDP), each sharding it over data-parallel
    ranks ÷ this; 1: every data-parallel rank holds one shard (plain FSDP)."""
    micro_batch_size: int
    zero_stage: int | None = None
    """ZeRO stage for DeepSpeed cells; None for the torch trainer."""
    offload: Offload = "none"
    deepspeed_accumulation: str = "managed"
    """Who ends a DeepSpeed step's accumulation (gaeq.registry.DEEPSPEED_ACCUMULATION): the engine, or
    a loop accumulating by hand with GA 1 in the config."""
    compile: bool = False
    """The model under torch.compile (a DeepSpeed engine's through engine.compile()); eager otherwise."""
    dtype: Dtype = "fp32"
    variant: str = BASE

    @property
    def model_parallel(self) -> int:
        """Ranks one micro-batch is spread over: tensor-parallel × pipeline stages × sequence-parallel."""
        return self.tensor_parallel * self.pipeline_parallel * self.sequence_parallel

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples (world_size ÷ the ranks one micro-batch is spread over)."""
        if self.world_size % self.model_parallel:
            raise MatrixError(f"world_size {self.world_size} is not divisible by {self._model_parallel_said()}")
        return self.world_size // self.model_parallel

    def _model_parallel_said(self) -> str:
        said = [f"tensor_parallel {self.tensor_parallel}"] if self.tensor_parallel > 1 else []
        said += [f"pipeline_parallel {self.pipeline_parallel}"] if self.pipeline_parallel > 1 else []
        said += [f"sequence_parallel {self.sequence_parallel}"] if self.sequence_parallel > 1 else []
        return " × ".join(said) or "1"


@dataclass(frozen=True, kw_only=True)
class Cell(Split):
    """One way of splitting the global batch, and what it is expected to show. Plain data: it
    crosses process boundaries."""

    train_batch_size: int
    bug: str | None = None
    expectation: Expectation = Expectation()
    """What it is expected to show (its verdict: :attr:`expect`)."""
    fault: Fault | None = None
    snapshots: tuple[str, ...] = ()
    """Tensors saved at boundaries ("grads", "params"): what the matrix tracks beyond the trace."""
    snapshot_every: int = 1
    keep_nvme_swap: bool = False
    """Keep the swap folder of an nvme-offload cell when it ends (the matrix's keep_nvme_swap)."""
    save_at: tuple[int, ...] = ()
    """Checkpoint after these many optimizer steps (for resume experiments)."""
    resume: Resume | None = None
    script_args: tuple[str, ...] = ()
    """A script cell's extra arguments (after the script's own), e.g. a mistake behind a flag."""
    perturbation: Perturbation | None = None
    """A noise-floor twin's nudge, or an error of known size (gaeq.perturb); None for every other cell."""
    skip_reason: str | None = field(default=None, compare=False)
    role: Role = field(default=Role.CELL, compare=False)
    """Not part of what the cell is: the baseline's split listed among the axes is the same cell."""

    @property
    def expect(self) -> str:
        """The verdict it expects: match | diverge."""
        return self.expectation.verdict

    @property
    def joins_through_deepspeed(self) -> bool:
        """Its ranks join their group through DeepSpeed: a DeepSpeed trainer, or Ulysses' attention
        (DeepSpeed's DistributedAttention talks through deepspeed.comm)."""
        return TRAINERS[self.trainer].deepspeed or self.sequence_parallel > 1

    def place(self, rank: int) -> Place:
        """Where `rank` sits: ranks are laid out pipeline stage outermost, sequence-parallel innermost
        (rank = ((stage × data_parallel + data rank) × tensor_parallel + tp rank) × sequence_parallel + sp
        rank), as DeepSpeed's pipe/data topology and init_device_mesh((pp, dp, tp)) lay them out — the ranks
        of one tensor- or sequence-parallel group share micro-batches, the stages of one pipeline pass them on."""
        tp, dp, sp = self.tensor_parallel, self.data_parallel, self.sequence_parallel
        return Place(
            stage=rank // (dp * tp * sp), data=(rank // (tp * sp)) % dp, tensor=(rank // sp) % tp, sequence=rank % sp
        )

    @property
    def divisible(self) -> bool:
        return self.train_batch_size % (self.micro_batch_size * self.data_parallel) == 0

    @property
    def grad_accum_steps(self) -> int:
        if not self.divisible:
            raise MatrixError(self._indivisible())
        return self.train_batch_size // (self.micro_batch_size * self.data_parallel)

    @property
    def id(self) -> str:
        parts = [self.trainer]
        if self.zero_stage is not None:
            parts.append(f"z{self.zero_stage}")
        if self.offload != "none":
            parts.append(f"{self.offload}off")
        if self.deepspeed_accumulation != "managed":
            parts.append(f"acc_{self.deepspeed_accumulation}")
        ga = self.grad_accum_steps if self.divisible else "NA"
        parts.append(f"w{self.world_size}")
        if self.tensor_parallel > 1:
            parts.append(f"tp{self.tensor_parallel}")
        if self.pipeline_parallel > 1:
            parts += [f"pp{self.pipeline_parallel}", str(self.pipeline_schedule)]
        if self.sequence_parallel > 1:
            parts.append(f"sp{self.sequence_parallel}")
        if self.hsdp_replicas > 1:
            parts.append(f"hsdp{self.hsdp_replicas}")
        parts += [f"mb{self.micro_batch_size}", f"ga{ga}"]
        if self.compile:
            parts.append("compiled")
        if self.dtype != "fp32":
            parts.append(self.dtype)
        if self.bug:
            parts.append(f"bug_{self.bug}")
        if self.script_args:
            parts.append("args_" + "_".join(a.strip("-").replace("=", "_") for a in self.script_args))
        if self.fault:
            parts.append(f"fault_{self.fault.kind}_r{self.fault.rank}_s{self.fault.step}")
        if self.resume:
            parts.append(f"from_s{self.resume.step}_{'universal' if self.resume.universal else 'plain'}")
            parts += [f"drop_{d}" for d in self.resume.drop]
        if self.perturbation is not None:
            parts.append(self.perturbation.id_part)
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
        if self.model_parallel == 1:
            return indivisible_message(
                train_batch_size=self.train_batch_size,
                micro_batch_size=self.micro_batch_size,
                world_size=self.world_size,
            )
        return (
            f"train_batch_size {self.train_batch_size} is not divisible by micro_batch_size {self.micro_batch_size} × "
            f"data-parallel ranks {self.data_parallel} (world_size {self.world_size} ÷ {self._model_parallel_said()})"
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
    floors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """group → ids of the twins that measure its noise floor (Role.FLOOR: the baseline's split, nudged)."""
    sensitivities: dict[str, str] = field(default_factory=dict)
    """group → id of the cell that measures its detection limit (Role.SENSITIVITY)."""
    references: dict[str, Reference] = field(default_factory=dict)
    """group → the reference `baseline: auto` chose for it, once chosen (`load.with_references`)."""
    unreferenced: tuple[str, ...] = ()
    """Groups with no reference (`baseline: none`): each split judged by its targets' weights alone."""
    plugin_dirs: tuple[str, ...] = ()
    """Folders searched for plugin modules: the matrix file's folder and the working directory."""
    source: dict = field(default_factory=dict, compare=False, repr=False)
    """The mapping it was validated from (kept with a run, to judge it again later)."""

    @property
    def problem(self) -> ProblemSpec:
        return self.problems[BASE]

    @property
    def auto(self) -> bool:
        """Some group's baseline is `auto`: chosen from what runs (`load.with_references`)."""
        return any(baseline_spec(self.spec, v).auto for v in self.problems)

    @property
    def candidates(self) -> frozenset[str]:
        """The baselines `auto` tries first (world 1, the whole batch): one running out of memory is a step of the
        run, not a failure."""
        return frozenset(
            b for g, b in self.baselines.items() if baseline_spec(self.spec, self.baseline_cell(g).variant).auto
        )

    def baseline_cell(self, group: str) -> Cell:
        """The cell `group` is judged against."""
        return next(c for c in self.cells if c.id == self.baselines[group])

    def runnable(self) -> list[Cell]:
        return [c for c in self.cells if c.skip_reason is None]
