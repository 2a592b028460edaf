"""A user's script as it trains today — bf16 autocast, fp16 with a loss scaler that skips steps, FSDP2 —
judged right: every correct split matches, labelled with the arithmetic that ran, and each planted mistake
is caught where it changes the optimisation (experiments/your_amp_script.yaml, your_fp16_script.yaml,
your_fsdp2_script.yaml, each run whole: every split). The float32 run of a mixed-precision script (dtype
fp32: its autocast and loss scaler switched off) is what catches a small mistake bf16's rounding hides."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, not_ok

pytestmark = pytest.mark.integration


def run(tmp_path_factory, experiment: str, **changes) -> tuple:
    spec = yaml.safe_load((REPO / "experiments" / experiment).read_text())
    spec |= changes
    spec["script"]["path"] = str(REPO / "experiments" / spec["script"]["path"])
    out = tmp_path_factory.mktemp(experiment.removesuffix(".yaml"))
    (out / "m.yaml").write_text(yaml.safe_dump(spec))
    proc, report, _ = gaeq_run_here(out / "m.yaml", out / "run")
    return proc, report, out / "run"


@pytest.fixture(scope="module")
def amp(tmp_path_factory):
    return run(tmp_path_factory, "your_amp_script.yaml")


@pytest.fixture(scope="module")
def fp16(tmp_path_factory):
    return run(tmp_path_factory, "your_fp16_script.yaml")


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return run(tmp_path_factory, "your_fsdp2_script.yaml")


def judged(cells: list[dict]) -> list[dict]:
    """The matrix's own cells and baselines (the instruments left out)."""
    return [c for c in cells if c["role"] in ("cell", "baseline")]


def clean(report: dict, dtype: str) -> list[dict]:
    return [c for c in judged(report["cells"]) if c["dtype"] == dtype and "_bug_" not in c["id"]]


def test_a_bf16_autocast_script_matches_in_every_split_labelled_with_what_ran(amp):
    proc, report, _ = amp
    assert proc.returncode == 0, not_ok(proc, report)
    for cell in clean(report, "bf16"):
        assert cell["verdict"] == "match", cell["reason"]
        assert cell["ran"]["precision"]["autocast"] == "bfloat16" and cell["ran"]["compute_dtype"] == "bfloat16"
    # judged by bf16's constants and a floor measured in bf16: the twins nudge by a bfloat16 unit
    assert report["tolerances"]["bf16"]["grad_norm_rtol"] == 2e-2
    assert report["noise_floors"]["bf16"]["max_rel_grad_norm_diff"] > 1e-5  # fp32's nudge moved it ~1e-8
    # the same script made float32: autocast switched off, said in what ran
    for cell in clean(report, "fp32"):
        assert cell["verdict"] == "match", cell["reason"]
        assert cell["ran"]["precision"]["switched_off"] == ["autocast bf16 (cpu)"]
        assert cell["ran"]["compute_dtype"] == "float32"


def test_a_mean_of_means_in_every_split_is_caught_by_the_float32_run_and_as_trained_by_its_weights(amp):
    proc, report, _ = amp
    cells = [c for c in report["cells"] if "args_bug_mean_of_means" in c["id"]]
    as_fp32 = [c for c in cells if c["dtype"] == "fp32"]
    assert len(as_fp32) == 4 and all(c["verdict"] == "diverge" for c in as_fp32)
    # bf16's rounding hides a mistake this small from the numbers (its detection limit ~5e-2, the float32 run's
    # ~2e-5); its weights, read at the loss's float32 cast, name it — and say the loss still matches
    limits = report["detection_limits"]
    assert limits["fp32"]["limit"] < 1e-4 < 1e-2 < limits["bf16"]["limit"]
    for c in (c for c in cells if c["dtype"] == "bf16"):
        assert (c["verdict"], c["caught_by"], c["divergence_steps"]["loss"]) == ("diverge", "weights", None), c
        assert (
            c["reason"].startswith("its targets' weights are tied to its split:") and "(the loss still" in c["reason"]
        )
        assert "(read to ±8e-06 of each weight: float32 at the loss's cast)" in c["weights"]["line"]
    assert "Precision: accumulation (float32): 4 match, 4 diverge" in proc.stdout
    assert "as trained (bf16): 4 match, 4 diverge" in proc.stdout
    # the same mistake named from each split's own weights: by micro-batch at GA > 1, by rank where a rank's
    # batch is one micro-batch (w2, GA 1) — and every correct split the step's target mean
    assert {c["id"]: c["weights"]["shape"] for c in as_fp32} == {
        "script-w1-mb4-ga8-args_bug_mean_of_means": "micro_batch_means",
        "script-w1-mb16-ga2-args_bug_mean_of_means": "micro_batch_means",
        "script-w2-mb4-ga4-args_bug_mean_of_means": "micro_batch_means",
        "script-w2-mb16-ga1-args_bug_mean_of_means": "rank_means",
    }
    assert all(c["weights"]["shape"] == "mean" for c in clean(report, "fp32") + clean(report, "bf16"))
    said = "Weights: script-w1-mb4-ga8-args_bug_mean_of_means, script-w2-mb4-ga4-args_bug_mean_of_means: targets weigh"
    assert f"{said} 1/(GA · n_k) by micro-batch k" in proc.stdout.replace("\n", " ")  # (the same words: one line)


