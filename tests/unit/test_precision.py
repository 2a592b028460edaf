"""What a script's training computed in (gaeq.script.precision), named as gaeq's dtypes are and checked
against its cell's label; the float32 run's switches (autocast off, GradScaler disabled) in a process of
their own (they patch torch for the process's life); a twin's rows reordered from the model's first call,
keyword arguments too (gaeq.rows.RowOrder)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from gaeq.script.launch import precision_mismatch
from gaeq.script.precision import Precision


def ran(**facts) -> Precision:
    p = Precision(force_float32=False)
    for k, v in facts.items():
        setattr(p, k, v)
    return p


@pytest.mark.parametrize(
    ("facts", "label", "computed"),
    [
        ({"parameters": ["float32"]}, "fp32", "float32"),
        ({"parameters": ["float32"], "autocast": "bfloat16"}, "bf16", "bfloat16"),
        ({"parameters": ["float32"], "autocast": "float16"}, "fp16", "float16"),
        ({"parameters": ["bfloat16"]}, "bf16", "bfloat16"),  # the script cast its model
        ({"parameters": ["float32"], "produced": "bfloat16"}, "bf16", "bfloat16"),  # FSDP2's MixedPrecisionPolicy
        ({"parameters": ["float32"], "deepspeed": "fp16"}, "ds_fp16", "float16"),
        ({"parameters": ["bfloat16"], "deepspeed": "bf16"}, "ds_bf16", "bfloat16"),
    ],
)
def test_what_ran_is_named_as_gaeqs_dtypes(facts, label, computed):
    assert ran(**facts).label() == label
    assert ran(**facts).compute_dtype() == computed


def test_a_label_that_is_not_what_ran_says_what_ran_and_what_to_do():
    assert (
        precision_mismatch("bf16", ran(parameters=["float32"], autocast="bfloat16").facts(), deepspeed_config=False)
        is None
    )
    cast = precision_mismatch("fp32", ran(parameters=["bfloat16"]).facts(), deepspeed_config=False)
    assert "it casts its model itself" in cast and "a float32 run of it cannot be made" in cast
    engine = precision_mismatch("fp32", ran(parameters=["float32"], deepspeed="bf16").facts(), deepspeed_config=False)
    assert "give it as script.deepspeed_config" in engine
    declared = precision_mismatch("bf16", ran(parameters=["float32"]).facts(), deepspeed_config=False)
    assert declared == "labelled bf16, ran fp32: what the script computes in is not the label — label it fp32"


def test_the_lowest_dtype_a_module_produced_in_the_first_forward_is_noted():
    p = Precision(force_float32=False)
    p.entered(torch.nn.Linear(2, 2))
    p.output(torch.zeros(1))
    p.output((torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.long)))
    p.output(torch.zeros(1, dtype=torch.float16))  # bf16's unit is the larger: it stays the lowest
    p.left()
    p.output(torch.zeros(1, dtype=torch.float16))  # after the first forward: not its
    assert p.produced == "bfloat16"


FLOAT32_RUN = """
import torch
from gaeq.script.precision import Precision

precision = Precision(force_float32=True)
skipped = []
precision.install(on_skipped=skipped.append, steps_taken=lambda: 0)
model = torch.nn.Linear(4, 4)
with torch.autocast("cpu", dtype=torch.bfloat16):
    out = model(torch.ones(2, 4))
assert out.dtype == torch.float32, out.dtype
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**28)
loss = out.sum()
assert scaler.scale(loss) is loss and not scaler.is_enabled()
print(precision.switched_off)
"""

AS_TRAINED = """
import torch
from gaeq.script.precision import Precision

precision = Precision(force_float32=False)
skipped, steps = [], [0]
precision.install(on_skipped=skipped.append, steps_taken=lambda: steps[0])
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)
loss = model(torch.ones(2, 4)).sum()
scaled = scaler.scale(loss)
print(float(precision.unscaled(scaled)) == float(loss))
model.weight.grad = torch.full_like(model.weight, float("inf"))
scaler.step(optimizer)  # inf found: no optimizer step, the probe told
print(len(skipped), precision.loss_scaler)
"""


@pytest.mark.parametrize(
    ("code", "said"), [(FLOAT32_RUN, "['autocast bf16 (cpu)', 'GradScaler']"), (AS_TRAINED, "True\n1 GradScaler")]
)
@pytest.mark.integration  # starts processes of its own
def test_the_float32_runs_switches_and_a_scalers_skipped_step(code, said):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == said


def test_a_twins_rows_are_reordered_from_the_models_first_call_keyword_arguments_too():
    import gaeq.perturb as perturb

    seen, checked = [], []

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, *, x):  # (the twin's order check runs it again first, without gradients)
            (seen if torch.is_grad_enabled() else checked).append(x[:, 0].tolist())
            return x * self.w

    model, x = Rows(), torch.arange(8.0).reshape(8, 1)
    call = torch.nn.Module.__call__
    with perturb.applied(twin_seed=0, reorder_rows=True):
        out = model(x=x)
    assert torch.nn.Module.__call__ is call  # put back
    assert seen[0] != list(range(8)) and sorted(seen[0]) == list(range(8))  # reordered at the first call
    assert torch.equal(out, x)  # and its output put back
    assert checked[:2] == [seen[0], seen[0][::-1]] and len(checked) == 3  # as called, reversed, redrawn
    model(x=x)  # outside: as it is
    assert seen[1] == list(range(8))


def test_the_model_a_script_names_is_the_one_the_instruments_weigh_not_a_teacher_called_first():
    """gaeq.probe(model=…) names the student: the detection limit's weighting goes on its output, not on a
    frozen teacher's called before it with requires_grad left on."""
    import gaeq.perturb as perturb

    torch.manual_seed(0)
    teacher, student, x = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2), torch.randn(4, 3)
    with perturb.applied(weight=0.5) as applied:
        applied.name_model(student)
        teacher(x).sum().backward()
        student(x).sum().backward()
    rows = torch.tensor([1.5, 0.5, 1.5, 0.5]).unsqueeze(1)  # rows reweighed 1 ± 0.5, the total unchanged
    assert torch.allclose(student.weight.grad, (rows * x).sum(0).expand(2, 3))
    assert torch.allclose(teacher.weight.grad, x.sum(0).expand(2, 3))  # the teacher as it is
    # the control: unnamed, the first trainable module called is taken for the model — the teacher is weighed
    teacher.weight.grad = student.weight.grad = None
    with perturb.applied(weight=0.5):
        teacher(x).sum().backward()
        student(x).sum().backward()
    assert torch.allclose(teacher.weight.grad, (rows * x).sum(0).expand(2, 3))
    assert torch.allclose(student.weight.grad, x.sum(0).expand(2, 3))
