"""Universal-checkpoint conversion with DeepSpeed's own converter: by the parent between phases, or by
rank 0 of `gaeq worker` under an external launcher. Converted once per (source, step)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gaeq.runtime.cells import log_tail
from gaeq.runtime.lifeline import die_with_parent
from gaeq.trainers.checkpoint import checkpoint_root, deepspeed_tag


def convert_to_universal(*, run_dir: Path, source_id: str, step: int, timeout_s: float) -> str | None:
    """``python -m deepspeed.checkpoint.ds_to_universal`` on the source's checkpoint at `step`.

    Returns None on success, else the reason, with the converter's own last words.
    """
    root = checkpoint_root(run_dir, source_id)
    source, target = root / deepspeed_tag(step), root / deepspeed_tag(step, universal=True)
    if not source.is_dir():
        return f"no DeepSpeed checkpoint {source} to convert"
    log = root / f"convert_step{step}.log"
    done = target / ".converted"
    if done.is_file():  # converted before (by the parent, or by an earlier launch of `gaeq worker`)
        return None
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(source), "--output_folder", str(target),
        "--num_extract_workers", "1", "--num_merge_workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    with log.open("w") as out:
        try:
            result = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env=env,
                check=False,
                preexec_fn=die_with_parent(),
            )
        except subprocess.TimeoutExpired:
            return f"ds_to_universal did not finish within {timeout_s:.0f} s ({log})"
    if result.returncode != 0:
        lines = log.read_text(errors="replace").rstrip().splitlines()
        last = next((line for line in reversed(lines) if line.strip() and not line.startswith(" ")), "no output")
        return f"ds_to_universal failed (exit {result.returncode}): {last}\n{log_tail(log)}"
    done.touch()
    return None
