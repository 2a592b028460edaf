"""Resume experiments: train a source cell to `at_step`, checkpoint it (convert it to a universal
checkpoint), and resume it in other splits — which DeepSpeed 0.19 allows, and which it does not."""

from __future__ import annotations

import dataclasses

from gaeq.matrix.cell import Resume
from gaeq.matrix.expand import Expander
from gaeq.matrix.schema import MatrixError, ResumeSpec
from gaeq.registry import CHECKPOINT_TRAINERS


def add_resume(ex: Expander, r: ResumeSpec) -> None:
    """The source cell (found or added, marked to checkpoint at `at_step`) and its resumed targets."""
    src = r.from_
    if src.bug or src.fault:
        raise MatrixError("a resume source is a plain cell: no bug, no fault")
    split = ex.split_of(src)
    steps = ex.problem(src.variant).steps
    if not 0 < r.at_step < steps:
        raise MatrixError(f"resume at_step {r.at_step} must lie between 1 and steps - 1 = {steps - 1}")
    ex.ensure_baseline(dtype=split.dtype, variant=src.variant)
    source = ex.cell(split)
    if source.trainer not in CHECKPOINT_TRAINERS:
        raise MatrixError(
            f"checkpoints are written and resumed by the {' and '.join(CHECKPOINT_TRAINERS)} trainers; "
            f"source {source.id} is {source.trainer}"
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
    same = [i for i, c in enumerate(ex.cells) if c.id == source.id]
    if same:
        source = ex.cells[same[0]]
    else:
        ex.cells.append(source)
    marked = dataclasses.replace(source, save_at=tuple(sorted({*source.save_at, r.at_step})))
    ex.cells[same[0] if same else -1] = marked
    for t in r.to:
        target = ex.cell(
            ex.split_of(t, trainer=source.trainer, dtype=split.dtype, variant=src.variant),
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
            raise MatrixError(
                "DeepSpeed always loads the optimizer state of a universal checkpoint: drop it only with universal: "
                "false"
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
        ex.cells.append(
            dataclasses.replace(
                target, resume=Resume(source=source.id, step=r.at_step, universal=r.universal, drop=tuple(t.drop))
            )
        )
