"""experiments/scale.yaml's corner at a million parameters: DeepSpeed ZeRO 0-3 with clipping active.

The false alarm this lab once raised (docs/verdicts.md): an MLP of ~1 M parameters, AdamW, clipping
1.0, where DeepSpeed's ZeRO ≥ 1 sums the grad norm in float64 and torch in float32 — every ZeRO cell
"diverged" although nothing about accumulation was wrong. Now the baseline's norm is float64 and
the twin measures the rest: every split matches, the controls are caught, and the same run judged
by the 3 k-parameter constants alone (the control of this test) still cries wolf.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from gaeq.matrix import Role, load_matrix
from gaeq.results.outcome import read_outcome
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore, cell_dir
from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok
from tests.processes import leftovers

pytestmark = pytest.mark.integration

CELLS = [
    *(
        {"trainer": "deepspeed", "world_size": 2, "micro_batch_size": 2, "zero_stage": z, "variant": "mlp_1m"}
        for z in range(4)
    ),
    {"trainer": "deepspeed", "world_size": 1, "micro_batch_size": 2, "zero_stage": 1, "variant": "mlp_1m"},
    {"trainer": "torch", "world_size": 2, "micro_batch_size": 2, "variant": "mlp_1m"},
    {"trainer": "torch", "micro_batch_size": 2, "bug": "no_loss_division", "variant": "mlp_1m"},
    {"trainer": "torch", "micro_batch_size": 2, "bug": "clip_every_micro_step", "variant": "mlp_1m"},
]


@pytest.fixture(scope="module")
def million_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    spec = yaml.safe_load((REPO / "experiments" / "scale.yaml").read_text())
    spec.pop("axes")
    spec["cells"] = CELLS
    # the rung's model with the data and length of the matrix that once cried wolf (16 → 1024 → 1024 → 4, 8 steps)
    issue = {"data": {"kind": "regression", "in_features": 16, "out_features": 4, "target_scale": 1.0}, "steps": 8}
    spec["variants"] = {"mlp_1m": {"problem": {**spec["variants"]["mlp_1m"]["problem"], **issue}}}
    (tmp / "m.yaml").write_text(yaml.safe_dump(spec))
    proc, report, tag = gaeq_run_here(tmp / "m.yaml", tmp / "run")
    return proc, report, cells_by_id(report), tmp / "run", tag


def test_every_zero_stage_matches_with_clipping_active_and_the_controls_are_caught(million_run):
    proc, report, cells, out, tag = million_run
    assert proc.returncode == 0, not_ok(proc, report)
    assert leftovers(tag) == []
    splits = [c for c in cells.values() if c["bug"] is None and c["role"] == "cell"]
    assert {c["zero_stage"] for c in splits if c["trainer"] == "deepspeed"} == {0, 1, 2, 3}
    assert {c["id"]: c["verdict"] for c in splits} == {c["id"]: "match" for c in splits}
    for c in (c for c in cells.values() if c["bug"]):
        assert c["verdict"] == "diverge" and c["margin"] > 3, c
    base = report["baselines"]["fp32@mlp_1m"]
    assert min(r.grad_norm for r in _trace(out, base)) > 1.0  # clipping is active at every step
    assert report["noise_floors"]["fp32@mlp_1m"]["twins"] == [
        "torch-w1-mb8-ga1-floor0@mlp_1m",
        "torch-w1-mb8-ga1-floor1@mlp_1m",
    ]
    assert "Noise floor fp32@mlp_1m: 2 nudged twin(s) of the baseline drifted" in proc.stdout


def test_each_cell_says_in_which_precision_its_norm_was_summed(million_run):
    _, report, cells, _, _ = million_run
    dtypes = {c["id"]: c["ran"]["grad_norm_dtype"] for c in cells.values()}
    assert dtypes[report["baselines"]["fp32@mlp_1m"]] == "float64"
    for c in cells.values():
        if c["trainer"] == "deepspeed":
            assert dtypes[c["id"]] == ("float32" if c["zero_stage"] == 0 else "float64"), c["id"]
        elif c["role"] != "baseline":
            assert dtypes[c["id"]] == "float32", c["id"]


def test_the_control_judged_by_the_constants_alone_the_same_run_cries_wolf(million_run):
    *_, out, _ = million_run
    matrix = load_matrix(out / "matrix.yaml")
    outcomes = {c.id: read_outcome(cell_dir(out, c.id)) for c in matrix.cells}
    without = judge(dataclasses.replace(matrix, floors={}), outcomes, TraceStore(out))
    false_alarms = [
        c.id for c in without.cells if c.bug is None and c.cell.role == Role.CELL and c.verdict == "diverge"
    ]
    assert false_alarms, "at a million parameters the constants alone should have raised a false alarm"


def _trace(out, cell_id):
    return TraceStore(out).get(cell_id)
