"""What the weights every target got (gaeq.script.targets) say a run optimises, step by step: in words, whether
they depend on the step's rows alone or on the split, and matched against the weighting mistakes of the pitfall
catalogue (docs/pitfalls.md), with their fix.

A target's weight in the update is the weight its rank's loss gave it × what the script multiplied the gradients
by after the last backward (gaeq.script.weights.AsLeft: Megatron-LM's and fairseq's ÷ the step's token count,
torchtune's × world ÷ it) ÷ what the ranks' gradients are combined by (`combining`: the world size where DDP, FSDP,
DeepSpeed or a hand all-reduce average them, 1 where a hand all-reduce sums them). A clip is no weighting: shapes
are read before the first clip call; gaeq.objective.invariance compares splits after it, as the optimizer receives
them.

Each step's shape is gaeq.objective.shapes'; the run's is its first step tied to the split, else of no shape known,
else every step's said once. Where the weights were read coarser than COARSE (a bf16 loss), only a shape tied to the
split whose difference shows beyond that resolution is named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gaeq.objective.shapes import BRIEF, Found, Kind, Row, Shape, StepWeights, classify, of_the_steps, times

COARSE = 1e-3
"""The coarsest resolution (relative, of each weight) a shape or a match is named at: a mean of micro-batch means
over micro-batches of 1,000 and 1,001 targets is that far from the step's mean."""


@dataclass(frozen=True, kw_only=True)
class Weighting:
    """What a run's weights say, over its steps."""

    shape: Shape
    kind: Kind
    line: str
    """In words, with the numbers: what `Weights:` prints."""
    step: int | None = None
    """The step that decided (the first tied to the split, or unknown); None: every step agreed, or none was read."""
    fix: str | None = None
    resolution: float | None = None
    steps: tuple[StepWeights, ...] = field(default=(), compare=False, repr=False)
    """Each step read: what gaeq.objective.invariance compares between splits."""

    @property
    def is_mean(self) -> bool:
        return self.shape == Shape.MEAN

    @property
    def brief(self) -> str:
        """The shape in a few words (what a line beside another run's says of it)."""
        return BRIEF[self.shape] + (" (tied to its split)" if self.kind == Kind.SPLIT else "")

    def summary(self) -> dict:
        return {"shape": self.shape, "kind": self.kind, "line": self.line, "step": self.step, "fix": self.fix,
                "resolution": self.resolution}  # fmt: skip


def weighting(steps: list[dict], *, unread: str | None = None, grad_accum: int | None = None) -> Weighting:
    """The weighting of a run's steps (probe records, each with its ranks' `targets` and `rescale`); `unread`: why
    a forward could not be read; `grad_accum`: the split's GA, where a short step may hold fewer micro-batches."""
    read, why = [], unread
    for s in steps:
        if s.get("skipped"):
            continue
        found = step_weights(s)
        if isinstance(found, str):
            why = why or found
        else:
            read.append(found)
    if not read:
        return Weighting(shape=Shape.UNREAD, kind=Kind.UNREAD, line=f"not read: {why or 'no target weights'}")
    resolution = max(s.resolution for s in read)
    said = [classify(s, grad_accum) for s in read]
    for s, found in zip(read, said):  # the first step tied to the split, else of no shape known, decides
        if found.kind == Kind.SPLIT:  # (its difference beyond the resolution, however coarse)
            return _whole(found, s.step, read, resolution)
    if resolution > COARSE:  # no shape of the step's rows, nor none known, below a coarse resolution
        return _unresolved(read, resolution)
    for s, found in zip(read, said):
        if found.kind == Kind.UNKNOWN:
            return _whole(found, s.step, read, resolution)
    return _whole(of_the_steps(read, said), None, read, resolution)


def combining(combined: list[str | None], world: int) -> int:
    """What the ranks' gradients are divided by when they are combined: the world size where they are averaged
    (DDP, FSDP, a DeepSpeed engine, an all-reduce by hand and then ÷ world or AVG), 1 where every rank summed
    them by hand (SUM, no division: that is in the factor after it)."""
    return 1 if combined and all(c == "sum" for c in combined) else world


def _before_clip(phases: list[dict | None] | None) -> list[dict]:
    """A rank's rescale reads, one per optimizer step of its training step: each as it stood at the first clip
    call after the last backward where there was one (a clip is no weighting), else at the step."""
    return [p.get("before_clip") or p for p in phases or () if p is not None]


def rescaled(phases: list[dict | None] | None) -> float | None:
    """What a rank's gradients were multiplied by after the last backward and before any clip call, at its training
    step's last optimizer step; 1 where nothing was read, None where unevenly."""
    found = _before_clip(phases)
    return found[-1]["factor"] if found else 1.0


def objective_factor(ranks: list[dict[str, Any]]) -> tuple[float, float]:
    """The rescale, and what the ranks' summed losses are multiplied by to be the objective the optimizer
    receives: ÷ the ranks' combination, × what rank 0's gradients were multiplied by after the last backward (a
    rescale: torchtune's × world ÷ the step's tokens; where ranks differ, rank 0's — the weights say so) — a missing
    ÷ GA shows as × GA even where the logged loss looks right."""
    factor = rescaled(ranks[0].get("rescale")) if ranks else 1.0
    factor = 1.0 if factor is None else factor
    return factor, factor / combining([r.get("combined") for r in ranks], len(ranks))


