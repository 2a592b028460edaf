"""The `script:` of a matrix: a user's own training script, run unchanged under every split (no
torch here: the matrix's schema reads it)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gaeq.problem.placeholders import NAMES, PlaceholderError, check


class Launcher(str, Enum):
    TORCHRUN = "torchrun"
    """``torchrun --standalone --nproc_per_node W train.py ARGS``."""
    DEEPSPEED = "deepspeed"
    """``deepspeed --num_gpus W train.py ARGS``: adds ``--local_rank=N`` before the script's arguments
    (a script for it parses that flag, as DeepSpeed's tutorials do)."""
    ACCELERATE = "accelerate"
    """``accelerate launch --multi_gpu --num_processes W train.py ARGS`` with no config file: torchrun's
    workers plus accelerate's defaults in ``ACCELERATE_*`` (no mixed precision, no dynamo). On a CPU-only
    machine ``accelerate launch`` itself starts one process (it needs mpirun for several)."""


class ScriptSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    path: str = Field(description="The script, relative to the matrix file; run as `python PATH ARGS` would run it.")
    launcher: Launcher = Field(
        Launcher.TORCHRUN,
        description="How the user starts it today (torchrun, deepspeed or accelerate): every rank gets the "
        "environment and arguments that launcher gives its workers (gaeq/script/launchers.py).",
    )
    args: list[str] = Field(
        [],
        description="Its arguments; {name} or an integer expression of names anywhere inside one is filled per "
        f"cell ({', '.join(NAMES)}), e.g. --batch_size={{micro_batch_size}}. Other braces pass through as written "
        "(JSON such as --accelerator_config '{\"split_batches\": true}', a regex's {3}); an unknown name in a "
        "placeholder is bad input, and {{micro_batch_size}} is the literal text {micro_batch_size}.",
    )
    deepspeed_config: dict[str, Any] | None = Field(
        None,
        description="A DeepSpeed config (a path relative to the matrix file, or a mapping): each cell gets a copy "
        "with its batch triple, passed as {deepspeed_config}.",
    )
    files: dict[str, str] = Field(
        {},
        description="Config files the script reads (paths relative to the matrix file, or name → content): each "
        "cell gets its own copy in its folder, {placeholders} filled as in args — a JSON, YAML or TOML config "
        "of picotron, torchtitan, axolotl or LLaMA-Factory driven per split; pass it as {cell_dir}/NAME.",
    )
    cwd: str | None = Field(None, description="The folder it runs in (default: the script's own folder).")
    env: dict[str, str] = Field({}, description="Extra environment for every rank.")
    imports: list[str] | None = Field(
        None,
        description="Modules the script imports (any installed module or submodule, e.g. transformers, datasets, "
        "peft, numpy) that gaeq's fork server imports once, before it forks the ranks (a rank then starts without "
        "paying for them): deepspeed, accelerate and transformers through gaeq's own preloads, any other after "
        "them, as named. Each must be installed here. Default: deepspeed with the deepspeed launcher or a "
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

    @field_validator("imports")
    @classmethod
    def _installed(cls, imports: list[str] | None) -> list[str] | None:
        """The fork server skips a module it cannot import (multiprocessing.forkserver drops the
        ImportError in silence): a misspelt or missing name is said here, at load, or nothing would."""
        for name in imports or ():
            if not _findable(name):
                raise ValueError(
                    f"{name!r} is not installed here (no module of that name): the fork server imports what you "
                    "list before it forks your ranks"
                )
        return imports

    @field_validator("args")
    @classmethod
    def _placeholders(cls, args: list[str]) -> list[str]:
        for arg in args:
            try:
                check(arg)
            except PlaceholderError as exc:
                raise ValueError(str(exc)) from None
        return args

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str]) -> dict[str, str]:
        for name, content in files.items():
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"files: {name!r}: a file's name, written into each cell's folder")
            for line in content.splitlines():
                try:
                    check(line)
                except PlaceholderError as exc:
                    raise ValueError(f"files: {name}: {exc}") from None
        return files


def _findable(name: str) -> bool:
    """Is `name` a module the fork server could import? Found as the import system finds it, without
    importing it: importlib.util.find_spec imports a dotted name's parent package, so it is asked only
    where that parent is imported already (gaeq's parent process stays free of torch until the fork
    server has started); below that, each package's folders are searched as `import` would."""
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return False
    known = next(d for d in range(len(parts), 0, -1) if d == 1 or ".".join(parts[: d - 1]) in sys.modules)
    try:
        spec = importlib.util.find_spec(".".join(parts[:known]))
    except (ImportError, ValueError):  # a parent that is no package; a module in sys.modules without a spec
        return False
    for depth in range(known + 1, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), list(spec.submodule_search_locations))
    return spec is not None
