"""experiments/zero.yaml: ZeRO 0-3 × offload × dtype, parameters and gradients compared tensor by tensor."""

from __future__ import annotations

import math

import pytest

from gaeq.accelerator import NVME_ENABLE, fp16_unsupported_reason, nvme_unsupported_reason
from gaeq.results.compare import DEFAULT_TOLERANCES
from gaeq.results.snapshots import compare_snapshots, read_snapshots
from tests.conftest import REPO
from tests.helpers import cells_by_id, gaeq_run_here, leftover_processes

pytestmark = pytest.mark.integration


def test_zero_experiment(tmp_path):
    out = tmp_path / "run"
    proc, report, tag = gaeq_run_here(REPO / "experiments" / "zero.yaml", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = cells_by_id(report)

    # fp16 runs where DeepSpeed's accelerator has it (or GAEQ_FP16_EMULATION=1), nvme offload where
    # DeepSpeed's async-I/O op can be built (libaio): ask them, as gaeq does.
    fp16_missing, nvme_missing = fp16_unsupported_reason(), nvme_unsupported_reason()
    ran = [c for c in cells.values() if c["verdict"] != "skipped" and c["bug"] is None]
    assert len(ran) == (37 if fp16_missing else 54) + (4 if nvme_missing else 8) and all(c["verdict"] == "match" for c in ran)
    for c in ran:  # every label is what ran, read back from the live objects
        assert c["ran"]["compute_dtype"] == {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[c["dtype"]], c
        if c["trainer"] == "deepspeed":
            assert (c["ran"]["zero_stage"], c["ran"]["cpu_offload"]) == (c["zero_stage"], c["offload"] == "cpu"), c
        if c["trainer"] == "fsdp":  # FSDP2 really sharded: DTensor parameters under an FSDPModule
            assert (c["ran"]["fsdp"], c["ran"]["sharded_parameters"]) == (True, True), c
    fp32 = [c for c in ran if c["dtype"] == "fp32" and c["id"] not in report["baselines"].values()]
    assert {(c["zero_stage"], c["offload"]) for c in fp32 if c["trainer"] == "deepspeed"} == {
        (0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), (3, "none"), (3, "cpu"), *(() if nvme_missing else ((3, "nvme"),))
    }
    for c in fp32:  # torch's AdamW on both sides: float summation order only
        assert 0 < c["max_abs_param_diff"] < 1e-6 and 0 < c["max_abs_grad_diff"] < 1e-6, c

    # ZeRO-3 offloading to files (the nvme variant: a model wide enough for DeepSpeed to swap, 1 MiB+
    # tensors): every cell matches, really wrote its swap files, and removed them when it ended.
    nvme = [c for c in cells.values() if c["offload"] == "nvme"]
    assert len(nvme) == 4
    if nvme_missing:
        assert all(c["verdict"] == "skipped" and NVME_ENABLE in c["reason"] for c in nvme)
    for c in [c for c in nvme if not nvme_missing]:
        assert c["verdict"] == "match", c["reason"]
        assert (c["ran"]["nvme_offload_optimizer"], c["ran"]["swapped_to_nvme"], c["ran"]["cpu_offload"]) == (True, True, False), c["ran"]
        assert c["ran"]["nvme_swap_bytes"] > 2**20
        assert not (out / "cells" / c["id"] / "nvme_swap").exists()
    skipped = [c for c in cells.values() if c["verdict"] == "skipped"]
    offload_z0 = [c for c in skipped if c["zero_stage"] == 0 and c["offload"] == "cpu"]
    assert all("offload needs ZeRO ≥ 1" in c["reason"] for c in offload_z0) and len(offload_z0) == 6
    fp16 = [c for c in cells.values() if c["dtype"] == "fp16" and c not in offload_z0]
    assert len(fp16) == 17
    if fp16_missing:
        assert all(c["verdict"] == "skipped" and c["reason"] == fp16_missing for c in fp16)
    else:
        assert all(c["verdict"] == "match" and c["ran"]["compute_dtype"] == "float16" for c in fp16)

    # ZeRO-3's gathered parameters and gradients equal ZeRO-0's, compared directly, at world 2.
    z0 = read_snapshots(out / "cells" / "deepspeed-z0-w2-mb2-ga4")
    z3 = read_snapshots(out / "cells" / "deepspeed-z3-w2-mb2-ga4")
    tol = DEFAULT_TOLERANCES["fp32"]
    direct = compare_snapshots(z0, z3, atol=tol.tensor_atol, rtol=tol.tensor_rtol)
    assert direct.first == {}
    assert max(direct.max_rel.values()) < 1e-6
    assert z3.steps == list(range(20)) and len(z3.order) == 6

    # The controls are localised to a tensor.
    scaled = cells["torch-w1-mb2-ga8-bug_one_grad_scaled"]
    assert (scaled["caught_by"], scaled["first_divergent_step"]) == ("grads", 0)
    assert scaled["reason"].startswith("diverged at step 0: grads of head.bias")
    frozen = cells["torch-w1-mb2-ga8-bug_lr_zero"]
    assert (frozen["caught_by"], frozen["first_divergent_step"]) == ("params", 0)
    assert frozen["reason"].startswith("diverged at step 0: params of hidden.0.weight")
    # FSDP2, ZeRO-3's counterpart in PyTorch: tensor by tensor equal to full-batch training (measured
    # ≤ 3.0e-8), and its traffic per step = one all-gather of the parameters per micro-step (the root
    # stays gathered between forward and backward) + one reduce-scatter of the gradients (GA 4: 5 P),
    # P with each tensor's dim 0 padded to a multiple of the world size (the head's 3 rows → 4).
    fsdp = cells["fsdp-w2-mb2-ga4"]
    assert 0 < fsdp["max_abs_param_diff"] < 1e-6 and 0 < fsdp["max_abs_grad_diff"] < 1e-6, fsdp
    padded = [(48, 12), (48,), (48, 48), (48,), (4, 48), (4,)]  # hidden.0, hidden.1, head: weight, bias
    param_bytes = 4 * sum(math.prod(shape) for shape in padded)
    assert fsdp["comm_bytes_per_step"] == 5 * param_bytes, fsdp["comm_bytes_per_step"]
    assert cells["fsdp-w2-mb2-ga4-bf16"]["verdict"] == "match"
    scaled = cells["fsdp-w2-mb2-ga4-bug_one_grad_scaled"]  # a sharded gradient 4×, gathered and localised
    assert (scaled["caught_by"], scaled["first_divergent_step"]) == ("grads", 0)
    assert scaled["reason"].startswith("diverged at step 0: grads of head.bias"), scaled["reason"]
    assert "max |Δparam|" in proc.stdout

    # The model state rank 0 holds mid-accumulation (fp32, AdamW, N = 2 ranks), counted from its
    # tensors, against the ZeRO paper's formula — parameters 4Ψ, gradients 4Ψ, Adam's moments 8Ψ,
    # partitioned per stage — plus what DeepSpeed 0.19 adds, within 0.5%: at ZeRO ≥ 1 an fp32 master
    # copy of the partition (4Ψ/N, even for an fp32 model); at ZeRO-2 the gradients of every whole
    # tensor its partition overlaps (here the first three: 2928 of Ψ = 3123 elements).
    n, psi, overlapped = 2, 3123, 2928
    expected = {
        "torch-w2-mb2-ga4": 16 * psi,  # DDP: everything on every rank
        "deepspeed-z0-w2-mb2-ga4": 16 * psi,
        "deepspeed-z1-w2-mb2-ga4": 8 * psi + 8 * psi / n + 4 * psi / n,
        "deepspeed-z2-w2-mb2-ga4": 4 * psi + 4 * overlapped + 8 * psi / n + 4 * psi / n,
        "deepspeed-z3-w2-mb2-ga4": 16 * psi / n + 4 * psi / n,
        # FSDP2 between no-sync micro-steps holds whole gradients: 4Ψ + (4Ψ + 8Ψ) / N (Ψ padded: 3173)
        "fsdp-w2-mb2-ga4": 4 * psi + 12 * 3173 / n,
    }
    for cell_id, bytes_ in expected.items():
        assert abs(cells[cell_id]["model_state_bytes"] / bytes_ - 1) < 0.005, (cell_id, cells[cell_id]["model_state_bytes"], bytes_)
    assert leftover_processes(tag) == []