def step_weights(step: dict) -> StepWeights | str:
    """A probe step's weights in the update's units, or why they cannot be: a forward not read, the gradients
    multiplied unevenly after the last backward, or combined by hand in a way not read."""
    ranks = step.get("targets") or []
    if not any(f for forwards in ranks for f in forwards):
        return "no target weights"
    if any(f is None for forwards in ranks for f in forwards):
        return f"a forward of step {step['step']} was not read"
    if "unread" in (combined := step.get("combined") or []):
        return (
            f"the ranks' gradients were all-reduced by hand at step {step['step']} by an op other than SUM or AVG, "
            "or left running (async_op)"
        )
    factors, rescaled_to = [], 0.0
    for r, phases in enumerate(step.get("rescale") or [[] for _ in ranks]):
        found = _before_clip(phases)
        if any(p["factor"] is None for p in found) or len({p["factor"] for p in found}) > 1:
            ranges = [x for p in found for x in p.get("range") or [p["factor"]] if x is not None]
            return (
                f"rank {r}'s gradients were multiplied unevenly after the last backward at step {step['step']} "
                f"(× {min(ranges):.3g} to × {max(ranges):.3g}, parameter by parameter)"
            )
        factors.append(rescaled(phases))
        # how finely a rescale was read (half-precision gradients' rounding); no rescale, nothing to read
        rescaled_to = max([rescaled_to, *(p.get("resolution", 0.0) for p in found if p["factor"] != 1.0)])
    factors = factors or [1.0] * len(ranks)
    scale = factors[0] / combining(combined, step["world_size"])  # what rank 0's optimizer receives
    rows = []
    for r, forwards in enumerate(ranks):
        for k, f in enumerate(forwards):
            keys = f.get("keys") or [None] * len(f["rows"])
            for key, (n, total, low, high) in zip(keys, f["rows"]):
                if n:
                    low, high = sorted((low * scale, high * scale))
                    rows.append(Row(key, r, k, n, total * scale, low, high))
    reads = {f.get("read", "float32 gradients at the model's output") for forwards in ranks for f in forwards}
    smoothed = [f["label_smoothing"] for forwards in ranks for f in forwards if f.get("label_smoothing")]
    return StepWeights(
        step=step["step"],
        world=step["world_size"],
        micro_steps=max(len(forwards) for forwards in ranks),
        rows=tuple(rows),
        resolution=max(max(f.get("resolution", 64 * 2.0**-23) for forwards in ranks for f in forwards), rescaled_to),
        factor=factors[0],
        read=", ".join(sorted(reads)),
        smoothing=max(smoothed) if smoothed else None,
        factors=tuple(factors),
        rescale_resolution=rescaled_to,
    )


def _whole(found: Found, step: int | None, read: list[StepWeights], resolution: float) -> Weighting:
    """The run's weighting: the deciding shape in words, with how finely it was read and any rescale."""
    scaled = [s for s in read if abs(s.factor - 1) > s.resolution]
    said = found.words
    if scaled:
        s = scaled[0]
        said += f" — with the gradients {times(s.factor)} after the last backward (at step {s.step}: a rescale)"
    if smoothed := [s.smoothing for s in read if s.smoothing]:
        said += f" — a cross-entropy with label smoothing ε = {smoothed[0]:.3g}"
    said += f" (read to ±{resolution:.0e} of each weight: {read[0].read})"
    if found.fix:
        said += f" — {found.fix}"
    return Weighting(
        shape=found.shape,
        kind=found.kind,
        line=said,
        step=step,
        fix=found.fix,
        resolution=resolution,
        steps=tuple(read),
    )


def _unresolved(read: list[StepWeights], resolution: float) -> Weighting:
    low = min(r.low for s in read for r in s.rows)
    high = max(r.high for s in read for r in s.rows)
    if max(s.rescale_resolution for s in read) >= resolution:  # the coarse part: a rescale of bf16 gradients
        why = (
            f"({read[0].read}; the gradients' rescale after the last backward read from half-precision gradients), "
            f"too coarse to tell the shapes apart (targets weigh {low:.3g} to {high:.3g}) — a float32 run reads it "
            "to ±1e-07 (`--dtype fp32`)"
        )
    else:
        why = (
            f"({read[0].read}), too coarse to tell the shapes apart (targets weigh {low:.3g} to {high:.3g}) — a loss "
            "on the logits cast to float32 (`logits.float()`) reads them to ±8e-06, as a float32 run does (`--dtype "
            "fp32`)"
        )
    return Weighting(
        shape=Shape.UNRESOLVED,
        kind=Kind.UNREAD,
        line=f"not read finely enough: each weight is known to ±{resolution:.1%} of itself {why}",
        resolution=resolution,
        steps=tuple(read),
    )
