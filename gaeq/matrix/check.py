"""The script matrix `gaeq check` writes into its run directory: a user's script under each split, compared
with a reference, with the instruments asked for."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from gaeq.problem.script import Launcher


class Instruments(str, Enum):
    """Which instruments a check runs beside its splits (each a run of the reference's split)."""

    ALL = "all"
    FLOOR = "floor"
    """Its noise floor: twins of the reference, nudged by rounding (without it: the dtype's constant tolerances)."""
    LIMIT = "limit"
    """Its detection limit: the reference with an error of known size (without it: no limit stated)."""
    NONE = "none"


def check_matrix(
    script: Path,
    *,
    script_args: Sequence[str],
    batch: int,
    splits: Sequence[tuple[int, int]],
    steps: int,
    launcher: Launcher,
    deepspeed_config: Path | None = None,
    baseline: tuple[int, int] | str | None = None,
    instruments: Instruments = Instruments.ALL,
    dtypes: Sequence[str] = (),
) -> dict[str, Any]:
    """The script matrix `gaeq check` runs: `script` with `script_args` under each (world, micro) of `splits`,
    compared with `baseline` (world, micro; default world 1 with the whole batch), the one `"auto"` chooses, or —
    `"none"` — none (each split judged by its targets' weights alone, gaeq.objective.weighting); in each of
    `dtypes` (default fp32: a mixed-precision script made float32, its sharpest run), each with its reference."""
    spec: dict[str, Any] = {
        "name": "check",
        "script": {"path": str(script.resolve()), "launcher": launcher.value, "args": list(script_args)}
        | ({"deepspeed_config": str(deepspeed_config.resolve())} if deepspeed_config else {}),
        "steps": steps,
        "train_batch_size": batch,
        "cells": [
            {"world_size": world, "micro_batch_size": micro} | ({"dtype": dtype} if dtype else {})
            for dtype in (dtypes or [None])
            for world, micro in splits
        ],
        "noise_floor": instruments in (Instruments.ALL, Instruments.FLOOR),
        "detection_limit": instruments in (Instruments.ALL, Instruments.LIMIT),
    }
    if isinstance(baseline, str):
        spec["baseline"] = baseline
    elif baseline is not None:
        spec["baseline"] = {"world_size": baseline[0], "micro_batch_size": baseline[1]}
    return spec


def check_command(spec: Mapping[str, Any], *, baseline: str) -> str:
    """The `gaeq check` command line of a matrix :func:`check_matrix` wrote, its reference `baseline` (e.g. w2:mb8)."""
    script = spec["script"]
    words = ["gaeq", "check", script["path"], "--batch", str(spec["train_batch_size"]), "--steps", str(spec["steps"])]
    for split in dict.fromkeys(f"w{c['world_size']}:mb{c['micro_batch_size']}" for c in spec["cells"]):
        words += ["--split", split]
    if dtypes := list(dict.fromkeys(c["dtype"] for c in spec["cells"] if "dtype" in c)):
        words += ["--dtype", ",".join(dtypes)]
    if script["launcher"] != Launcher.TORCHRUN.value:
        words += ["--launcher", script["launcher"]]
    if "deepspeed_config" in script:
        words += ["--deepspeed-config", script["deepspeed_config"]]
    measured = {Instruments.FLOOR: spec["noise_floor"], Instruments.LIMIT: spec["detection_limit"]}
    kept = [i for i, on in measured.items() if on]
    if len(kept) < len(measured):
        words += ["--instruments", kept[0].value if kept else Instruments.NONE.value]
    return shlex.join([*words, "--baseline", baseline, "--", *script["args"]])
