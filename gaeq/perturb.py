"""The instruments that measure a run rather than test it: a perturbation of rounding's size, and a
planted error of known size. Both act on the baseline's own split (one process, the whole batch in one
micro-batch), so no accumulation code sets what a run is judged by. A leaf: no gaeq imports.

- **nudge** (the noise floor's twins): before each optimizer step, every gradient element ± a unit in the
  last place — of the element, or of its tensor's typical element where that is larger (`nudge_`) —, the
  signs from a generator seeded per twin: one more rounding per element and step. An optimizer stepping
  another inside its own step nudges each gradient once.
- **row order** (the twins too): each batch's rows in another order — the same samples, summed in another
  order by every reduction over the batch, as a split sums them: gaeq's trainers reorder the data they own
  (`row_order`), a script's model gets its rows reordered and its output's put back (`RowOrder`).
- **weight** (the detection limit's probe, and a control of tunable size): the gradient that reaches the
  model's output for the first half of each forward's rows × (1 + δ) — half a batch weighed wrongly,
  the shape of every normalisation mistake, in every micro-batch the model sees.

The model is the outermost module called with gradients on that has trainable parameters (DDP's
wrapper, a DeepSpeed engine or the model itself: their output is the model's). Applied through
torch's global hooks, so gaeq's trainers and a user's unchanged script are perturbed alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

NUDGE_SEED_BASE = 7_919
"""Twin k's signs come from a generator seeded NUDGE_SEED_BASE + k (any fixed numbers would do)."""


class Nudge:
    """Each gradient × (1 ± eps of its dtype) before the outermost optimizer step, signs from a seeded
    generator (on the CPU, so every device draws the same signs)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(NUDGE_SEED_BASE + seed)
        self.depth = 0
        self._nudged: set[int] = set()
        """Gradients nudged in this outer step: a nested optimizer's own ones are nudged, once each."""

    def before(self, optimizer, args, kwargs):
        self.depth += 1
        # step(closure): the gradients are the closure's backward's — nudged after it ran
        return after_closure(args, kwargs, lambda: self.nudge(optimizer)) or self.nudge(optimizer)

    def nudge(self, optimizer) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None and id(p.grad) not in self._nudged:
                        nudge_(p.grad, self.generator)
                        self._nudged.add(id(p.grad))

    def after(self, optimizer, args, kwargs) -> None:
        self.depth -= 1
        if self.depth == 0:
            self._nudged.clear()


def after_closure(args: tuple, kwargs: dict, then) -> tuple[tuple, dict] | None:
    """An optimizer step's arguments — as a step pre-hook gets them, the optimizer first — with its closure
    (`step(closure)`, positional or by keyword) made to call `then()` after it runs, for the hook to return;
    None when the step has no closure."""
    positional = "closure" not in kwargs and len(args) > 1
    closure = args[1] if positional else kwargs.get("closure")
    if closure is None:
        return None

    def closure_then(*a, **k):
        result = closure(*a, **k)
        then()
        return result

    return (args[:1] + args[2:] if positional else args), {**kwargs, "closure": closure_then}


def nudge_(grad: torch.Tensor, generator: torch.Generator) -> None:
    """Each nonzero element of `grad` ± eps of its dtype × the larger of its own size and the tensor's root
    mean square, in place (taken in float64, rounded once): a unit in the last place of the element — or of
    the sums it came from, where terms cancelled (a sum's rounding is relative to its terms, not to the
    result: an element near zero accumulated from terms of the tensor's typical size rounds at their scale).
    An exact zero stays zero: zeros sum to zero in any order."""
    signs = torch.randint(0, 2, grad.shape, generator=generator, dtype=torch.int8).to(grad.device)
    exact = grad.double()
    scale = torch.maximum(exact.abs(), exact.square().mean().sqrt()) * torch.finfo(grad.dtype).eps
    scale = torch.where(exact == 0, 0.0, scale)  # a sum of exact zeros is zero in any order: no rounding there
    grad.copy_(exact + scale * (signs.double() * 2 - 1))


WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")
"""Modules that wrap the model (its `.module`) and may pass its output on through tensors of their own
(DDP's with unused-parameter detection does): the perturbation goes on the model inside."""


class Outermost:
    """Finds the model — the outermost module called with gradients on that has trainable parameters, and
    inside a known wrapper (WRAPPERS) the model it wraps —, calls `on_first(model)` before its first
    training call and `on_model(model, output)` after each."""

    def __init__(self, *, on_model=None, on_first=None) -> None:
        self.on_model, self.on_first = on_model, on_first
        self.model: torch.nn.Module | None = None
        self._calls: list[bool] = []
        self.last_rows = None
        """The last output with rows that a module inside the model's call produced (a model that returns its
        loss alone — a LightningModule's training_step — is weighed there)."""

    def before(self, module, args) -> None:
        if self.model is None and torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            model = module
            while type(model).__name__ in WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
                model = model.module
            self.model = model  # (a wrapper's call: the model's own comes inside it)
            if self.on_first is not None:
                self.on_first(model)
        self._calls.append(module is self.model and torch.is_grad_enabled())

    def after(self, module, args, output) -> None:
        if self._calls.pop():
            if self.on_model is not None:
                self.on_model(module, output, self.last_rows)
            self.last_rows = None
        elif any(self._calls) and isinstance(output, torch.Tensor) and output.dim() >= 1 and output.requires_grad:
            self.last_rows = output


