"""The instruments (gaeq/perturb.py) and what they measure (gaeq.results.floor): a nudge of one unit in the
last place, exactly; rows reweighed 1 ± δ with the total weight unchanged, exactly, once per forward; the
order check; the detection limit they give — and that it means what it says, tried both ways with the
error planted in every split of a group."""

from __future__ import annotations

import functools

import pytest
import torch

import gaeq.perturb as perturb
import gaeq.rows as rows
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
        perturb.nudge_(g, torch.Generator().manual_seed(rows.TWIN_SEED_BASE))
    assert torch.equal(again[0], model.weight.grad)


def test_rows_are_reweighed_one_plus_minus_delta_their_total_weight_unchanged_once_per_forward():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 3), torch.randn(10, 4)
    weights = perturb.row_weights(10, 0.25)
    assert weights[0::2].tolist() == [1.25] * 5 and float(weights.sum()) == pytest.approx(10.0)  # zero-sum
    # by the row's place in its step: a micro-batch from row 5 of the step on weighs each row as the batch does
    assert torch.equal(perturb.row_weights(3, 0.25, start=5), perturb.row_weights(10, 0.25)[5:8])

    def grads(**kw):
        model.zero_grad()
        with perturb.applied(**kw):
            model(x).square().sum().backward()
        return model.weight.grad.clone(), model.bias.grad.clone()

    (plain, _), (weighed, _) = grads(), grads(weight=0.25)
    out = model(x).detach()
    assert torch.allclose(weighed - plain, 2 * ((weights - 1)[:, None] * out).T @ x, atol=1e-5)
    model.zero_grad()
    with perturb.applied(weight=0.25):
        model(x).sum().backward()  # every row's gradient the same: a zero-sum reweighting moves nothing
    assert torch.allclose(model.bias.grad, torch.full((3,), 10.0))

    class Several(torch.nn.Module):  # a transformers-style output holding several tensors: logits weighed once
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            logits = self.inner(x)
            return {"loss": logits.square().sum(), "doubled": logits * 2.0, "logits": logits}

    several = Several()

    def grad_through(key, **kw):
        model.zero_grad()
        with perturb.applied(**kw):
            out = several(x)
            (out[key] if key == "loss" else out[key].square().sum()).backward()
        return model.weight.grad.clone()

    moved = weighed - plain
    assert torch.allclose(grad_through("logits", weight=0.25) - grad_through("logits"), moved, atol=1e-5)
    assert torch.allclose(grad_through("loss", weight=0.25) - grad_through("loss"), moved, atol=1e-5)
    # a loss on a tensor derived from the logits in the output: weighed once, not (1 + δ)² through both
    assert torch.allclose(grad_through("doubled", weight=0.25) - grad_through("doubled"), 4 * moved, atol=1e-4)
    assert perturb.rows_of((torch.zeros(()), out.requires_grad_())) is out  # a tuple: its first tensor with rows
    with torch.no_grad(), perturb.applied(weight=0.25):
        assert not model(x).requires_grad  # an evaluation forward is left alone
    # counted over the step's forwards: two micro-batches of 5 weigh the rows as one forward of 10 does; after an
    # optimizer step the count starts again (a forward of rows 5–9 then weighs them as the step's rows 0–4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model.zero_grad()
    with perturb.applied(weight=0.25):
        for micro_batch in (x[:5], x[5:]):
            model(micro_batch).square().sum().backward()
        assert torch.allclose(model.weight.grad - plain, moved, atol=1e-5)
        optimizer.step()
        model.zero_grad()
        model(x[5:]).square().sum().backward()
    # a padding-free row (its position_ids restarting): its positions are the samples, weighed in turn — a row
    # weighed as one would scale the batch, not reweigh it
    packed = torch.nn.Linear(4, 3)
    tokens, restart = torch.randn(1, 6, 4), torch.tensor([[0, 1, 2, 0, 1, 0]])

    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = packed

        def forward(self, x, position_ids=None):
            return self.inner(x)

    with perturb.applied(weight=0.25):
        Packed()(tokens, position_ids=restart).sum().backward()
    assert torch.allclose(packed.bias.grad, torch.full((3,), 6.0))  # zero-sum over the row's 6 positions
    expected = (perturb.row_weights(6, 0.25)[:, None] * tokens[0]).sum(dim=0)
    assert torch.allclose(packed.weight.grad, expected.expand(3, 4), atol=1e-6)
    late = model(x[5:]).detach()
    anew = 2 * ((perturb.row_weights(5, 0.25) - 1)[:, None] * late).T @ x[5:]
    assert torch.allclose(model.weight.grad - 2 * late.T @ x[5:], anew, atol=1e-5)


