"""The CUDA branches, on a machine without CUDA: what they read faked, what they decide checked. The
GPU check (benchmarks/gpu_check.sh) runs them for real on a GPU; these keep them from rotting between
its runs — nccl and a device per local rank where CUDA is, NVML's answer asked (a CUDA driver
initialised before the fork server forks would leave every rank without CUDA), the peak memory CUDA
counts, forward autocast on the CUDA device."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch


def test_a_cuda_machine_gets_nccl_a_device_per_local_rank_and_deepspeeds_cuda_accelerator(monkeypatch):
    import gaeq.runtime.dist as dist

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(dist, "has_cuda", lambda: True)
    assert dist.backend() == "nccl" and dist.device_for(3) == torch.device("cuda", 3)
    dist.set_accelerator_env()
    assert os.environ["DS_ACCELERATOR"] == "cuda"
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(dist, "has_cuda", lambda: False)  # the control: this machine
    assert dist.backend() == "gloo" and dist.device_for(3) == torch.device("cpu")
    dist.set_accelerator_env()
    assert os.environ["DS_ACCELERATOR"] == "cpu"


@pytest.mark.parametrize("before", [None, "0"])
def test_cuda_is_asked_through_nvml_and_the_environment_left_as_it_was(monkeypatch, before):
    import gaeq.runtime.dist as dist

    if before is None:
        monkeypatch.delenv(dist.NVML_CHECK, raising=False)
    else:
        monkeypatch.setenv(dist.NVML_CHECK, before)
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(os.environ.get(dist.NVML_CHECK)) or True)
    assert dist.has_cuda() and asked == ["1"]
    assert os.environ.get(dist.NVML_CHECK) == before


def test_peak_memory_on_a_cuda_device_is_what_cuda_counts_reset_per_cell(monkeypatch):
    from gaeq.trainers.cost import PeakMemory

    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: calls.append(("reset", device)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: calls.append(("read", device)) or 12345)
    cuda = torch.device("cuda", 1)
    assert PeakMemory(cuda).peak_bytes() == 12345 and calls == [("reset", cuda), ("read", cuda)]
    assert PeakMemory(torch.device("cpu")).peak_bytes() > 2**20  # the control: this process's RSS high-water mark


def test_low_precision_cells_autocast_on_the_cuda_device():
    from gaeq.trainers.base import autocast

    cuda = torch.device("cuda", 0)
    for dtype, computed in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with pytest.warns(UserWarning, match="CUDA is not available"):  # only here: the CPU build disables it
            around = autocast(dtype, cuda)
        assert isinstance(around, torch.autocast) and (around.device, around.fast_dtype) == ("cuda", computed)
    for dtype in ("fp32", "ds_bf16", "ds_fp16"):  # fp32, and DeepSpeed's own half-precision models: none
        assert isinstance(autocast(dtype, cuda), contextlib.nullcontext)


def test_a_deepspeed_cell_autocasts_inside_the_engine_whatever_the_engine_does_around_it():
    """DeepSpeed on CUDA turns off a torch.autocast entered around its engine's forward (measured on an
    H200: every DeepSpeed bf16/fp16 cell computed in float32, caught by the label check). The cell's
    autocast is entered inside the model's own forward — what the engine's off switch around it does
    not reach: here the switch is played by an autocast turned off around the call."""
    from gaeq.trainers.base import autocast_inside

    cpu = torch.device("cpu")
    x = torch.randn(2, 4)
    for dtype, computed in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        autocast_inside(model, dtype, cpu)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):  # the engine's switch
            assert model(x).dtype == computed, dtype
        assert model[0](x).dtype == torch.float32  # outside the model's forward: nothing entered
    plain = torch.nn.Linear(4, 2)  # the control: the autocast around it alone, turned off, computes float32
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
        assert plain(x).dtype == torch.float32
