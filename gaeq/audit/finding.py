"""A finding of `gaeq audit`: one key of a DeepSpeed config, its value, its effect on equivalence, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Effect = Literal["breaks", "risk", "fine"]
LOW = ("bf16", "bfloat16", "fp16", "float16", "half")


@dataclass(frozen=True, kw_only=True)
class Finding:
    key: str
    value: str
    effect: Effect
    why: str
    evidence: str | None = None
    """experiment file: cell id — where the lab shows it (required for breaks and risk)."""

    @property
    def line(self) -> str:
        shown = f" (shown by {self.evidence})" if self.evidence else ""
        return f"{self.key} = {self.value}: {self.effect} — {self.why}{shown}"
