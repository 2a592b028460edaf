"""Resume experiments' rules: train a source cell to `at_step`, checkpoint it (convert it to a
universal checkpoint), and resume it in other splits — which DeepSpeed allows, and which it does
not. `Expander.add_resume` makes the cells and asks these, in this order."""

from __future__ import annotations

from gaeq.matrix.cell import Cell
from gaeq.matrix.schema import MatrixError, ResumeSpec, ResumeTargetSpec
from gaeq.problem.spec import ProblemSpec
from gaeq.registry import CHECKPOINT_TRAINERS


def plain_source(r: ResumeSpec) -> None:
    if r.from_.bug or r.from_.fault:
        raise MatrixError("a resume source is a plain cell: no bug, no fault")


def at_step_inside(r: ResumeSpec, *, steps: int) -> None:
    if not 0 < r.at_step < steps:
        raise MatrixError(f"resume at_step {r.at_step} must lie between 1 and steps - 1 = {steps - 1}")


def epochs_run_on(problem: ProblemSpec) -> None:
    """A resumed cell's label is checked from the step it starts at: a problem whose epochs end in
    short steps (fewer micro-steps) is not resumed yet; nor a Muon's (its checkpoints not measured)."""
    if problem.epoch_end != "run_on":
        raise MatrixError("resume experiments with epoch_end short_step: not offered (a resumed cell may start short)")
    if problem.optimizer.name in ("muon", "torch_muon"):
        raise MatrixError(f"resume experiments with optimizer {problem.optimizer.name}: not offered (not measured)")


def source_rules(source: Cell, r: ResumeSpec) -> None:
    """What can write the checkpoint: a trainer that checkpoints, without tensor parallelism, a cell
    that runs here; for a universal checkpoint, DeepSpeed at ZeRO ≥ 1."""
    if source.trainer not in CHECKPOINT_TRAINERS:
        raise MatrixError(
            f"checkpoints are written and resumed by the {' and '.join(CHECKPOINT_TRAINERS)} trainers; "
            f"source {source.id} is {source.trainer}"
        )
    if source.pipeline_parallel > 1:
        raise MatrixError(
            f"checkpoints are written without pipeline stages; source {source.id} has pipeline_parallel "
            f"{source.pipeline_parallel}"
        )
    if source.tensor_parallel > 1:
        raise MatrixError(
            f"checkpoints are written without tensor parallelism; source {source.id} has tensor_parallel "
            f"{source.tensor_parallel}"
        )
    if source.skip_reason:
        raise MatrixError(f"the resume source {source.id} cannot run: {source.skip_reason}")
    if r.universal and (source.trainer != "deepspeed" or source.zero_stage == 0):
        raise MatrixError(
            f"universal checkpoints are DeepSpeed ZeRO ≥ 1 checkpoints; source {source.id} cannot write one "
            "(use universal: false: a torch cell resumes its own state dicts at any world size)"
        )


def target_rules(source: Cell, target: Cell, t: ResumeTargetSpec, r: ResumeSpec) -> None:
    """What can load it: a universal checkpoint into ZeRO ≥ 1 (ZeRO-3 only from ZeRO-3), always with
    its optimizer state; a plain DeepSpeed checkpoint at the world size and stage that wrote it. Its
    expectation's step is one it is compared at."""
    if target.expectation.step is not None and target.expectation.step < r.at_step:
        raise MatrixError(
            f"expect.step {target.expectation.step} comes before the resume (at_step {r.at_step}): "
            "a resumed cell is compared from there on"
        )
    if r.universal and target.zero_stage == 0:
        raise MatrixError(f"a universal checkpoint loads into ZeRO ≥ 1; target {target.id} is ZeRO-0")
    if r.universal and target.zero_stage == 3 and source.zero_stage != 3:
        raise MatrixError(
            f"DeepSpeed loads a universal checkpoint into ZeRO-3 only when it was saved at ZeRO-3 "
            f"(source {source.id} is ZeRO-{source.zero_stage}: the ZeRO-3 loader finds no model-state files)"
        )
    if r.universal and "optimizer" in t.drop:
        raise MatrixError(
            "DeepSpeed always loads the optimizer state of a universal checkpoint: drop it only with universal: false"
        )
    if (
        not r.universal
        and source.trainer == "deepspeed"
        and (target.world_size, target.zero_stage) != (source.world_size, source.zero_stage)
    ):
        raise MatrixError(
            f"a plain DeepSpeed checkpoint resumes at the same world size and ZeRO stage "
            f"(source w{source.world_size} z{source.zero_stage}); use universal: true to change them"
        )