def weigh_model(output, inside, delta: float) -> None:
    """The model's output weighed (:func:`weigh_first_half`) — or, where it holds no tensor with rows (a
    model that returns its loss), `inside`: the last output with rows a module inside it produced, from
    which every parameter before it gets its gradient."""
    if not weigh_first_half(output, delta) and inside is not None:
        weigh_first_half(inside, delta)


def weigh_first_half(output, delta: float) -> bool:
    """Hook every tensor of `output` that carries a gradient (in tuples, lists, mappings: a transformers
    ModelOutput's logits) so that its first half of rows — of positions, for a single row — passes
    back its gradient × (1 + delta). Whether it hooked one."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad and output.dim() >= 1:
            dim = 0 if output.shape[0] > 1 or output.dim() == 1 else 1
            half = max(output.shape[dim] // 2, 1)
            weights = torch.ones(output.shape[dim], dtype=output.dtype, device=output.device)
            weights[:half] += delta
            shape = [1] * output.dim()
            shape[dim] = -1
            output.register_hook(lambda grad: None if grad is None else grad * weights.view(shape))
            return True
        return False
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return any([weigh_first_half(item, delta) for item in output])  # (a list: every one hooked)
    return False


def row_order(rows: int, *, seed: int, at: tuple[int, ...]) -> list[int]:
    """A noise-floor twin's order of a batch's `rows` at `at` (its step and micro-step): seeded per twin,
    the same in every run."""
    generator = torch.Generator().manual_seed(NUDGE_SEED_BASE * (seed + 1) + 1_000_003 * sum(at) + at[-1])
    return torch.randperm(rows, generator=generator).tolist()


class RowOrder:
    """A script's model gets its rows in another order, from its second training call on (the first tells
    which module it is), every tensor of its arguments with as many rows permuted alike and its output's put
    back: the same samples, summed in another order by every reduction over the batch."""

    def __init__(self, seed: int) -> None:
        self.seed, self.calls = seed, 0
        self._order: list[list[int]] = []

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self.before, with_kwargs=True)
        model.register_forward_hook(self.after, always_call=True)

    def before(self, module, args, kwargs):
        rows = _rows((args, kwargs))
        if not torch.is_grad_enabled() or rows is None or rows < 2:
            self._order.append([])
            return None
        self.calls += 1
        order = row_order(rows, seed=self.seed, at=(self.calls,))
        self._order.append(order)
        return _take((args, kwargs), rows, torch.tensor(order))

    def after(self, module, args, output):
        if not self._order:
            return None  # the first call: its hooks were attached during it, after its inputs were read
        order = self._order.pop()
        if not order:
            return None
        back = torch.argsort(torch.tensor(order))
        return _take(output, len(order), back)


def _rows(value) -> int | None:
    """The rows of the first tensor of at least one dimension in `value` (nested tuples, lists, mappings)."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() >= 1 else None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    return next((r for r in map(_rows, items) if r is not None), None)


def _take(value, rows: int, order: torch.Tensor):
    """`value` with every tensor of `rows` rows reordered by `order` (containers rebuilt, others as they are)."""
    if isinstance(value, torch.Tensor):
        return value[order.to(value.device)] if value.dim() >= 1 and value.shape[0] == rows else value
    if isinstance(value, Mapping):
        taken = {k: _take(v, rows, order) for k, v in value.items()}
        try:
            return taken if type(value) is dict else type(value)(**taken)  # a transformers ModelOutput too
        except TypeError:
            return taken
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_take(v, rows, order) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, rows, order) for v in value)
    return value


@contextlib.contextmanager
def applied(*, twin_seed: int | None = None, weight: float | None = None, reorder_rows: bool = False) -> Iterator[None]:
    """While inside: twin `twin_seed`'s nudge — and, with `reorder_rows`, its model's rows in another order
    (a script's: gaeq's trainers reorder the data they own) — and/or the planted `weight` error."""
    handles = []
    if twin_seed is not None:
        nudge = Nudge(twin_seed)
        handles += [register_optimizer_step_pre_hook(nudge.before), register_optimizer_step_post_hook(nudge.after)]
    watch = Outermost(
        on_model=None if weight is None else lambda module, output, inside: weigh_model(output, inside, weight),
        on_first=RowOrder(twin_seed).attach if reorder_rows and twin_seed is not None else None,
    )
    if watch.on_model is not None or watch.on_first is not None:
        handles += [
            torch.nn.modules.module.register_module_forward_pre_hook(watch.before),
            torch.nn.modules.module.register_module_forward_hook(watch.after, always_call=True),
        ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
