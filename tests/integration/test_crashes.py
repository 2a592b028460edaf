"""A rank of a user's script that crashes in native code — a segmentation fault, as a bug in a library's
C++ dies — is named, with the signal that killed it and where each of its threads was; the reset
connection its peer then reports is not taken for the cause. (gaeq's own ranks: tests/integration/
test_run.py, its `crash` fault.)"""

from __future__ import annotations

import textwrap

import pytest
import yaml

from tests.helpers import cells_by_id, gaeq_run_here

pytestmark = pytest.mark.integration

SCRIPT = """
import argparse, ctypes
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--mb", type=int)
a = p.parse_args()
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
world, rank = dist.get_world_size(), dist.get_rank()
for step in range(3):
    rows = x[step % 2 * 8 :][rank * a.mb : (rank + 1) * a.mb]
    (model(rows) ** 2).sum().div(8).backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
    if step == 1 and rank == 1:
        ctypes.string_at(0)  # a bad pointer, read in native code
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_scripts_rank_that_crashes_is_named_with_its_signal_and_where_it_was(tmp_path):
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    matrix = {
        "name": "crash",
        "script": {"path": str(tmp_path / "train.py"), "args": ["--mb", "{micro_batch_size}"]},
        "steps": 3,
        "train_batch_size": 8,
        "noise_floor": False,
        "detection_limit": False,
        "axes": {"world_size": [2], "micro_batch_size": [4]},
    }
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(matrix))
    proc, report, _ = gaeq_run_here(tmp_path / "m.yaml", tmp_path / "run")
    cells = cells_by_id(report)
    assert cells["script-w1-mb8-ga1"]["verdict"] == "match"  # the baseline, one rank: it never crashes
    crashed = cells["script-w2-mb4-ga1"]
    assert crashed["verdict"] == "error" and proc.returncode == 3
    reason = crashed["reason"]
    # rank 1 is the cause: rank 0's probe, gathering step 0 over the ranks at step 1's boundary, then fails
    # with a reset connection — not gaeq's failure, and not a loop that never stepped
    assert reason.startswith(
        "the script's rank 1 was killed by SIGSEGV (signal 11: a crash in native code, its Python stack in its "
        "log) before gaeq's probe recorded an optimizer step\n"
    ), reason
    assert "Connection reset by peer" in reason or "Connection closed by peer" in reason  # rank 0's log
    crash = reason[reason.index("--- script-rank1.log (its crash report) ---") :].splitlines()
    assert crash[1:3] == ["Fatal Python error: Segmentation fault", crash[2]] and crash[2].startswith("Current thread")
    assert "in string_at" in crash[3] and 'train.py", line 21 in <module>' in crash[4], crash
