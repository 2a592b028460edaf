"""The instruments (gaeq/perturb.py) and what they measure (gaeq.results.floor): a nudge of one unit in the
last place, exactly; half a batch weighed (1 + δ), exactly; the detection limit they give — and that it
means what it says, tried both ways with the error planted in every split of a group."""

from __future__ import annotations

import pytest
import torch

import gaeq.perturb as perturb
from gaeq.matrix import load_matrix
from gaeq.results.compare import DEFAULT_TOLERANCES, tolerances_at
from gaeq.results.floor import DetectionLimit, NoiseFloor
from gaeq.results.report import judge
from gaeq.results.trace import StepRecord, TraceStore
from tests.helpers import run_in_process, small_spec

FP32 = DEFAULT_TOLERANCES["fp32"]


def test_a_nudge_moves_every_gradient_by_a_unit_in_the_last_place_once_per_outer_step():
    model = torch.nn.Linear(64, 32)
    inner = torch.optim.SGD([model.bias], lr=0.0)

    class Outer(torch.optim.SGD):  # an optimizer stepping another inside its own step (DeepSpeed's Muon's aux)
        def step(self, closure=None):
            inner.step()
            return super().step(closure)

    outer = Outer([model.weight], lr=0.0)
    model(torch.randn(8, 64)).square().sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with perturb.applied(twin_seed=0):
        outer.step()
    # a unit in the last place of the element, or of its tensor's typical element where that is larger
    scales = [torch.maximum(b.abs(), b.square().mean().sqrt()) for b in before]
    moved = [(p.grad - b).abs() / scale for p, b, scale in zip(model.parameters(), before, scales)]
    eps = torch.finfo(torch.float32).eps
    assert all(float(m.max()) <= 1.5 * eps for m in moved)  # (rounded once) at most ...
    for m in moved:  # ... for most elements of each gradient: the nested optimizer's too, once
        assert 0.6 < float((m > 0).float().mean()) and float(m.max()) > 0.5 * eps
    nudged = [p.grad.clone() for p in model.parameters()]
    outer.step()  # outside the context: nothing
    assert all(torch.equal(p.grad, n) for p, n in zip(model.parameters(), nudged))
    again = [b.clone() for b in before]
    for g in again:  # the same seed, the same signs
        perturb.nudge_(g, torch.Generator().manual_seed(perturb.NUDGE_SEED_BASE))
    assert torch.equal(again[0], model.weight.grad)


def test_half_a_batch_is_weighed_exactly_one_plus_delta_in_every_output_it_returns():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 3), torch.randn(8, 4)

    def grads(**kw):
        model.zero_grad()
        with perturb.applied(**kw):
            model(x).sum().backward()
        return model.weight.grad.clone()

    plain, weighed = grads(), grads(weight=0.25)
    first_half = torch.ones(3, 1) @ x[:4].sum(0, keepdim=True)
    assert torch.allclose(weighed - plain, 0.25 * first_half, atol=1e-6)

    class Wrapped(torch.nn.Module):  # a transformers-style output: a mapping holding the logits; a loss module
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return {"logits": self.inner(x), "aux": None}

    wrapped = Wrapped()
    model.zero_grad()
    with perturb.applied(weight=0.25):
        torch.nn.MSELoss(reduction="sum")(wrapped(x)["logits"], torch.zeros(8, 3)).backward()  # outermost: Wrapped
    expected = 2 * (model(x) * torch.tensor([1.25] * 4 + [1.0] * 4)[:, None]).T @ x
    assert torch.allclose(model.weight.grad, expected.detach(), rtol=1e-5)
    with torch.no_grad(), perturb.applied(weight=0.25):
        assert not model(x).requires_grad  # an evaluation forward is left alone


def records(losses, norms):
    return [
        StepRecord(step=i, loss=loss, grad_norm=g, lr=1e-3, samples=8 * (i + 1), seconds=0.0)
        for i, (loss, g) in enumerate(zip(losses, norms))
    ]


