"""experiments/your_script.yaml's corners: a user's script, unchanged, launched by torchrun in every
cell with gaeq's probe — a world-2 split matches the baseline, and a mistake of each level is caught
at that level (data, events, numbers). (The whole
file, 10 cells, runs in docs/your-setup.md's "Check your own script".)"""

from __future__ import annotations

import pytest

from tests.helpers import cells_by_id

pytestmark = pytest.mark.integration


def test_a_users_script_matches_across_world_sizes_and_its_mistakes_are_caught_where_they_are_made(
    your_script_run,
):
    proc, report, _, _ = your_script_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = cells_by_id(report)
    clean = cells["script-w2-mb4-ga2"]
    assert clean["verdict"] == "match" and 0 < clean["max_abs_loss_diff"] < 1e-5
    # what ran, as the probe saw it in the first optimizer step (never copied from the label)
    assert {k: clean["ran"][k] for k in ("world_size", "micro_batch_rows", "micro_steps")} == {
        "world_size": 2,
        "micro_batch_rows": [4],
        "micro_steps": [2],
    }
    assert clean["divergence_steps"] == dict.fromkeys(
        ("split", "data", "init", "events", "skipped", "loss", "grad_norm", "lr", "update")
    )
    caught = {c["id"].rsplit("args_bug_", 1)[1]: (c["caught_by"], c["first_divergent_step"]) for c in cells.values()
              if "args_bug_" in c["id"]}  # fmt: skip
    assert caught == {
        "sampler_seeded_by_rank": ("data", 0),  # each rank shuffled its own way: other samples
        "clip_every_micro_step": ("events", 0),  # clip_grad_norm_ 3× in a step, the baseline once
        "token_count_averaged_twice": ("loss", 0),  # the objective halved: DDP averaged again
    }
    assert "samples missing" in cells["script-w2-mb4-ga2-args_bug_sampler_seeded_by_rank"]["reason"]


def test_a_users_accelerate_script_matches_and_its_scheduler_stepped_per_process_is_an_event(tmp_path):
    """experiments/your_accelerate_script.yaml's corner: accelerate's own loop and sharding at world 2
    against the baseline, and a prepared scheduler left to accelerate's default (stepped once per
    process per optimizer step) caught by the calls it makes."""
    import yaml

    from tests.conftest import REPO
    from tests.helpers import gaeq_run_here

    spec = yaml.safe_load((REPO / "experiments" / "your_accelerate_script.yaml").read_text())
    spec["script"]["path"] = str(REPO / "experiments" / "scripts" / "accelerate_loop.py")
    spec |= {"steps": 3, "train_batch_size": 16, "noise_floor": False}
    spec["axes"] = {"world_size": [2], "micro_batch_size": [4]}
    spec["cells"] = [{"world_size": 2, "micro_batch_size": 4, "args": ["--bug", "scheduler_per_process"]}]
    spec["cells"][0]["expect"] = "diverge"
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(tmp_path / "mine.yaml", tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = cells_by_id(report)
    assert cells["script-w2-mb4-ga2"]["verdict"] == "match"
    control = cells["script-w2-mb4-ga2-args_bug_scheduler_per_process"]
    assert (control["caught_by"], control["first_divergent_step"]) == ("events", 1), control["reason"]
    assert "scheduler.step() called 2× in optimizer step 1, the baseline 1×" in control["reason"]
