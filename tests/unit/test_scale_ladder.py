"""experiments/scale.yaml, the scale ladder: what it claims to cover, checked from its expansion."""

from __future__ import annotations

import re

from gaeq.matrix import load_matrix
from gaeq.problem.build import build_problem
from tests.conftest import REPO

LADDER = load_matrix(REPO / "experiments" / "scale.yaml")


def size_of(variant: str) -> float:
    number, unit = re.search(r"_(\d+)([km])", variant).groups()
    return int(number) * {"k": 1e3, "m": 1e6}[unit]


def test_every_variant_is_named_by_its_parameter_count_and_the_ladder_reaches_20_m():
    named = {v: size_of(v) for v in LADDER.problems if v != "base"}
    counts = {v: sum(p.numel() for p in build_problem(LADDER.problems[v]).model.parameters()) for v in named}
    assert {v: round(counts[v] / named[v], 2) for v in named if abs(counts[v] / named[v] - 1) > 0.15} == {}
    assert sum(p.numel() for p in build_problem(LADDER.problem).model.parameters()) < 5_000
    for kind in ("mlp", "gpt"):
        assert max(counts[v] for v in counts if v.startswith(kind)) > 20_000_000


def test_every_group_has_a_twin_every_split_every_control():
    assert set(LADDER.floors) == set(LADDER.baselines)
    splits = {
        (c.trainer, c.world_size, c.zero_stage) for c in LADDER.cells if c.variant == "mlp_21m" and c.dtype == "fp32"
    }
    assert {(t, w, z) for t, w, z in splits if t == "deepspeed"} == {
        ("deepspeed", w, z) for w in (1, 2) for z in range(4)
    }
    configs = {v for v in LADDER.problems if v.endswith(("_noclip", "_sgd"))}
    clipping = {LADDER.problems[v].gradient_clipping for v in configs}
    assert 0.0 in clipping and len(clipping) > 1
    assert {LADDER.problems[v].optimizer.name for v in configs} == {"adamw", "sgd"}
    bugs = {(c.variant, c.bug) for c in LADDER.cells if c.bug}
    for variant in LADDER.problems:
        if variant.endswith(("_noclip", "_sgd")):
            continue
        expected = {"no_loss_division", "clip_every_micro_step"} | (
            {"mean_of_means"} if variant.startswith("gpt") else set()
        )
        assert {b for v, b in bugs if v == variant} == expected, variant
        assert any(c.variant == variant and c.dtype == "bf16" and c.trainer == "deepspeed" for c in LADDER.cells)
