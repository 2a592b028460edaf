"""What the machine's accelerator can do, asked of torch and DeepSpeed only when it matters: CUDA or
not (and so the collectives' backend), fp16, and the async I/O nvme offload swaps with.

fp16 on a CPU: DeepSpeed's CPU accelerator answers ``is_fp16_supported()`` from oneDNN (yes on
CPUs with AMX/avx512_fp16, no elsewhere), and DeepSpeed reads that answer beyond fp16 cells: its
Muon's Newton–Schulz runs in fp16 where it is yes, in fp32 where it is no (docs/tests.md: Which CPU
features change which numbers). ``GAEQ_ACCELERATOR_FP16=yes|no`` forces the answer, so that either
kind of CPU can run what the other does: in the parent (which fp16 cells are skipped, and why) and
in every rank before DeepSpeed is used (:func:`force_fp16_answer`: gaeq's own ranks, ``gaeq
worker`` and a user's script's ranks). ``yes`` on a CPU without fp16 kernels computes fp16 cells on
torch's emulated float16 (float16 storage, rounding after every op: slower, and recorded as emulated
in each cell's ``ran``); ``no`` on a CPU with them skips fp16 cells with that reason.
``GAEQ_FP16_EMULATION=1``, the variable's older name, is ``GAEQ_ACCELERATOR_FP16=yes``.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache

FP16_ENV = "GAEQ_ACCELERATOR_FP16"
FP16_EMULATION_ENV = "GAEQ_FP16_EMULATION"
"""The older name: ``=1`` is ``GAEQ_ACCELERATOR_FP16=yes`` (where the newer one is unset)."""
ANSWERS = {"yes": True, "no": False}
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
_OWN = "_gaeq_own_is_fp16_supported"
"""Where :func:`force_fp16_answer` keeps the accelerator class's own method."""


def has_cuda() -> bool:
    """Whether CUDA devices are here, asked through NVML (PYTORCH_NVML_BASED_CUDA_CHECK): the default
    check initialises the CUDA driver, and a process forked after that — every rank of the fork server,
    which asks before it forks — could not use CUDA. (Run on an H200: docs/where-it-runs.md, "On a GPU".)"""
    import torch

    said = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"  # for this question only: a user's script ranks inherit this environment
    try:
        return torch.cuda.is_available()
    finally:
        if said is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = said


def forced_fp16() -> bool | None:
    """The answer ``GAEQ_ACCELERATOR_FP16`` forces DeepSpeed's accelerator to give to
    ``is_fp16_supported()``; None where it is unset (the accelerator's own answer stands)."""
    value = os.environ.get(FP16_ENV, "").strip().lower()
    if not value:
        return True if os.environ.get(FP16_EMULATION_ENV) == "1" else None
    if value not in ANSWERS:
        raise ValueError(f"{FP16_ENV}={value!r}: yes or no (unset: the accelerator's own answer)")
    return ANSWERS[value]


def _word(answer: bool) -> str:
    return "yes" if answer else "no"


@lru_cache(maxsize=1)
def native_fp16() -> bool:
    """The accelerator's own answer (DeepSpeed's CPU accelerator asks oneDNN), asked once per process,
    before :func:`force_fp16_answer` replaces it."""
    import torch

    if torch.cuda.is_available():
        return True
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    own = vars(type(accelerator)).get(_OWN, type(accelerator).is_fp16_supported)
    return bool(own(accelerator))


def fp16_answer() -> bool:
    """What DeepSpeed's accelerator answers ``is_fp16_supported()`` in gaeq's ranks: forced, or its own."""
    forced = forced_fp16()
    return native_fp16() if forced is None else forced


def fp16_emulated() -> bool:
    """True when fp16 cells run on torch's emulated float16: the answer forced yes on a CPU whose own is no."""
    return forced_fp16() is True and not native_fp16()


def fp16_unsupported_reason() -> str | None:
    """None when fp16 cells can run; otherwise why not (for a `skipped` cell's reason)."""
    forced = forced_fp16()
    if forced is False:
        return f"DeepSpeed's accelerator's fp16 answer is forced to no ({FP16_ENV}=no)"
    if forced or native_fp16():
        return None
    return (
        "the cpu accelerator has no fp16 support (DeepSpeed: is_fp16_supported() answers no; "
        f"{FP16_ENV}=yes runs these cells in emulated fp16)"
    )


def force_fp16_answer(answer: bool | None) -> None:
    """In a rank, before DeepSpeed is used: its accelerator answers ``is_fp16_supported()`` `answer`
    from here on (None: its own again), and this process's environment says so, for whatever reads
    it later in the rank (its skip rules, its ``ran``). A rank forked from a fork server started
    earlier is handed the parent's answer rather than the server's environment."""
    os.environ.pop(FP16_EMULATION_ENV, None)
    if answer is None:
        os.environ.pop(FP16_ENV, None)
        if "deepspeed.accelerator" not in sys.modules:
            return  # never replaced
    else:
        os.environ[FP16_ENV] = _word(answer)
        from importlib.util import find_spec

        if find_spec("deepspeed") is None:
            return  # nothing here asks the question
    native_fp16()  # the accelerator's own answer, asked before it is replaced
    from deepspeed.accelerator import get_accelerator

    cls = type(get_accelerator())
    own = vars(cls).get(_OWN, cls.is_fp16_supported)
    setattr(cls, _OWN, own)
    cls.is_fp16_supported = own if answer is None else lambda self: answer


def fp16_answer_record(*, ask: bool = False) -> str | None:
    """What DeepSpeed's accelerator answered ``is_fp16_supported()`` in this process, for a cell's
    ``ran`` — ``yes (native)``, ``no (forced by GAEQ_ACCELERATOR_FP16; native: yes)``, … —; None
    where DeepSpeed is not loaded (nothing asked it), unless `ask`."""
    if "deepspeed" not in sys.modules and not ask:
        return None
    forced, native = forced_fp16(), _word(native_fp16())
    return f"{native} (native)" if forced is None else f"{_word(forced)} (forced by {FP16_ENV}; native: {native})"


NVME_ENABLE = "apt-get install libaio-dev"
"""The one command that makes nvme offload cells runnable on a Debian/Ubuntu machine (as root)."""


@lru_cache(maxsize=1)
def nvme_unsupported_reason() -> str | None:
    """None when DeepSpeed's async-I/O op (the one nvme offload swaps with) can be built here;
    otherwise why not, naming the command that enables it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible():
        return None
    return f"nvme offload needs DeepSpeed's async_io op, which needs libaio (headers and library): {NVME_ENABLE}"
