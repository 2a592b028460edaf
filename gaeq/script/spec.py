"""The `script:` of a matrix: a user's own training script, run unchanged under every split (no
torch here: the matrix's schema reads it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gaeq.script.launchers import Launcher
from gaeq.script.placeholders import NAMES, PlaceholderError, check


class ScriptSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    path: str = Field(description="The script, relative to the matrix file; run as `python PATH ARGS` would run it.")
    launcher: Launcher = Field(
        Launcher.TORCHRUN,
        description="How the user starts it today (torchrun, deepspeed or accelerate): every rank gets the "
        "environment and arguments that launcher gives its workers (gaeq.script.launchers).",
    )
    args: list[str] = Field(
        [],
        description="Its arguments; {name} or an integer expression of names anywhere inside one is filled per "
        f"cell ({', '.join(NAMES)}), e.g. --batch_size={{micro_batch_size}}.",
    )
    deepspeed_config: dict[str, Any] | None = Field(
        None,
        description="A DeepSpeed config (a path relative to the matrix file, or a mapping): each cell gets a copy "
        "with its batch triple, passed as {deepspeed_config}.",
    )
    cwd: str | None = Field(None, description="The folder it runs in (default: the script's own folder).")
    env: dict[str, str] = Field({}, description="Extra environment for every rank.")

    @field_validator("args")
    @classmethod
    def _placeholders(cls, args: list[str]) -> list[str]:
        for arg in args:
            try:
                check(arg)
            except PlaceholderError as exc:
                raise ValueError(str(exc)) from None
        return args
