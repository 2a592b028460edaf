"""The noise floor: what rounding alone does to this problem, measured in this run.

Each group's twin (``Role.FLOOR``: the baseline's batch in more micro-batches, its grad norm summed
as users sum it) is the same optimisation as the baseline, so its distance from the baseline at each
step is rounding and nothing else — summation order, and a float32 norm against the baseline's
float64 one. How large that is depends on the problem: ~1e-8 on a 3 k-parameter MLP, ~1e-5 on a
1 M-parameter one with clipping active. A cell may differ from the baseline by FACTOR times the
floor at that step (its running maximum: rounding differences grow through the updates, and so
does the floor), never by less than the dtype's constant tolerance, and never by more than CEILING
times that constant — a twin gone wrong cannot hide a real bug behind a wide envelope.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gaeq.results.trace import StepRecord

FACTOR = 10.0
"""How many times the twin's distance from the baseline a cell may drift (measured on the scale
ladder, experiments/scale.yaml: cells stay within a few times their twin's)."""
CEILING = 1000.0
"""The floor widens a constant tolerance by at most this factor: a twin that drifts further is not
measuring rounding (it is rejected, and its group judged by the constants). Set from the ladder's largest
twin and weakest planted control (docs/verdicts.md, the noise floor)."""


@dataclass(frozen=True, kw_only=True)
class NoiseFloor:
    """The twin's distance from the baseline, as a running maximum over steps."""

    twin: str
    steps: tuple[int, ...]
    loss: tuple[float, ...]
    """max |Δloss| up to each step."""
    grad_norm: tuple[float, ...]
    """max |Δ grad norm| / baseline grad norm up to each step."""

    @classmethod
    def measure(cls, twin: str, base: Sequence[StepRecord], other: Sequence[StepRecord]) -> NoiseFloor:
        """Raises ValueError when the twin's trace does not cover the baseline's steps."""
        if [r.step for r in other] != [r.step for r in base]:
            raise ValueError(f"the noise-floor twin {twin} has {len(other)} steps, the baseline {len(base)}")
        loss = [abs(o.loss - b.loss) for b, o in zip(base, other)]
        grad = [0.0 if b.skipped or o.skipped else rel_diff(o.grad_norm, b.grad_norm) for b, o in zip(base, other)]
        return cls(
            twin=twin,
            steps=tuple(r.step for r in base),
            loss=tuple(itertools.accumulate(loss, nanmax)),
            grad_norm=tuple(itertools.accumulate(grad, nanmax)),
        )

    def at(self, step: int) -> tuple[float, float]:
        """(loss, grad norm) floor at `step`: the last measured one at or before it."""
        i = max((i for i, s in enumerate(self.steps) if s <= step), default=0)
        return self.loss[i], self.grad_norm[i]

    def beyond_rounding(self, base: Sequence[StepRecord], tol) -> str | None:
        """Why this drift is not rounding — beyond CEILING × the constant tolerance at some step (the
        problem changes with the split: dropout drawn from a global RNG, say) — or None."""
        for record, loss, grad in zip(base, self.loss, self.grad_norm):
            if loss > CEILING * tol.loss_tol(record.loss) or grad > CEILING * tol.grad_norm_rtol:
                return (
                    f"its twin {self.twin} drifted beyond what rounding explains by step {record.step} (|Δloss| "
                    f"{loss:.1e}, "
                    f"rel Δ‖g‖ {grad:.1e}): judged by the constants alone"
                )
        return None

    def summary(self) -> dict:
        return {
            "twin": self.twin,
            "max_abs_loss_diff": self.loss[-1] if self.loss else 0.0,
            "max_rel_grad_norm_diff": self.grad_norm[-1] if self.grad_norm else 0.0,
            "factor": FACTOR,
            "ceiling": CEILING,
        }


@dataclass(frozen=True, kw_only=True)
class Allowed:
    """The tolerance at one step, and whether the noise floor set it (rather than the constant)."""

    value: float
    by_floor: bool

    def describe(self) -> str:
        return f"tol {self.value:.1e}" + (f" ({FACTOR:g} × the noise floor)" if self.by_floor else "")


def envelope(constant: float, floor: float | None) -> Allowed:
    """max(constant, FACTOR × floor), capped at CEILING × constant; the constant without a floor."""
    if floor is None or math.isnan(floor):
        return Allowed(value=constant, by_floor=False)
    widened = min(FACTOR * floor, CEILING * constant)
    return Allowed(value=widened, by_floor=True) if widened > constant else Allowed(value=constant, by_floor=False)


def rel_diff(value: float, base: float) -> float:
    """|value − base| / |base| (nan if either is)."""
    if math.isnan(value) or math.isnan(base):
        return math.nan
    return abs(value - base) / max(abs(base), 1e-30)


def nanmax(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)
