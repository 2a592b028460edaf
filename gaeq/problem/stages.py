"""Pipeline stages cut from a model by layer: the token and position embeddings with the first
stage, the blocks divided as evenly as they go (earlier stages take the extra one), the final norm
and the head with the last — the loss is computed where the logits are.

The whole model is built first (from the problem's seed) and then cut: every stage holds the very
modules of the unsplit model, so a pipeline cell starts from the baseline's weights.

Today the cut is defined for gaeq's GPT; a model whose layer list gaeq cannot find is bad input
(:func:`stages_problem` says why) rather than a guess.
"""

from __future__ import annotations

from gaeq.problem.spec import GPTSpec, ProblemSpec


def stages_problem(problem: ProblemSpec, stages: int) -> str | None:
    """Why the problem's model cannot be cut into `stages` stages, or None (no torch: the matrix asks)."""
    model = problem.model
    if not isinstance(model, GPTSpec):
        kind = getattr(model, "kind", None) or getattr(model, "hf", None) or "plugin"
        return (
            f"pipeline stages are cut from gaeq's GPT (embeddings, blocks, head); model {kind} has no layer "
            "list gaeq cuts yet"
        )
    if problem.loss != "cross_entropy":
        return f"a pipeline's last stage computes the loss: cross_entropy, not {problem.loss}"
    if model.dropout > 0:
        return "pipeline stages run without dropout (its masks would depend on the stage's forward order)"
    if model.n_layer < stages:
        return f"n_layer {model.n_layer} < {stages} stages: every stage holds a block at least"
    return None


def stages_per_rank(schedule: str | None) -> int:
    """Model chunks (stages) each pipeline rank holds: two under an interleaved schedule (stage s and
    s + pp, torch's loop layout), else one."""
    return 2 if schedule == "interleaved_1f1b" else 1


def schedule_problem(schedule: str, *, pipeline_parallel: int, micro_batches: int) -> str | None:
    """Why `schedule` cannot run `micro_batches` per step through `pipeline_parallel` ranks (torch's
    own checks, said before a run), or None."""
    if schedule == "1f1b" and micro_batches < pipeline_parallel:
        return f"1F1B needs GA ≥ pipeline_parallel (its warm-up fills every stage): GA {micro_batches}"
    rounds = max(1, micro_batches // pipeline_parallel)
    if schedule == "interleaved_1f1b" and micro_batches % rounds:
        return f"interleaved 1F1B runs GA in rounds of pipeline_parallel micro-batches: GA {micro_batches}"
    return None


def bubble_theory(schedule: str, *, pipeline_parallel: int, micro_batches: int) -> float:
    """The fraction of a step a stage waits, in theory (every stage equally fast, communication
    free): (pp − 1) / (v·GA + pp − 1), v the model chunks per rank (GPipe and 1F1B: v = 1)."""
    v = stages_per_rank(schedule)
    return (pipeline_parallel - 1) / (v * micro_batches + pipeline_parallel - 1)


def blocks_of(n_layer: int, pipeline_parallel: int) -> list[range]:
    """The blocks each stage holds: as even as they go, earlier stages taking the extra one."""
    base, extra = divmod(n_layer, pipeline_parallel)
    bounds = [0]
    for stage in range(pipeline_parallel):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