def test_the_limit_is_delta_times_the_tightest_ratio_of_tolerance_to_effect():
    base = records([1.0, 0.9, 0.8], [2.0, 2.0, 2.0])
    planted = records([1.0, 0.9 + 2e-4, 0.8 + 1e-3], [2.0 * (1 + 5e-3), 2.0, 2.0])
    floor = NoiseFloor.measure(base, {"twin": records([1.0, 0.9, 0.8 + 1e-7], [2.0, 2.0, 2.0])})
    limit = DetectionLimit.measure(
        "planted",
        delta=1e-2,
        base=base,
        planted=planted,
        tolerances=lambda r: tolerances_at(FP32, r, floor),
        floor=floor,
    )
    # grad norm at step 0: 1e-5 / 5e-3 = 2e-3; loss at step 2: (1e-6 + 0.8e-6) / 1e-3 = 1.8e-3 — the tighter
    assert (limit.metric, limit.step) == ("loss", 2) and limit.limit == pytest.approx(1e-2 * 1.8e-6 / 1e-3)
    assert limit.above_rounding and "δ ≥ 1.8e-05" in limit.describe()
    nothing = DetectionLimit.measure(
        "planted", delta=1e-2, base=base, planted=base, tolerances=lambda r: tolerances_at(FP32, r, None), floor=None
    )
    assert nothing is None  # an error that moved nothing: the run cannot say what it would catch


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A small MLP (small_spec), its detection limit measured in the run."""
    tmp = tmp_path_factory.mktemp("limit")
    matrix = load_matrix_from(tmp, small_spec(axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4]}))
    report = judge(matrix, run_in_process(matrix, tmp), TraceStore(tmp))
    return report.detection_limits["fp32"]


def load_matrix_from(folder, spec):
    import yaml

    path = folder / "m.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_matrix(path)


@pytest.mark.parametrize("times", [3.0, 1 / 3])
def test_the_limit_is_what_the_run_catches_with_the_error_in_every_split(measured, tmp_path, times):
    """Planted at 3 × the measured limit in every split of the group (GA 2, 4, 8, 16), the error is caught in
    each; at a third of it, in none — the limit is a measurement, not an assumption."""
    delta = times * measured.limit
    cells = [{"trainer": "torch", "micro_batch_size": mb, "weight_error": delta} for mb in (1, 2, 4, 8)]
    spec = small_spec(axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4]}, cells=cells)
    matrix = load_matrix_from(tmp_path, spec | {"detection_limit": False})
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    planted = [c for c in report.cells if c.cell.perturbation is not None and c.cell.perturbation.weight]
    assert len(planted) == 4 and measured.above_rounding
    verdicts = {c.grad_accum_steps: (c.verdict, round(c.margin, 2)) for c in planted}
    assert all(v == ("diverge" if times > 1 else "match") for v, _ in verdicts.values()), (measured, verdicts)


def test_inside_a_wrapper_the_weight_goes_on_the_model_it_wraps():
    """DDP (with unused-parameter detection) hands the model's output on through tensors of its own, and a
    transformers model computes its loss inside: the weight must sit on the wrapped model's output, where
    the loss comes from — found on the Trainer script (experiments/your_trainer_padded_script.yaml), where
    it sat on DDP's and weighed nothing."""
    torch.manual_seed(0)

    class WithLoss(torch.nn.Module):  # computes its loss inside, as a transformers model given labels
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x):
            logits = self.linear(x)
            return {"loss": logits.square().sum(), "logits": logits}

    class DistributedDataParallel(torch.nn.Module):  # DDP's shape: `.module`, its output passed on anew
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return {k: v.clone() for k, v in self.module(x).items()}

    inner, x = WithLoss(), torch.randn(8, 4)
    wrapped = DistributedDataParallel(inner)

    def grads(**kw):
        inner.zero_grad()
        with perturb.applied(**kw):
            wrapped(x)["loss"].backward()
        return inner.linear.weight.grad.clone()

    plain, weighed = grads(), grads(weight=0.5)
    logits = inner.linear(x).detach()
    assert torch.allclose(weighed - plain, 0.5 * 2 * logits[:4].T @ x[:4], rtol=1e-5, atol=1e-6)
