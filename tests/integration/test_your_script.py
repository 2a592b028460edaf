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
