"""The `script:` of a matrix: a user's own training script, run unchanged under every split (no
torch here: the matrix's schema reads it)."""

from __future__ import annotations

from typing import Any, Literal

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
    imports: list[Literal["deepspeed", "accelerate", "transformers"]] | None = Field(
        None,
        description="Libraries the script imports that gaeq's fork server imports once, before it forks the "
        "ranks (a rank then starts without paying for them). Default: deepspeed with the deepspeed launcher or a "
        "deepspeed_config, accelerate with the accelerate launcher.",
    )

    def libraries(self) -> tuple[str, ...]:
        """What the fork server imports for this script (`imports`, or what its launcher and config say)."""
        if self.imports is not None:
            return tuple(self.imports)
        said = {
            "deepspeed": self.launcher is Launcher.DEEPSPEED or self.deepspeed_config is not None,
            "accelerate": self.launcher is Launcher.ACCELERATE,
        }
        return tuple(name for name, wanted in said.items() if wanted)

    @field_validator("args")
    @classmethod
    def _placeholders(cls, args: list[str]) -> list[str]:
        for arg in args:
            try:
                check(arg)
            except PlaceholderError as exc:
                raise ValueError(str(exc)) from None
        return args