def test_the_order_check_names_what_besides_rounding_moves_the_output():
    """Twins drift by rounding — or by the order of the model's rows, or by random draws: the check tells
    them apart by running the first batch again, reversed and redrawn, and leaves no trace of doing so."""
    from gaeq.results.floor import order_causes

    torch.manual_seed(0)

    class Capacity(torch.nn.Module):  # top-1 routing with a capacity per forward: later rows are dropped
        def __init__(self):
            super().__init__()
            self.router, self.expert, self.head = torch.nn.Linear(8, 2), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

        def forward(self, x):
            kept = (self.router(x).argmax(-1) == 0).nonzero().flatten()[: len(x) // 4]
            return self.head(x.index_add(0, kept, self.expert(x[kept])))

    normed = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 3))
    dropped = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))
    found = {}
    for name, model in (("normed", normed), ("capacity", Capacity()), ("dropout", dropped)):
        x, rng = torch.randn(16, 8), torch.get_rng_state()
        stats = [b.clone() for b in model.buffers()]
        with perturb.applied(twin_seed=0) as applied:
            model(x).square().mean().backward()
        found[name] = order_causes(applied.check.found)
        if name == "dropout":  # the training forward drew what it would have drawn without the check
            after = torch.get_rng_state()
            torch.set_rng_state(rng)
            torch.nn.functional.dropout(torch.ones(16, 16), 0.1)
            assert torch.equal(torch.get_rng_state(), after)
        if name == "normed":  # the running statistics moved once: by the training forward, not the check's
            once = torch.nn.BatchNorm1d(16)
            once.load_state_dict(dict(zip(["weight", "bias", "running_mean", "running_var", "num_batches_tracked"],
                                          [p.detach() for p in model[1].parameters()] + stats)))  # fmt: skip
            once.train()(model[0](x).detach())
            assert torch.allclose(model[1].running_mean, once.running_mean) and int(model[1].num_batches_tracked) == 1
    from gaeq.problem import models

    indexed = torch.nn.Sequential(torch.nn.Linear(8, 16), models._dropout(0.2, "indexed", seed=1, layer=0))
    with models.sample_keys(list(range(100, 116))), perturb.applied(twin_seed=0) as applied:
        indexed(torch.randn(16, 8)).sum().backward()  # its masks follow its rows' keys (rows.ROW_STATE)
    assert order_causes(applied.check.found) == [] and applied.check.found["row_order"] == 0.0
    assert found["normed"] == []  # a batch statistic sums rows in another order: rounding
    assert found["capacity"] and found["capacity"][0].startswith("the order of its rows")
    assert found["dropout"] and found["dropout"][0].startswith("random draws")


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
    assert limit.above_rounding and "rows reweighed 1 ± δ (the batch's total weight unchanged) for δ ≥ 1.8e-05" in (
        limit.describe()
    )
    # step by step: step 0 (grad norm) 2e-5, step 1 (loss 1.9e-6 / 2e-4) 9.5e-5, step 2 1.8e-5 — the weakest step 1
    assert limit.per_step == pytest.approx((1e-2 * 1e-5 / 5e-3, 1e-2 * 1.9e-6 / 2e-4, 1.8e-5))
    assert limit.weakest == (1, pytest.approx(9.5e-5)) and "to 9.5e-05 (step 1)" in limit.describe()
    nothing = DetectionLimit.measure(
        "planted", delta=1e-2, base=base, planted=base, tolerances=lambda r: tolerances_at(FP32, r, None), floor=None
    )
    assert nothing is None  # an error that moved nothing: the run cannot say what it would catch


