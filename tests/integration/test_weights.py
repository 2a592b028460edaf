"""A verdict without a reference (#68): `baseline: none` judges each split of a user's script by the weight its
targets got in one run of it (gaeq.script.targets, gaeq.script.objective). experiments/scripts/ddp_manual.py,
correct at world 1 and 2 and with a weighting mistake in each split: the correct ones `match`, the planted ones
`diverge` with the mistake named and its fix — no reference, no twins, nothing run twice."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here

pytestmark = pytest.mark.integration


def test_with_no_reference_each_split_is_judged_by_its_targets_weights_and_a_mistake_is_named(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "your_script.yaml").read_text())
    spec["script"]["path"] = str(REPO / "experiments" / "scripts" / "ddp_manual.py")
    spec |= {
        "steps": 2,
        "train_batch_size": 16,
        "baseline": "none",
        "axes": {"world_size": [1, 2], "micro_batch_size": [4]},
    }
    planted = [("mean_of_means", 1), ("mean_of_means", 2), ("no_loss_division", 1), ("token_count_averaged_twice", 2)]
    spec["cells"] = [
        {"world_size": w, "micro_batch_size": 4, "args": ["--bug", bug], "expect": "diverge"} for bug, w in planted
    ]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "m.yaml", tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-4000:]
    cells = cells_by_id(report)
    assert set(cells) == {"script-w1-mb4-ga4", "script-w2-mb4-ga2"} | {
        f"script-w{w}-mb4-ga{4 // w}-args_bug_{bug}" for bug, w in planted
    }  # no reference, no instrument: only the splits ran
    assert report["baseline"] is None and report["references"] == {
        "fp32": "no reference (each split judged by its targets' weights alone)"
    }
    for clean in ("script-w1-mb4-ga4", "script-w2-mb4-ga2"):
        assert cells[clean]["verdict"] == "match" and cells[clean]["weights"]["shape"] == "mean", cells[clean]
        assert cells[clean]["reason"].startswith("judged by its targets' weights alone (no reference")
    named = {i: (c["verdict"], c["weights"]["shape"]) for i, c in cells.items() if "args_bug" in i}
    assert named == {
        "script-w1-mb4-ga4-args_bug_mean_of_means": ("diverge", "micro_batch_means"),
        "script-w2-mb4-ga2-args_bug_mean_of_means": ("diverge", "micro_batch_means"),
        "script-w1-mb4-ga4-args_bug_no_loss_division": ("diverge", "micro_batch_means"),
        "script-w2-mb4-ga2-args_bug_token_count_averaged_twice": ("diverge", "scaled"),
    }
    said = cells["script-w1-mb4-ga4-args_bug_mean_of_means"]["reason"]
    assert "a mean of micro-batch means — divide each micro-batch's summed loss by the step's target count" in said
    assert "not ÷ GA" in cells["script-w1-mb4-ga4-args_bug_no_loss_division"]["weights"]["line"]
    both = "Weights: every target weighs 1/N, the step's target mean, in script-w1-mb4-ga4, script-w2-mb4-ga2"
    assert both in proc.stdout and both in (tmp_path / "run" / "report.md").read_text()
