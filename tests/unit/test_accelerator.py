"""DeepSpeed's accelerator's fp16 answer, forced either way (gaeq/accelerator.py): what the parent
skips, what a rank's DeepSpeed answers and the dtype its Muon's Newton–Schulz then runs in — on
either kind of CPU, whichever this one is (its own answer is replaced by each of the two). A rank
of a real run reporting the forced answer: tests/integration/test_muon.py."""

from __future__ import annotations

import pytest
import torch

from gaeq import accelerator
from gaeq.accelerator import FP16_EMULATION_ENV, FP16_ENV
from gaeq.matrix import matrix_from_dict
from gaeq.trainers import muon
from tests.helpers import small_spec


@pytest.fixture
def clean(monkeypatch):
    """Neither variable set, DeepSpeed's accelerator class and the cached answer as they were after."""
    from deepspeed.accelerator import get_accelerator

    for name in (FP16_ENV, FP16_EMULATION_ENV):
        monkeypatch.setenv(name, "")  # recorded, so the test's own writes are undone
        monkeypatch.delenv(name)
    cls = type(get_accelerator())
    monkeypatch.setattr(cls, "is_fp16_supported", cls.is_fp16_supported)
    native = accelerator.native_fp16  # a test may replace it
    native.cache_clear()
    yield monkeypatch
    native.cache_clear()


@pytest.mark.parametrize(
    ("env", "forced"),
    [({}, None), ({FP16_ENV: "yes"}, True), ({FP16_ENV: "No"}, False), ({FP16_EMULATION_ENV: "1"}, True),
     ({FP16_ENV: "no", FP16_EMULATION_ENV: "1"}, False)],
)  # fmt: skip
def test_the_variable_forces_yes_or_no_and_its_older_name_is_yes(clean, env, forced):
    for name, value in env.items():
        clean.setenv(name, value)
    assert accelerator.forced_fp16() is forced


def test_a_wrong_answer_is_bad_input(clean):
    from gaeq.runtime.cells import check_launch

    clean.setenv(FP16_ENV, "1")
    with pytest.raises(ValueError, match="GAEQ_ACCELERATOR_FP16='1': yes or no"):
        check_launch(launcher="local", isolate=False, lanes=None)


def fp16_skip_reasons() -> set[str | None]:
    """Why the fp16 cells of a small matrix (torch and DeepSpeed, a baseline and its twin) are skipped."""
    cells = [
        {"trainer": "torch", "micro_batch_size": 4},
        {"trainer": "deepspeed", "micro_batch_size": 4, "zero_stage": 1},
    ]
    matrix = matrix_from_dict(small_spec(axes=None, cells=[c | {"dtype": "fp16"} for c in cells]))
    return {c.skip_reason for c in matrix.cells}


@pytest.mark.parametrize("native", [True, False], ids=["cpu-with-fp16", "cpu-without"])
def test_fp16_cells_skip_or_run_as_the_forced_answer_says_on_either_cpu(clean, native):
    clean.setattr(accelerator, "native_fp16", lambda: native)
    own = {None} if native else {accelerator.fp16_unsupported_reason()}
    assert own == {None} if native else "answers no; GAEQ_ACCELERATOR_FP16=yes runs these cells" in own.pop()
    assert fp16_skip_reasons() == ({None} if native else {accelerator.fp16_unsupported_reason()})

    clean.setenv(FP16_ENV, "no")  # an Intel CPU's run, as an AMD one runs it
    assert fp16_skip_reasons() == {"DeepSpeed's accelerator's fp16 answer is forced to no (GAEQ_ACCELERATOR_FP16=no)"}
    assert accelerator.fp16_emulated() is False

    clean.setenv(FP16_ENV, "yes")  # an AMD CPU's run, as an Intel one runs it: torch's emulated fp16 kernels
    assert fp16_skip_reasons() == {None}
    assert accelerator.fp16_emulated() is not native


@pytest.mark.parametrize("answer", [True, False], ids=["yes", "no"])
def test_a_rank_forced_answers_so_and_deepspeeds_muon_follows(clean, answer):
    """What set_up_rank does in every rank: DeepSpeed's accelerator answers the forced answer (so its
    Muon orthogonalises in fp16 or fp32), the rank's environment and its `ran` say so, and None gives
    the accelerator its own answer back."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    own = bool(get_accelerator().is_fp16_supported())  # None where it is not (CPU accelerator)
    accelerator.force_fp16_answer(answer)
    assert get_accelerator().is_fp16_supported() is answer and accelerator.native_fp16() is own
    assert ns_compute_dtype("gram") == (torch.float16 if answer else torch.float32)
    assert muon.deepspeeds_dtype() == ("float16" if answer else "float32")
    assert (torch.float16 in get_accelerator().supported_dtypes()) is answer
    word, native = ("yes" if answer else "no"), ("yes" if own else "no")
    assert accelerator.forced_fp16() is answer and accelerator.fp16_answer() is answer
    assert accelerator.fp16_answer_record() == f"{word} (forced by GAEQ_ACCELERATOR_FP16; native: {native})"

    accelerator.force_fp16_answer(None)
    assert bool(get_accelerator().is_fp16_supported()) is own and accelerator.forced_fp16() is None
    assert accelerator.fp16_answer_record() == f"{native} (native)"
