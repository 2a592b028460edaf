"""Matrices shared by the tests."""

from __future__ import annotations

import torch
import yaml

from gaeq.results.outcome import CellOutcome, write_outcome
from gaeq.trainers import RunContext, trainer_for


def small_spec(**overrides) -> dict:
    """A quick matrix: B=16, 12 steps, AdamW + warmup-cosine + clipping, both trainers."""
    spec = {
        "name": "small",
        "problem": {
            "model": {"kind": "mlp", "hidden": 16, "depth": 2},
            "data": {"kind": "regression", "in_features": 8, "out_features": 2},
            "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01},
            "schedule": {"name": "warmup_cosine", "warmup_steps": 3, "min_lr_ratio": 0.1},
            "gradient_clipping": 1.0,
            "steps": 12,
            "seed": 7,
            "train_batch_size": 16,
        },
        "axes": {"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4]},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def ga_spec(**overrides) -> dict:
    """experiments/ga.yaml's problem with other axes/cells: its cells are cells of the suite's
    `default_run` (tests/conftest.py), whose traces theirs must equal bitwise."""
    from tests.conftest import REPO

    problem = yaml.safe_load((REPO / "experiments" / "ga.yaml").read_text())["problem"]
    return {"name": "ga-subset", "problem": problem, **overrides}


def run_in_process(matrix, run_dir):
    """Train every runnable cell of a world-size-1 matrix in this process; return their outcomes
    (a cell that raises is an `error`, as in a rank)."""
    outcomes = {}
    for cell in matrix.runnable():
        cell_dir = run_dir / "cells" / cell.id
        cell_dir.mkdir(parents=True)
        ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), cell_dir=cell_dir, run_dir=run_dir)
        try:
            ran = trainer_for(cell.trainer)(cell=cell, problem=matrix.problems[cell.variant], ctx=ctx)
        except Exception as exc:  # noqa: BLE001 - reported like a failed rank
            outcomes[cell.id] = CellOutcome(status="error", seconds=0.0, reason=f"{type(exc).__name__}: {exc}")
        else:
            outcomes[cell.id] = CellOutcome(status="done", seconds=0.0, ran=ran)
        write_outcome(cell_dir, outcomes[cell.id])
    return outcomes
