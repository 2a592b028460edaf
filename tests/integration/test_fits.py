"""A script whose whole batch does not fit one process (#66): experiments/scripts/ddp_manual.py on a CPU "device"
of 80 MB (`--memory_mb`: its data limit, past which torch's allocator fails for real) — micro 8 fits, the whole
batch of 16 does not. `gaeq check --baseline auto` ends with verdicts against GA 1 on 2 ranks of 8; a mistake in
every split is caught there; without `auto` the reference's failure is named out of memory, with the command
that fits."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_here

pytestmark = pytest.mark.integration

SCRIPT = REPO / "experiments" / "scripts" / "ddp_manual.py"
DEVICE = ["--hidden", "16384", "--min_len", "23", "--memory_mb", "80"]
"""Measured alone (bisected, 3 steps of 16): micro 4 needs 43 MB, micro 8 64 MB, micro 16 94 MB of it."""
SPLITS = ["--split", "w1:mb4", "--split", "w1:mb8", "--split", "w2:mb4"]


def check(tmp_path, name: str, *options: str, script: tuple[str, ...] = ()):
    args = ["check", str(SCRIPT), "--batch", "16", "--steps", "3", *options, "--out", str(tmp_path / name), "--"]
    args += ["--batch_size", "{micro_batch_size}", "--grad_accum", "{grad_accum_steps}", "--max_steps", "{steps}"]
    return gaeq_here([*args, *DEVICE, *script], tmp_path / name)


def outcome(run, cell: str) -> dict:
    return json.loads((run / "cells" / cell / "outcome.json").read_text())


def test_a_script_that_does_not_fit_the_whole_batch_gets_verdicts_against_a_reference_that_fits(tmp_path):
    proc, report, _ = check(tmp_path, "auto", "--baseline", "auto", *SPLITS)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert proc.stdout.startswith("Plan: 7 runs of 3 steps each — 3 splits, 1 reference (auto:")
    cells = cells_by_id(report)
    assert {c: cells[c]["verdict"] for c in ("script-w1-mb4-ga4", "script-w1-mb8-ga2", "script-w2-mb4-ga2")} == {
        "script-w1-mb4-ga4": "match", "script-w1-mb8-ga2": "match", "script-w2-mb4-ga2": "match",
    }  # fmt: skip
    assert report["baseline"] == "script-w2-mb8-ga1" and report["references"] == {"fp32": "world 2 × micro 8, GA 1"}
    tried = outcome(tmp_path / "auto", "script-w1-mb16-ga1")  # the whole batch on one rank, tried first
    assert tried["out_of_memory"] and tried["reason"].startswith(
        "out of memory at micro batch 16 (world 1): rank 0 raised RuntimeError: [enforce fail at alloc_cpu.cpp"
    )
    assert "DefaultCPUAllocator: can't allocate memory" in tried["reason"] and "(at ddp_manual.py:" in tried["reason"]
    said = "script-w1-mb16-ga1 ran out of memory: as `baseline: auto` allows, the reference will be GA 1 at the"
    assert said in proc.stdout and "error script-w1-mb16-ga1" not in proc.stdout  # a step of the run, said as one
    assert "world 1 × micro 16, GA 1 ran out of memory; micro 8 is the largest" in report["reference_notes"]["fp32"]
    # the instruments measured that reference: its twins and its detection limit
    assert report["noise_floors"]["fp32"]["twins"] == ["script-w2-mb8-ga1-floor0", "script-w2-mb8-ga1-floor1"]
    assert report["detection_limits"]["fp32"]["cell"] == "script-w2-mb8-ga1-weight1e-02"
    assert "OK: 3 match, 0 diverge, 0 error, 0 skipped splits, relative to world 2 × micro 8, GA 1" in proc.stdout
    assert "Reference fp32: world 2 × micro 8, GA 1 — baseline auto:" in (tmp_path / "auto" / "report.md").read_text()


def test_a_mistake_in_every_split_is_caught_against_the_reference_that_fits(tmp_path):
    """A mean of micro-batch means in the script's own arguments: no accumulation mistake at GA 1 (the reference; at
    world 2 it averages its 2 ranks' means, whose rows are 23 or 24 tokens: the same in every world-2 run), one in
    every split that accumulates — caught at step 0 in each. Without instruments, the report says what it cannot
    claim."""
    proc, report, _ = check(
        tmp_path, "planted", "--baseline", "auto", "--instruments", "none", *SPLITS, script=("--bug", "mean_of_means")
    )
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert report["references"] == {"fp32": "world 2 × micro 8, GA 1"}
    # the reference's own weights: each of its 2 ranks' means (rows of 23 or 24 tokens), tied to its split
    tied = "its own targets' weights are tied to its split: a mean of rank means (its `Weights:` line)"
    assert tied in report["reference_notes"]["fp32"]
    assert "Reference fp32: world 2 × micro 8, GA 1 — baseline auto:" in proc.stdout and tied in proc.stdout
    for cell in ("script-w1-mb4-ga4", "script-w1-mb8-ga2", "script-w2-mb4-ga2"):
        said = cells_by_id(report)[cell]
        assert said["verdict"] == "diverge" and said["first_divergent_step"] == 0, said
    assert "Noise floor: not measured (noise_floor: false): the tolerances are the dtype's constants" in proc.stdout
    assert "Detection limit: not measured (detection_limit: false)" in proc.stdout


def test_without_auto_the_reference_is_named_out_of_memory_with_the_command_that_fits(tmp_path):
    """Its instruments train its split: not run once it ran out of memory (one failed run, not four)."""
    proc, report, _ = check(tmp_path, "default", "--split", "w1:mb8")
    assert proc.returncode == 3, proc.stdout[-4000:]
    cells = cells_by_id(report)
    for twin in ("script-w1-mb16-ga1-floor0", "script-w1-mb16-ga1-floor1", "script-w1-mb16-ga1-weight1e-02"):
        said = outcome(tmp_path / "default", twin)
        why = "not run: the reference script-w1-mb16-ga1 ran out of memory, and this instrument trains its split"
        assert (said["reason"], said["seconds"]) == (why, 0), said
    assert cells["script-w1-mb16-ga1"]["reason"].startswith("out of memory at micro batch 16 (world 1): rank 0 raised")
    assert (
        cells["script-w1-mb8-ga2"]["reason"]
        == "the reference script-w1-mb16-ga1 ran out of memory: nothing to compare with"
    )
    assert report["fits"] == {"fp32": [2, 8]}
    rerun = next(line for line in proc.stdout.splitlines() if line.startswith("Rerun with a reference that fits: "))
    assert f"gaeq check {SCRIPT} --batch 16 --steps 3 --split w1:mb8 --baseline w2:mb8 --" in rerun
