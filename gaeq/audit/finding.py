"""A finding of `gaeq audit`: one key of a DeepSpeed config, its value, its effect on equivalence, and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Effect = Literal["breaks", "risk", "fine"]
LOW = ("bf16", "bfloat16", "fp16", "float16", "half")


def enabled(config: dict[str, Any], name: str) -> bool:
    """Whether the config enables its `name` section ("bf16", read under its alias "bfloat16" too, or "fp16")."""
    aliases = {"bf16": ("bf16", "bfloat16"), "fp16": ("fp16",)}[name]
    return any((config.get(a) or {}).get("enabled") is True for a in aliases)


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
