"""The GPU check (benchmarks/gpu_check.sh) cannot rot between its runs on a GPU: its CPU dry run — every
phase, at its smallest — runs here and must say OK; a baseline trained twice is judged against the
tolerance its verdicts used (a planted difference beyond it is wrong); and the wheel folder its
`--prepare` half makes installs gaeq and what a CUDA image lacks without a registry, into a folder of
its own, from which they are imported."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO
from tests.processes import run

pytestmark = pytest.mark.integration

CHECK = REPO / "benchmarks" / "gpu_check.sh"
LACKED = ("gaeq", "deepspeed", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "hjson")
"""What the GPU image lacks (docs/where-it-runs.md), each to be imported from the wheels' folder."""


def test_the_gpu_checks_cpu_dry_run_says_ok_with_every_phase(tmp_path, monkeypatch):
    """Every phase, the speed phase's bare loops against gaeq's trainers (benchmarks/gpu_speed.py) too."""
    monkeypatch.setenv("GAEQ_ACCELERATOR_FP16", "yes")  # its fp16 cells run (emulated here), not skipped
    proc = run([str(CHECK), "--cpu", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["phases"]) == ["equivalence", "repeat", "script", "speed"]
    assert all(not phase.get("wrong") for phase in report["phases"].values())
    cells = {c["id"]: c for c in report["phases"]["equivalence"]["cells"]}
    controls = [c for c in cells.values() if c["bug"]]
    assert len(controls) == 2 and all(c["verdict"] == "diverge" for c in controls)  # planted: caught
    assert {c["dtype"] for c in cells.values()} == {"fp32", "bf16", "fp16", "ds_fp16"}
    assert not any(c["verdict"] in ("skipped", "error") for c in cells.values())
    assert set(report["phases"]["repeat"]["groups"]) == {"fp32", "bf16@bf16", "fp16@fp16", "ds_fp16@ds_fp16"}
    script = {c["id"]: c["verdict"] for c in report["phases"]["script"]["cells"]}
    assert script["script-w1-mb4-ga8"] == "match" and script["script-w1-mb4-ga8-args_bug_mean_of_means"] == "diverge"
    assert script["script-w1-mb4-ga8-bf16"] == "match"  # a bf16-autocast script as trained,
    assert script["script-w1-mb4-ga8-args_bug_mean_of_means"] == "diverge"  # its mistake caught made float32
    assert report["phases"]["script"]["script_fsdp2_summary"]["match"] == 1  # an FSDP2 script at GA 8
    assert {"torch", "deepspeed"} <= set(report["phases"]["speed"])
    summary = (tmp_path / "summary.txt").read_text()
    assert "CPU dry run" in summary and summary.strip().endswith("OK")
    assert "## speed" in (tmp_path / "report.md").read_text()


def test_the_dry_run_says_ok_on_a_cpu_without_fp16(tmp_path, monkeypatch):
    """A CPU whose DeepSpeed accelerator answers no to fp16 (an AMD EPYC; forced here, whatever this one
    is): the fp16 groups are skipped with that reason, their baselines have nothing to repeat — said, not
    counted wrong — and the check says OK. (The phases fp16 touches: the script and speed phases train no
    fp16 cell.)"""
    monkeypatch.setenv("GAEQ_ACCELERATOR_FP16", "no")
    proc = run([str(CHECK), "--cpu", str(tmp_path), "--phases", "equivalence,repeat"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    groups = report["phases"]["repeat"]["groups"]
    assert "skipped" in groups["fp16@fp16"] and "skipped" in groups["ds_fp16@ds_fp16"]
    assert "skipped" not in groups["fp32"] and list(report["phases"]) == ["equivalence", "repeat"]
    assert (tmp_path / "summary.txt").read_text().strip().endswith("OK")


def test_a_baseline_trained_twice_is_judged_against_the_tolerance_its_verdicts_used():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check import twice

    from gaeq.results.trace import StepRecord

    def trace(*losses):
        return [
            StepRecord(step=i, loss=x, grad_norm=1.0, lr=1e-3, samples=32, seconds=0.1) for i, x in enumerate(losses)
        ]

    tolerance = {"loss_atol": 1e-6, "loss_rtol": 0.0, "grad_norm_rtol": 1e-5}
    same = twice(trace(2.0, 1.5), trace(2.0, 1.5), tolerance, {})
    assert same["bitwise"] and not same["beyond"]
    nearly = twice(trace(2.0, 1.5), trace(2.0, 1.5 + 3e-6), tolerance, {"max_abs_loss_diff": 5e-7})  # floor × 10
    assert not nearly["bitwise"] and not nearly["beyond"] and nearly["tolerance_loss"] == pytest.approx(5e-6)
    planted = twice(trace(2.0, 1.5), trace(2.0, 1.5 + 3e-6), tolerance, {})  # the constant alone: beyond it
    assert planted["beyond"]


def test_the_prepared_wheels_install_gaeq_and_what_a_cuda_image_lacks_without_a_registry(tmp_path):
    python = f"{sys.version_info.major}.{sys.version_info.minor}"  # this interpreter's, to import them here
    wheels = tmp_path / "wheels"
    proc = run([str(CHECK), "--prepare", str(wheels), "--python", python], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum(f.stat().st_size for f in wheels.iterdir()) < 64 * 2**20
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
    installed = run([*install, *map(str, wheels.glob("*.whl"))], timeout=300)
    assert installed.returncode == 0, installed.stderr[-3000:]
    where = "import importlib, json; print(json.dumps({m: importlib.import_module(m).__file__ for m in %r}))" % (
        list(LACKED),
    )
    env = os.environ | {"PYTHONPATH": str(site), "PIP_NO_INDEX": "1"}
    found = run([sys.executable, "-c", where], env=env, cwd=tmp_path, timeout=300)  # not the checkout's gaeq
    assert found.returncode == 0, found.stderr[-3000:]
    imported = json.loads(found.stdout.splitlines()[-1])  # (DeepSpeed prints its accelerator first)
    assert all(path.startswith(str(site)) for path in imported.values()), found.stdout
    validated = run([sys.executable, "-m", "gaeq", "validate", str(REPO / "experiments" / "gpu.yaml")], env=env,
                    cwd=tmp_path, timeout=300)  # fmt: skip
    assert validated.returncode == 0 and "gpu: " in validated.stdout, validated.stdout[-2000:] + validated.stderr