def test_an_fp16_script_whose_first_steps_overflow_matches_with_its_skipped_steps(fp16):
    proc, report, _ = fp16
    assert proc.returncode == 0, not_ok(proc, report)
    for cell in clean(report, "fp16"):
        assert cell["verdict"] == "match", cell["reason"]
        assert cell["ran"]["precision"]["loss_scaler"] == "GradScaler"
    for cell in clean(report, "fp32"):
        assert cell["verdict"] == "match"
        assert sorted(cell["ran"]["precision"]["switched_off"]) == ["GradScaler", "autocast fp16 (cpu)"]
    caught = {c["id"]: c["caught_by"] for c in report["cells"] if "args_bug" in c["id"]}
    assert caught == {
        "script-w1-mb4-ga8-fp16-args_bug_no_loss_division": "loss",
        "script-w2-mb4-ga4-fp16-args_bug_token_count_averaged_twice": "loss",
    }


def test_skipped_steps_are_steps_of_the_trace(fp16):
    import json

    _, report, run_dir = fp16
    for cell in clean(report, "fp16"):
        probe = json.loads((run_dir / "cells" / cell["id"] / "probe.json").read_text())
        # the script's 8 loop iterations, its first 2 updates skipped (GradScaler found inf), in every split
        assert [s["skipped"] for s in probe["steps"]] == [True, True] + [False] * 6, cell["id"]


def test_with_the_default_backoff_a_split_skips_other_steps_and_says_so(tmp_path_factory):
    """GradScaler's default backoff (× 0.5) from 2^24: which steps overflow depends on the split. Each
    split is the baseline's optimisation or diverges by its skipped steps, said as such; its float32
    run matches."""
    spec = yaml.safe_load((REPO / "experiments" / "your_fp16_script.yaml").read_text())
    spec["script"]["args"][-3:] = ["16777216", "--backoff", "0.5"]
    proc, report, _ = run(
        tmp_path_factory, "your_fp16_script.yaml", script=spec["script"], cells=[], noise_floor=False,
        detection_limit=False, axes=spec["axes"] | {"world_size": [1, 2], "micro_batch_size": [4]},
    )  # fmt: skip
    cells = judged(report["cells"])
    fp16 = [c for c in cells if c["dtype"] == "fp16" and c["role"] == "cell"]
    assert fp16 and all(c["verdict"] == "match" or c["caught_by"] == "skipped" for c in fp16), proc.stdout
    for c in fp16:
        if c["verdict"] == "diverge":
            assert "GradScaler skips a step when any micro-batch's fp16 gradient overflows" in c["reason"]
    assert any(c["verdict"] == "diverge" for c in fp16)  # measured: 2 of 2 here (docs/your-setup.md)
    assert all(c["verdict"] == "match" for c in cells if c["dtype"] == "fp32")


