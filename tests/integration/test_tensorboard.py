"""A real TensorBoard server on 127.0.0.1 shows every cell as a run — and the page gaeq's printed link opens, in a
real browser (headless chromium): every cell's difference beside its group's tolerance run."""

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
from gaeq.results.tensorboard import ABS_LOSS_DIFF, LOG10, REL_GRAD_NORM_DIFF, TB_ANSWER_URL
from gaeq.runtime.dist import free_port
from tests.browser import browser, missing
from tests.helpers import run_in_process, small_spec
from tests.processes import running

pytestmark = pytest.mark.integration


def fetch(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A judged run of 6 cells and 3 instruments, TensorBoard serving it: (its cells, the server's address)."""
    tmp_path = tmp_path_factory.mktemp("tensorboard")
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
    runs = [*cells, "tolerance-fp32"]  # and the group's tolerance, once

    port = free_port()
    server_cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(run_dir / "tb"), "--host", "127.0.0.1",
                  "--port", str(port), "--load_fast", "false", "--reload_interval", "1"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with running(server_cmd, stdout=subprocess.DEVNULL) as server:  # stopped however the test ends
        deadline = time.monotonic() + 90
        shown: list[str] = []
        while sorted(shown) != sorted(runs):
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, f"TensorBoard shows {shown}, expected {runs}"
            time.sleep(0.5)
            try:
                shown = fetch(f"{base}/data/runs")
            except OSError:
                continue
        yield cells, base


def test_tensorboard_server_lists_every_cell_with_the_loss_tag(served):
    cells, base = served
    tags = fetch(f"{base}/data/plugin/scalars/tags")
    assert set(tags) == {*cells, "tolerance-fp32"}
    assert all("train/loss" in tags[c] and "vs_baseline/abs_loss_diff" in tags[c] for c in cells)
    points = fetch(f"{base}/data/plugin/scalars/scalars?run=torch-w1-mb2-ga8&tag=train/loss")
    assert [p[1] for p in points] == list(range(12))

    # the differences as log10 beside the group's tolerance, under the same tag: one card holds both
    baseline = cells[0]
    assert all(LOG10[ABS_LOSS_DIFF] in tags[c] for c in cells if c != baseline)
    assert LOG10[ABS_LOSS_DIFF] not in tags[baseline]  # its differences are exact zeros
    assert set(tags["tolerance-fp32"]) == {ABS_LOSS_DIFF, REL_GRAD_NORM_DIFF, *LOG10.values()}
    control = "torch-w1-mb2-ga8-bug_no_loss_division"
    diff, tol = (
        {p[1]: p[2] for p in fetch(f"{base}/data/plugin/scalars/scalars?run={run}&tag={LOG10[REL_GRAD_NORM_DIFF]}")}
        for run in (control, "tolerance-fp32")
    )
    assert diff[0] == pytest.approx(math.log10(7.0), abs=1e-4) and tol[0] < diff[0]  # GA 8: 8× the gradient
    matching = {
        p[1]: p[2] for p in fetch(f"{base}/data/plugin/scalars/scalars?run={cells[2]}&tag={LOG10[ABS_LOSS_DIFF]}")
    }
    assert matching and max(matching.values()) < -5  # a correct split sits orders of magnitude below

    layout = fetch(f"{base}/data/plugin/custom_scalars/layout")
    assert [c["title"] for c in layout["category"]] == ["equivalence", "cost"]
    first = layout["category"][0]["chart"][0]
    assert first["multiline"]["tag"] == [f"^{LOG10[ABS_LOSS_DIFF]}$"]

    experiment = fetch(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
    domains = {h["name"]: h.get("domainDiscrete") for h in experiment["hparamInfos"]}
    assert domains["verdict"] == ["diverge", "match"] and domains["trainer"] == ["torch"]
    assert domains["role"] == ["baseline", "cell", "floor", "sensitivity"]  # an instrument says it is one
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


def test_the_printed_link_in_a_real_browser_draws_every_cells_difference_beside_its_tolerance(served, tmp_path):
    """The link gaeq prints, opened in headless chromium as a user opens it — its Settings as the printed line says
    (Ignore outliers unticked) and drawn as SVG (no GPU here: WebGL would draw nothing): two cards, the log10
    differences, each with every cell that has that difference and the tolerance run, every run listed and
    selected. A screenshot is kept beside the test's output (`tensorboard.png`)."""
    if (why := missing()) is not None:
        pytest.skip(why)
    cells, base = served
    url = TB_ANSWER_URL.replace("http://localhost:6006/?", f"{base}/?forceSVG=true&")
    drawn = [c for c in cells if c != cells[0]] + ["tolerance-fp32"]  # (the baseline's differences are zeros)
    with browser() as page:
        page.open(url)
        page.run("localStorage.setItem('_tb_global_settings', JSON.stringify({ignoreOutliers: false}));")
        page.open(url)
        cards = page.until(
            "const cards = [...document.querySelectorAll('scalar-card')].map(c => [c.querySelector('.tag')"
            "?.textContent.trim(), c.querySelectorAll('.series-view svg path').length]);"
            f"return cards.length === 2 && cards.every(([, n]) => n >= {len(drawn)}) ? cards : null;",
            seconds=90,
        )
        listed = page.run(
            "return [...document.querySelectorAll('tb-data-table-content-row[data-id]')].map(r => r.dataset.id);"
        )
        shot = page.screenshot()
    (tmp_path / "tensorboard.png").write_bytes(shot)
    assert cards and sorted(tag for tag, _ in cards) == sorted(LOG10.values()), cards
    assert {i.split("/", 1)[1] for i in listed} >= {*cells, "tolerance-fp32"}, listed  # every run selectable
    from matplotlib.image import imread

    pixels = imread(tmp_path / "tensorboard.png")
    assert pixels.shape[0] >= 900 and pixels.shape[1] >= 1500  # the window, less its own frame
    import numpy as np

    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 200  # curves in many colours
