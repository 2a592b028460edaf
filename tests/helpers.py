"""Matrices shared by the tests."""

from __future__ import annotations


def small_spec(**overrides) -> dict:
    """A quick matrix: B=16, 12 steps, AdamW + warmup-cosine + clipping, both trainers."""
    spec = {
        "name": "small",
        "problem": {
            "model": {"in_features": 8, "hidden": 16, "out_features": 2, "depth": 2},
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
