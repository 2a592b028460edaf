"""What a run's verdicts are relative to: each group's reference (its baseline) in words, the reference
`baseline: auto` chooses from what ran, and — where a reference ran out of memory — the one that would fit.

A reference fits where a split at its micro batch ran: a split of micro batch m runs GA ≥ 1 on at most
B / m ranks, so the reference at GA 1 — B / m ranks of m — holds no more per rank (the same micro-batch,
state sharded over as many ranks or more). Never guessed from sizes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from gaeq.files import atomic_write
from gaeq.matrix import Cell, Matrix, Reference, Role, Split
from gaeq.matrix.schema import baseline_spec
from gaeq.results.cell_report import CellReport
from gaeq.results.compare import Verdict
from gaeq.results.outcome import CellOutcome

MIXED = ("bf16", "fp16", "ds_bf16", "ds_fp16")
"""The dtypes a script trains in whose float32 run gaeq adds beside it (its autocast and loss scaler off)."""
REFERENCE_FILE = "reference.json"
"""In the run directory: the references `baseline: auto` chose (group → world, micro, why), for `gaeq report`."""


def in_words(cell: Cell) -> str:
    """A split as the closing line says it: `world 2 × micro 8, GA 1`."""
    return f"world {cell.world_size} × micro {cell.micro_batch_size}, GA {cell.grad_accum_steps}"


def fitting(m: Matrix, outcomes: Mapping[str, CellOutcome], group: str) -> Cell | None:
    """The split of `group` with the largest micro batch that ran (None: none did)."""
    ran = [
        c
        for c in m.cells
        if c.group == group and c.role is Role.CELL and getattr(outcomes.get(c.id), "status", None) == "done"
    ]
    return max(ran, key=lambda c: (c.micro_batch_size, -c.world_size), default=None)


def choose(m: Matrix, outcomes: Mapping[str, CellOutcome]) -> dict[str, Reference]:
    """Each group's reference under `baseline: auto`, from its first candidate's outcome (world 1, the whole
    batch) and its splits': that candidate where it ran; where it ran out of memory, GA 1 at the largest micro
    batch a split ran at. A group whose candidate failed otherwise, or whose splits all failed, has none."""
    chosen = {}
    for group, base_id in m.baselines.items():
        base = m.baseline_cell(group)
        if not baseline_spec(m.spec, base.variant).auto:
            continue  # a group whose baseline the matrix names
        outcome = outcomes.get(base_id)
        if outcome is not None and outcome.status == "done":
            chosen[group] = Reference(world_size=base.world_size, micro_batch_size=base.micro_batch_size,
                                      why=f"{in_words(base)} ran")  # fmt: skip
        elif outcome is not None and outcome.out_of_memory and (fit := fitting(m, outcomes, group)) is not None:
            micro = fit.micro_batch_size
            chosen[group] = Reference(
                world_size=base.train_batch_size // micro,
                micro_batch_size=micro,
                why=f"{in_words(base)} ran out of memory; micro {micro} is the largest micro batch a split ran at "
                f"({fit.id})",
            )
    return chosen


def write_references(run_dir: Path, references: Mapping[str, Reference]) -> None:
    atomic_write(run_dir / REFERENCE_FILE, json.dumps({g: vars(r) for g, r in references.items()}, indent=1))


def read_references(run_dir: Path) -> dict[str, Reference]:
    """What `baseline: auto` chose in the run at `run_dir` ({}: nothing, or not an auto run)."""
    path = run_dir / REFERENCE_FILE
    return {g: Reference(**r) for g, r in json.loads(path.read_text()).items()} if path.is_file() else {}


def what_fits(m: Matrix, outcomes: Mapping[str, CellOutcome], group: str) -> tuple[str, tuple[int, int] | None] | None:
    """Where `group`'s reference ran out of memory: what fits, in words, and its (world, micro) at GA 1 — None
    where no split of the group ran either (None: the reference did not run out of memory)."""
    base = m.baseline_cell(group)
    outcome = outcomes.get(base.id)
    if outcome is None or not outcome.out_of_memory:
        return None
    fit = fitting(m, outcomes, group)
    if fit is None:
        return f"{base.id} ran out of memory, and no split of {group} ran: none fits", None
    world, micro = base.train_batch_size // fit.micro_batch_size, fit.micro_batch_size
    return (
        f"{base.id} ran out of memory; {fit.id} ran at micro {micro}, so GA 1 on {world} ranks fits: "
        f"`--baseline w{world}:mb{micro}` (gaeq check), `baseline: {{world_size: {world}, micro_batch_size: {micro}}}` "
        "(a matrix), or `auto` to have it chosen",
        (world, micro),
    )


def same_split(c: CellReport) -> tuple:
    """A cell's split and what it plants, whatever its dtype."""
    split = tuple(getattr(c.cell, f.name) for f in dataclasses.fields(Split) if f.name != "dtype")
    return split + (c.cell.bug, c.cell.script_args, c.cell.fault)


def float32_that_does_not_fit(cells: list[CellReport]) -> list[CellReport]:
    """`cells`, where the float32 run of a split (gaeq's, beside the mixed precision it trains in) ran out of memory
    while the split as trained was judged: skipped, saying so. Float32 holds up to twice
    a 16-bit run's bytes; the as-trained verdict stands, with its detection limit."""
    judged = {(c.variant, same_split(c)): c for c in cells if c.dtype in MIXED and c.verdict in JUDGED}
    fitted = []
    for c in cells:
        trained = judged.get((c.variant, same_split(c)))
        if c.dtype == "fp32" and trained is not None and c.outcome is not None and c.outcome.out_of_memory:
            why = c.reason.splitlines()[0]
            c = dataclasses.replace(c, verdict=Verdict.SKIPPED, reason=(
                f"the float32 run does not fit ({why}): float32 holds up to twice a {trained.dtype} run's bytes — "
                f"the split as trained stands: {trained.id} {trained.verdict}"
            ))  # fmt: skip
        fitted.append(c)
    return fitted


JUDGED = (Verdict.MATCH, Verdict.DIVERGE)