def test_the_limit_allows_a_bf16_loss_its_resolution_as_a_splits_comparison_does():
    """A loss recorded in bf16 is known to half a unit of it; compare_traces adds both sides' resolution to the
    loss tolerance, so the limit must too — else it claims errors 1 + resolution / tolerance times smaller."""
    import dataclasses

    base = records([1.0, 0.9, 0.8], [2.0, 2.0, 2.0])
    planted = records([1.0, 0.9, 0.8 + 1e-3], [2.0, 2.0, 2.0])
    limit_of = functools.partial(
        DetectionLimit.measure, "planted", delta=1e-2, tolerances=lambda r: tolerances_at(FP32, r, None), floor=None
    )
    exact = limit_of(base=base, planted=planted)
    coarse = [dataclasses.replace(r, loss_resolution=2e-3) for r in base]
    coarse_planted = [dataclasses.replace(r, loss_resolution=2e-3) for r in planted]
    resolved = limit_of(base=coarse, planted=coarse_planted)
    loss_tol = tolerances_at(FP32, base[2], None)[0].value
    assert exact.limit == pytest.approx(1e-2 * loss_tol / 1e-3)
    assert resolved.limit == pytest.approx(1e-2 * (loss_tol + 4e-3) / 1e-3)  # both sides' resolution, as compared
    assert resolved.describe().startswith("detects rows reweighed 1 ± δ (the batch's total weight unchanged) for δ ≥")
    # a limit above 1 (a row weighed ≤ 0) is said as none, never as a δ no one could plant
    blunt = [dataclasses.replace(r, loss_resolution=0.06) for r in base]
    none = limit_of(base=blunt, planted=[dataclasses.replace(r, loss_resolution=0.06) for r in planted])
    assert none.limit > 1 and none.describe().startswith("detects no reweighing of rows 1 ± δ with δ < 1")
    assert "δ ≥" not in none.describe()


def test_the_limit_is_the_worst_splits_whose_own_distance_from_the_baseline_the_error_must_outgrow():
    """The planted error moves every split alike, but a split already stands some way from the baseline, and that
    way may run against the error: its limit adds its distance to the tolerance; the printed one is the worst."""
    base = records([1.0, 0.9, 0.8], [2.0, 2.0, 2.0])
    planted = records([1.0, 0.9, 0.8 + 1e-3], [2.0, 2.0, 2.0])
    near, far = records([1.0, 0.9, 0.8 + 1e-7], [2.0] * 3), records([1.0, 0.9, 0.8 - 4e-6], [2.0] * 3)
    limit_of = functools.partial(
        DetectionLimit.measure, "planted", delta=1e-2, tolerances=lambda r: tolerances_at(FP32, r, None), floor=None
    )
    alone = limit_of(base=base, planted=planted)
    worst = limit_of(base=base, planted=planted, splits={"near": near, "far": far})
    loss_tol = tolerances_at(FP32, base[2], None)[0].value
    assert alone.split is None and alone.limit == pytest.approx(1e-2 * loss_tol / 1e-3)
    assert worst.split == "far" and worst.limit == pytest.approx(1e-2 * (loss_tol + 4e-6) / 1e-3)
    assert worst.at_baseline == pytest.approx(alone.limit)
    assert "in far, the worst split" in worst.describe() and "tol + its distance" in worst.describe()
    # the largest limit, whatever order the splits come in (a run's matched splits are a set: its order varies
    # from run to run), though farther's is within SAID_APART of far's
    farther = records([1.0, 0.9, 0.8 - 4.4e-6], [2.0] * 3)
    for order in (("far", "farther"), ("farther", "far")):
        given = {"far": far, "farther": farther}
        assert limit_of(base=base, planted=planted, splits={n: given[n] for n in order}).split == "farther"


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


@pytest.mark.parametrize("times", [2.0, 1 / 3])
def test_the_limit_is_what_the_run_catches_with_the_error_in_every_split(measured, tmp_path, times):
    """Planted at 2 × the measured limit in every split of the group (GA 2, 4, 8, 16), the error is caught in
    each; at a third of it, in none — the limit is a measurement, not an assumption."""
    delta = times * measured.limit
    cells = [{"trainer": "torch", "micro_batch_size": mb, "weight_error": delta} for mb in (1, 2, 4, 8)]
    spec = small_spec(axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4]}, cells=cells)
    matrix = load_matrix_from(tmp_path, spec | {"detection_limit": False})
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    planted = [c for c in report.cells if c.cell.perturbation is not None and c.cell.perturbation.weight]
    assert len(planted) == 4 and measured.above_rounding
    verdicts = {c.grad_accum_steps: (c.verdict, round(c.margin, 2)) for c in planted}
    assert all(v == ("diverge" if times > 1 else "match") for v, _ in verdicts.values()), (measured.limit, verdicts)


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
    moved = 0.5 * 2 * (logits[0::2].T @ x[0::2] - logits[1::2].T @ x[1::2])  # rows 1 ± 0.5: the total unchanged
    assert torch.allclose(weighed - plain, moved, rtol=1e-5, atol=1e-5)