def test_an_fsdp2_script_matches_and_its_mistakes_are_caught_where_they_change_the_optimisation(fsdp2):
    proc, report, _ = fsdp2
    assert proc.returncode == 0, not_ok(proc, report)
    cells = cells_by_id(report)
    for cell in clean(report, "fp32"):  # HSDP (--replicas 2) among them
        assert cell["verdict"] == "match", cell["reason"]
        assert cell["ran"]["precision"]["switched_off"] == ["FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16)"]
    # as it trains: its parameters stay float32 DTensors, its modules compute in bf16 — labelled so
    for cell in clean(report, "bf16"):
        assert cell["verdict"] == "match", cell["reason"]
        assert cell["ran"]["precision"]["parameters"] == ["float32"]
        assert cell["ran"]["compute_dtype"] == "bfloat16"
    assert "script-w2-mb4-ga4-bf16-args_replicas_2" in cells
    # the grad norm at world 2 is the whole model's (each rank holds half of every gradient): a norm of the
    # local shards only would be ~1/√2 of the baseline's; HSDP's replicas hold the same block (not summed)
    assert cells["script-w2-mb4-ga4"]["max_rel_grad_norm_diff"] < 1e-6
    assert cells["script-w2-mb4-ga4-args_replicas_2"]["max_rel_grad_norm_diff"] < 1e-6
    caught = {i: (c["verdict"], c["caught_by"]) for i, c in cells.items() if "_bug_" in i}
    assert caught == {
        "script-w1-mb4-ga8-args_bug_loss_not_scaled_for_reduction": ("match", None),  # one rank: nothing averaged
        "script-w2-mb4-ga4-args_bug_loss_not_scaled_for_reduction": ("diverge", "loss"),
        "script-w2-mb16-ga1-args_bug_loss_not_scaled_for_reduction": ("diverge", "loss"),
        "script-w1-mb4-ga8-args_bug_clip_norm_of_local_shards": ("match", None),  # one rank holds every shard
        "script-w2-mb4-ga4-args_bug_clip_norm_of_local_shards": ("diverge", "update"),
        "script-w2-mb16-ga1-args_bug_clip_norm_of_local_shards": ("diverge", "update"),
        # the clip written by hand (an FSDP2 shard scaled in place: seen), its per-shard mistake caught by the update
        "script-w1-mb4-ga8-args_clip_by_hand_bug_clip_by_hand_per_shard": ("match", None),
        "script-w2-mb4-ga4-args_clip_by_hand_bug_clip_by_hand_per_shard": ("diverge", "update"),
        "script-w2-mb16-ga1-args_clip_by_hand_bug_clip_by_hand_per_shard": ("diverge", "update"),
    }
    # the baseline's norm read before torch's clip, a hand clip's after its own: not compared, and said why
    assert "changed in place after its last backward" in cells["script-w2-mb4-ga4-args_clip_by_hand"]["reason"]


def test_a_deepspeed_bf16_script_matches_within_its_losses_resolution_and_its_mistake_is_caught(tmp_path_factory):
    """DeepSpeed's bf16 engine, its config's section on: labelled ds_bf16 from the engine; made float32 by
    the config gaeq writes; its losses (computed from bf16 logits) compared within their own resolution."""
    spec = yaml.safe_load((REPO / "experiments" / "your_deepspeed_bf16_script.yaml").read_text())
    spec["script"]["deepspeed_config"] = str(REPO / "experiments" / spec["script"]["deepspeed_config"])
    proc, report, run_dir = run(tmp_path_factory, "your_deepspeed_bf16_script.yaml", script=spec["script"])
    assert proc.returncode == 0, not_ok(proc, report)
    for cell in clean(report, "ds_bf16"):
        assert cell["verdict"] == "match" and cell["ran"]["precision"]["deepspeed"] == "bf16"
    for cell in clean(report, "fp32"):
        assert cell["verdict"] == "match", cell["reason"]
        assert cell["ran"]["precision"]["switched_off"] == ["DeepSpeed bf16 section"]
    control = cells_by_id(report)["script-w2-mb4-ga4-ds_bf16-args_bug_loss_divided_twice"]
    assert (control["verdict"], control["caught_by"]) == ("diverge", "loss")
    assert "÷ GA (4) twice" in control["weights"]["line"]  # DeepSpeed's backward ÷ GA, and the script's own
    assert all(c["weights"]["shape"] == "mean" for c in clean(report, "fp32"))
    for c in clean(report, "ds_bf16"):  # its loss on the bf16 logits: weights known to a few per cent, no shape named
        assert c["weights"]["shape"] == "unresolved" and 1e-3 < c["weights"]["resolution"] < 0.1, c["weights"]
    assert "of the losses' own bf16/fp16 resolution" in control["reason"]
    # the resolution is the split's own: half a bf16 unit of each value handed to backward (8 at GA 8)
    from gaeq.results.trace import read_trace

    base, split = (
        read_trace(run_dir / "cells" / c) for c in ("script-w1-mb32-ga1-ds_bf16", "script-w1-mb4-ga8-ds_bf16")
    )
    assert 0 < base[0].loss_resolution < split[0].loss_resolution < 0.02


