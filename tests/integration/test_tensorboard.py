"""A real TensorBoard server on 127.0.0.1 shows every cell as a run — what a user's browser sees."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml
from typer.testing import CliRunner

from gaeq.cli import app
from gaeq.matrix import load_matrix
from gaeq.results.tensorboard import ABS_LOSS_DIFF, GRAD_NORM_TOLERANCE, LOG10, LOSS_TOLERANCE, REL_GRAD_NORM_DIFF
from gaeq.runtime.dist import free_port
from tests.helpers import run_in_process, small_spec
from tests.processes import running

pytestmark = pytest.mark.integration


def fetch(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_tensorboard_server_lists_every_cell_with_the_loss_tag(tmp_path):
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [1, 2, 4, 8]},
        cells=[{"trainer": "torch", "micro_batch_size": 2, "bug": "no_loss_division"}],
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "matrix.yaml").write_text(yaml.safe_dump(spec))
    matrix = load_matrix(run_dir / "matrix.yaml")
    run_in_process(matrix, run_dir)
    assert CliRunner().invoke(app, ["report", str(run_dir)]).exit_code == 0
    cells = [c.id for c in matrix.cells]  # the group's noise-floor twins and detection-limit cell are runs too
    assert len(cells) == 6 + 3

    port = free_port()
    server_cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(run_dir / "tb"), "--host", "127.0.0.1",
                  "--port", str(port), "--load_fast", "false", "--reload_interval", "1"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with running(server_cmd, stdout=subprocess.DEVNULL) as server:  # stopped however the test ends
        deadline = time.monotonic() + 90
        runs: list[str] = []
        while sorted(runs) != sorted(cells):
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, f"TensorBoard shows {runs}, expected {cells}"
            time.sleep(0.5)
            try:
                runs = fetch(f"{base}/data/runs")
            except OSError:
                continue
        tags = fetch(f"{base}/data/plugin/scalars/tags")
        assert set(tags) == set(cells)
        assert all("train/loss" in tags[c] and "vs_baseline/abs_loss_diff" in tags[c] for c in cells)
        points = fetch(f"{base}/data/plugin/scalars/scalars?run=torch-w1-mb2-ga8&tag=train/loss")
        assert [p[1] for p in points] == list(range(12))

        # the differences as log10 beside their tolerance: the answer on the default linear axis
        baseline = cells[0]
        assert all({LOG10[ABS_LOSS_DIFF], LOG10[LOSS_TOLERANCE]} <= set(tags[c]) for c in cells if c != baseline)
        assert LOG10[ABS_LOSS_DIFF] not in tags[baseline]  # its differences are exact zeros
        control = "torch-w1-mb2-ga8-bug_no_loss_division"
        diff, tol = (
            {p[1]: p[2] for p in fetch(f"{base}/data/plugin/scalars/scalars?run={control}&tag={tag}")}
            for tag in (LOG10[REL_GRAD_NORM_DIFF], LOG10[GRAD_NORM_TOLERANCE])
        )
        assert diff[0] == pytest.approx(math.log10(7.0), abs=1e-4) and tol[0] < diff[0]  # GA 8: 8× the gradient
        matching = {
            p[1]: p[2] for p in fetch(f"{base}/data/plugin/scalars/scalars?run={cells[2]}&tag={LOG10[ABS_LOSS_DIFF]}")
        }
        assert matching and max(matching.values()) < -5  # a correct split sits orders of magnitude below

        layout = fetch(f"{base}/data/plugin/custom_scalars/layout")
        assert [c["title"] for c in layout["category"]] == ["equivalence", "cost"]
        first = layout["category"][0]["chart"][0]
        assert first["multiline"]["tag"] == [f"^{LOG10[ABS_LOSS_DIFF]}$", f"^{LOG10[LOSS_TOLERANCE]}$"]

        experiment = fetch(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        domains = {h["name"]: h.get("domainDiscrete") for h in experiment["hparamInfos"]}
        assert domains["verdict"] == ["diverge", "match"] and domains["trainer"] == ["torch"]
        sessions = fetch(
            f"{base}/data/plugin/hparams/session_groups",
            {
                "experimentName": "",
                "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
                "colParams": [],
                "startIndex": 0,
                "sliceSize": 100,
            },
        )
        assert sessions["totalSize"] == len(cells)  # one session per cell, no extra hparams runs
