"""experiments/libraries.yaml: the libraries people train with against plain full-batch training.
accelerate's own loop matches the manual one at world 1 and 2, GA 1–6, on the GPT and on a
transformers Llama with its own loss; each library trap is caught where the note says, and the
report names the library versions it certifies."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here

pytestmark = pytest.mark.integration


# The experiment's accelerate cells at GA 6 and 1..3, both problems, and all its traps (the whole file,
# 30 cells, runs in the README; here its corners, to keep the suite's time).
CELLS = [
    {"trainer": "accelerate", "world_size": 1, "micro_batch_size": 4},
    {"trainer": "accelerate", "world_size": 2, "micro_batch_size": 4},
    {"trainer": "accelerate", "world_size": 2, "micro_batch_size": 12},
    {"trainer": "accelerate", "world_size": 2, "micro_batch_size": 4, "variant": "llama"},
]


def test_libraries_experiment(tmp_path):
    spec = yaml.safe_load((REPO / "experiments" / "libraries.yaml").read_text())
    spec.pop("axes")
    spec["cells"] = CELLS + spec["cells"]
    matrix, out = tmp_path / "libraries.yaml", tmp_path / "run"
    matrix.write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(matrix, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cells = cells_by_id(report)
    twins = [c for c in cells.values() if c["bug"] is None]
    assert len(twins) == 6 and all(c["verdict"] == "match" for c in twins)  # with the two baselines
    accelerate = [c for c in twins if c["trainer"] == "accelerate"]
    assert {(c["world_size"], c["grad_accum_steps"]) for c in accelerate} == {(1, 6), (2, 3), (2, 1)}
    for c in accelerate:
        assert c["max_abs_loss_diff"] < 1e-5, c  # measured ≤ 7.2e-7
        ran = c["ran"]  # what accelerate really ran: its GA, DDP, its scheduler stepped by us once per step
        assert (ran["grad_accum_steps"], ran["ddp"], ran["scheduler_steps_with_optimizer"]) == (c["grad_accum_steps"], True, False), ran
    assert cells["accelerate-w2-mb4-ga3@llama"]["ran"]["model"] == "LlamaForCausalLM"

    def caught(cell_id):
        c = cells[cell_id]
        return c["verdict"], c["divergence_steps"]

    # accelerate's default scheduler stepping: world × too fast — the lr itself differs from step 1.
    verdict, steps = caught("accelerate-w2-mb4-ga3-bug_accelerate_scheduler_per_process")
    assert verdict == "diverge" and steps["lr"] == 1
    # ÷ GA by hand and again in accelerator.backward: GA = 6 times too small a gradient.
    c = cells["accelerate-w1-mb4-ga6-bug_accelerate_loss_divided_twice"]
    assert (c["caught_by"], c["first_divergent_step"]) == ("grad_norm", 0)
    assert c["max_rel_grad_norm_diff"] == pytest.approx(5 / 6, rel=1e-3)
    for cell_id in ("accelerate-w2-mb4-ga3-bug_mean_of_means", "accelerate-w2-mb4-ga3-bug_hf_num_items_per_micro_batch@llama"):
        c = cells[cell_id]
        assert (c["verdict"], c["caught_by"], c["first_divergent_step"]) == ("diverge", "grad_norm", 0), c

    versions = json.loads((out / "versions.json").read_text())
    assert versions["accelerate"] == metadata.version("accelerate") and versions["transformers"] == metadata.version("transformers")
    assert report["versions"] == versions
    assert f"accelerate {versions['accelerate']}" in (out / "report.md").read_text()
    assert f"Versions: torch {versions['torch']}" in proc.stdout