def test_a_failure_of_gaeqs_probe_is_said_as_gaeqs(tmp_path):
    """A failure planted in the probe's own code (its fingerprint of the weights raises): the cell is an
    error that says gaeq's probe failed and where — never a guess about the script's loop."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import gaeq.script.probe as probe

            def broken(params):
                raise ZeroDivisionError("planted")

            probe.fingerprint = broken  # the probe's own code raises at the first optimizer step
            model = torch.nn.Linear(4, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                model(torch.ones(8, 4)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            """
        )
    )
    (tmp_path / "m.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "planted",
                "script": {"path": str(script)},
                "steps": 3,
                "train_batch_size": 8,
                "noise_floor": False,
                "detection_limit": False,
                "axes": {"world_size": [1], "micro_batch_size": [8]},
            }
        )
    )
    proc, report, _ = gaeq_run_here(tmp_path / "m.yaml", tmp_path / "run")
    (cell,) = report["cells"]
    assert cell["verdict"] == "error"
    assert cell["reason"].startswith(
        "gaeq's probe failed on rank 0: ZeroDivisionError: planted (at gaeq/script/probe.py:"
    ), cell["reason"]
    assert "no optimizer step seen" not in cell["reason"]
    # the control: the same failure raised by the script's own code is the script's
    script.write_text(script.read_text().replace("probe.fingerprint = broken", "broken(None)"))
    proc, report, _ = gaeq_run_here(tmp_path / "m.yaml", tmp_path / "run2")
    (cell,) = report["cells"]
    assert cell["verdict"] == "error" and "gaeq's probe failed" not in cell["reason"]
    assert "ZeroDivisionError: planted" in cell["reason"]  # the script's log tail


def test_a_deepspeed_fp16_engines_skipped_steps_are_steps(tmp_path_factory, monkeypatch):
    """DeepSpeed's fp16 engine from a loss scale of 2^23: its first 3 steps overflow and are skipped (the
    engine counts them in skipped_steps; its client optimizer never steps) — the same steps in every split,
    each recorded `skipped`, the objective read without the engine's loss scale. Before, the probe saw no
    step there and the cell was an error. (DeepSpeed's fp16 on this CPU: forced, emulated.)"""
    import json

    monkeypatch.setenv("GAEQ_ACCELERATOR_FP16", "yes")
    spec = yaml.safe_load((REPO / "experiments" / "your_deepspeed_bf16_script.yaml").read_text())
    spec["script"]["deepspeed_config"] = str(REPO / "experiments" / "scripts" / "ds_config_fp16.json")
    spec["axes"]["dtype"] = ["fp32", "ds_fp16"]
    proc, report, run_dir = run(
        tmp_path_factory, "your_deepspeed_bf16_script.yaml", script=spec["script"], axes=spec["axes"], cells=[],
        steps=6, detection_limit=False,
    )  # fmt: skip
    cells = [c for c in judged(report["cells"]) if c["dtype"] == "ds_fp16"]
    assert len(cells) == 3 and all(c["verdict"] in ("match", "diverge") for c in cells), proc.stdout[-3000:]
    fp32 = json.loads((run_dir / "cells" / "script-w1-mb32-ga1" / "probe.json").read_text())["steps"]
    for cell in cells:
        assert cell["ran"]["precision"]["loss_scaler"] == "DeepSpeed fp16"
        steps = json.loads((run_dir / "cells" / cell["id"] / "probe.json").read_text())["steps"]
        assert [s["skipped"] for s in steps] == [True] * 3 + [False] * 3, cell["id"]
        assert abs(steps[0]["objective"] - fp32[0]["objective"]) < 1e-2  # unscaled: not × 2^23
        assert cell["max_rel_grad_norm_diff"] < 1e-3  # the norms of the steps that updated
    assert all(c["verdict"] == "match" for c in judged(report["cells"]) if c["dtype"] == "fp32")
