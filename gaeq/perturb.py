"""The instruments that measure a run rather than test it: a perturbation of rounding's size, and a
planted error of known size. Both act on the baseline's own split (one process, the whole batch in one
micro-batch), so no accumulation code sets what a run is judged by. A leaf: of gaeq, it imports only
gaeq.dtensors (a gradient may be a DTensor: FSDP2's).

- **nudge** (the noise floor's twins): before each optimizer step, every gradient element ± a unit in the
  last place — of the element, or of its tensor's typical element where that is larger (`nudge_`) —, the
  signs from a generator seeded per twin: one more rounding per element and step. An optimizer stepping
  another inside its own step nudges each gradient once. The unit is the gradient's dtype's, or the one
  the split's rounding really happens in (`unit`): under bf16 autocast each micro-batch's weight gradient
  leaves its matmul in bfloat16 and is rounded there before it is summed in float32. A script's probe
  nudges before it reads the step's norm (`Nudge.nudge_grads`), so that the norm step 0 reports is a twin's too.
- **row order** (the twins too): each batch's rows in another order — the same samples, summed in another
  order by every reduction over the batch, as a split sums them: gaeq's trainers reorder the data they own
  (`row_order`), a script's model gets its rows reordered and its output's put back (`RowOrder`), from its
  first training call on.
- **weight** (the detection limit's probe, and a control of tunable size): the gradient that reaches the
  model's output for the first half of each forward's rows × (1 + δ), for the rest × (1 − δ) (scaled so
  that the batch's total weight is unchanged) — a **zero-sum** reweighting, the shape of the mistakes users
  make (a mean of micro-batch means, a token count per rank, a row weighed per pack): rows weighed wrongly
  against each other, the sum of the weights right, seen only as far as the rows' gradients differ. It is
  applied once per forward, on the one tensor the loss is taken on (`rows_of`).
- **order check** (the twins too): whether the model's output depends on the order of its rows or on
  random draws — causes besides rounding that make a twin drift (`OrderCheck`).

The model is the outermost module called with gradients on that has trainable parameters (DDP's
wrapper, a DeepSpeed engine or the model itself: their output is the model's). Applied through
torch's global hooks, so gaeq's trainers and a user's unchanged script are perturbed alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gaeq.dtensors as dtensors

NUDGE_SEED_BASE = 7_919
"""Twin k's signs come from a generator seeded NUDGE_SEED_BASE + k (any fixed numbers would do)."""


class Nudge:
    """Each gradient × (1 ± eps of its dtype, or of `unit`) before the outermost optimizer step, signs
    from a seeded generator (on the CPU, so every device draws the same signs)."""

    def __init__(self, seed: int, unit: torch.dtype | None = None) -> None:
        self.generator = torch.Generator().manual_seed(NUDGE_SEED_BASE + seed)
        self.unit = unit
        self.depth = 0
        self._nudged: set[int] = set()
        """Gradients nudged in this outer step: a nested optimizer's own ones are nudged, once each."""

    def before(self, optimizer, args, kwargs):
        self.depth += 1
        # step(closure): the gradients are the closure's backward's — nudged after it ran
        return after_closure(args, kwargs, lambda: self.nudge(optimizer)) or self.nudge(optimizer)

    def nudge(self, optimizer) -> None:
        self.nudge_grads(p for group in optimizer.param_groups for p in group["params"])

    def nudge_grads(self, params) -> None:
        """The gradients of `params` not yet nudged this step, nudged (a reader of the step's norm calls it
        first, so that the norm it reads is the nudged gradients')."""
        with torch.no_grad():
            for p in params:
                if p.grad is not None and id(p.grad) not in self._nudged:
                    nudge_(p.grad, self.generator, unit=self.unit)
                    self._nudged.add(id(p.grad))

    def after(self, optimizer, args, kwargs) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.step_done()

    def step_done(self) -> None:
        """The step is over (stepped, or skipped by a loss scaler): the next one's gradients are nudged anew."""
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


def nudge_(grad: torch.Tensor, generator: torch.Generator, *, unit: torch.dtype | None = None) -> None:
    """Each nonzero element of `grad` ± eps of `unit` (default: its dtype) × the larger of its own size and
    the tensor's root mean square, in place (taken in float64, rounded once): a unit in the last place of the
    element — or of the sums it came from, where terms cancelled (a sum's rounding is relative to its terms,
    not to the result: an element near zero accumulated from terms of the tensor's typical size rounds at
    their scale). An exact zero stays zero: zeros sum to zero in any order. A DTensor's block is nudged
    where it lives, with the signs of its place in the whole tensor."""
    signs = torch.randint(0, 2, grad.shape, generator=generator, dtype=torch.int8)
    here = dtensors.local(grad)
    if here is not grad:
        shape, offset = dtensors.block(grad)
        signs = signs[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    exact = here.double()
    scale = torch.maximum(exact.abs(), exact.square().mean().sqrt()) * torch.finfo(unit or here.dtype).eps
    scale = torch.where(exact == 0, 0.0, scale)  # a sum of exact zeros is zero in any order: no rounding there
    here.copy_(exact + scale * (signs.to(here.device).double() * 2 - 1))


WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")
"""Modules that wrap the model (its `.module`) and may pass its output on through tensors of their own
(DDP's with unused-parameter detection does): the perturbation goes on the model inside."""
CALL_WRAPPERS = (*WRAPPERS, "LightningModule", "_FabricModule")
"""Modules a training call goes through to reach the model: DDP's and DeepSpeed's wrappers, and a
LightningModule (Lightning calls its training_step through DDP at world 2 and directly at world 1; the
model it calls inside is the same at both)."""


def wraps(module: torch.nn.Module) -> bool:
    """Whether `module` is one of CALL_WRAPPERS (by its classes' names: no import of their libraries)."""
    return any(kind.__name__ in CALL_WRAPPERS for kind in type(module).__mro__)


class Outermost:
    """Finds the model — the outermost module called with gradients on that has trainable parameters, and
    inside a known wrapper (WRAPPERS) the model it wraps — and calls `on_model(model, output)` after each
    of its training calls."""

    def __init__(self, *, on_model) -> None:
        self.on_model = on_model
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
        self._calls.append(module is self.model and torch.is_grad_enabled())

    def after(self, module, args, output) -> None:
        if self._calls.pop():
            self.on_model(module, output, self.last_rows)
            self.last_rows = None
        elif any(self._calls) and isinstance(output, torch.Tensor) and output.dim() >= 1 and output.requires_grad:
            self.last_rows = output


def weigh_model(output, inside, delta: float) -> None:
    """The model's output weighed (:func:`weigh_rows`) — or, where it holds no tensor with rows (a model
    that returns its loss), `inside`: the last output with rows a module inside it produced, from which
    every parameter before it gets its gradient."""
    rows = rows_of(output)
    if rows is None and inside is not None:
        rows = rows_of(inside)
    if rows is not None:
        weigh_rows(rows, delta)


def rows_of(output) -> torch.Tensor | None:
    """The one tensor of a model's output the loss is taken on: itself; a mapping's `logits` (a
    transformers ModelOutput), else its first tensor with rows that carries a gradient; a tuple's or
    list's first such tensor. None where the output holds none (a loss alone)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad and output.dim() >= 1 else None
    if isinstance(output, Mapping):
        logits = rows_of(output.get("logits"))
        return logits if logits is not None else rows_of(list(output.values()))
    if isinstance(output, (tuple, list)):
        return next((t for t in map(rows_of, output) if t is not None), None)
    return None


def row_weights(rows: int, delta: float, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The first half of `rows` weighed 1 + δ, the rest 1 − δ·half/(rows − half): zero-sum, the weights
    summing to `rows` (a single row: weighed 1 + δ, nothing to weigh it against)."""
    half = max(rows // 2, 1)
    weights = torch.ones(rows, dtype=torch.float64)
    weights[:half] += delta
    if rows > half:
        weights[half:] -= delta * half / (rows - half)
    return weights.to(dtype=dtype, device=device)


def weigh_rows(output: torch.Tensor, delta: float) -> None:
    """Hook `output` so that its rows — its positions, for a single row — pass back their gradient ×
    :func:`row_weights`: the first half × (1 + delta), the rest less, the batch's total weight unchanged."""
    dim = 0 if output.shape[0] > 1 or output.dim() == 1 else 1
    weights = row_weights(output.shape[dim], delta, dtype=output.dtype, device=output.device)
    shape = [1] * output.dim()
    shape[dim] = -1
    output.register_hook(lambda grad: None if grad is None else grad * weights.view(shape))


def row_order(rows: int, *, seed: int, at: tuple[int, ...]) -> list[int]:
    """A noise-floor twin's order of a batch's `rows` at `at` (its step and micro-step): seeded per twin,
    the same in every run."""
    generator = torch.Generator().manual_seed(NUDGE_SEED_BASE * (seed + 1) + 1_000_003 * sum(at) + at[-1])
    return torch.randperm(rows, generator=generator).tolist()


class RowOrder:
    """A script's model gets its rows in another order from its first training call on, every tensor of its
    arguments with as many rows permuted alike and its output's put back: the same samples, summed in
    another order by every reduction over the batch. The model is the outermost module called with gradients
    on that has trainable parameters (a wrapper's call reorders the model's rows too); its calls are caught
    where a forward hook cannot change a keyword argument — at ``Module.__call__``, while installed."""

    def __init__(self, seed: int) -> None:
        self.seed, self.calls = seed, 0
        self.model: torch.nn.Module | None = None
        self._depth = 0
        self._call = None

    def install(self) -> None:
        self._call = torch.nn.Module.__call__
        call, order = self._call, self

        def reordered_call(module, *args, **kwargs):
            if order._depth or not order._training_call(module):
                order._depth += 1
                try:
                    return call(module, *args, **kwargs)
                finally:
                    order._depth -= 1
            rows = _rows((args, kwargs))
            if rows is None or rows < 2:
                return order._inside(call, module, args, kwargs)
            order.calls += 1
            perm = torch.tensor(row_order(rows, seed=order.seed, at=(order.calls,)))
            args, kwargs = _take((args, kwargs), rows, perm)
            return _take(order._inside(call, module, args, kwargs), rows, torch.argsort(perm))

        torch.nn.Module.__call__ = reordered_call

    def remove(self) -> None:
        if self._call is not None:
            torch.nn.Module.__call__ = self._call

    def _training_call(self, module) -> bool:
        if not torch.is_grad_enabled():
            return False
        if self.model is None and any(p.requires_grad for p in module.parameters()):
            self.model = module
        return module is self.model

    def _inside(self, call, module, args, kwargs):
        self._depth += 1
        try:
            return call(module, *args, **kwargs)
        finally:
            self._depth -= 1


ROW_STATE: list[Callable[[list[int]], contextlib.AbstractContextManager]] = []
"""State a model reads per row besides its arguments (gaeq's indexed dropout reads its rows' sample keys
from a context variable): each entry, given an order of the rows, a context under which that state
follows them — the order check reorders it with the rows it reverses."""


class OrderCheck:
    """Whether the model's output depends on the order of its rows, or on random draws, beyond rounding —
    the causes besides rounding that make a noise-floor twin drift (capacity-limited routing, negatives
    taken across the batch's rows, a mask drawn per row). At the model's first training call with two rows
    or more — the model being the first module called with gradients on that has trainable parameters and
    is not one of CALL_WRAPPERS —, the model runs three more times without gradients, its buffers and RNG
    state as they were before each and after all: as called; with its rows reversed (its output's put
    back); as called with other random draws. Each is compared with the first, in units of `unit`'s
    rounding (default: the compared tensor's dtype): `found` holds the largest difference of each,
    {"row_order": units, "random_draws": units}, or {"not_checked": why} — read by
    gaeq.results.floor.order_causes, which knows how many units rounding explains."""

    def __init__(self, unit: torch.dtype | None = None) -> None:
        self.unit = unit
        self.model: torch.nn.Module | None = None
        """The model, where the script names it (else the first module that trains and wraps none)."""
        self.found: dict | None = None
        self._call = None
        self._busy = False

    def install(self) -> None:
        self._call = torch.nn.Module.__call__
        call, check = self._call, self

        def checked_call(module, *args, **kwargs):
            if check.found is None and not check._busy and torch.is_grad_enabled() and check._is_model(module):
                check._busy = True
                try:
                    check.found = check.measure(call, module, args, kwargs)
                except Exception as exc:  # (a model that cannot be run again as called: said, never a guess)
                    check.found = {"not_checked": f"{type(exc).__name__}: {exc}"}
                finally:
                    check._busy = False
            return call(module, *args, **kwargs)

        torch.nn.Module.__call__ = checked_call

    def remove(self) -> None:
        if self._call is not None:
            torch.nn.Module.__call__ = self._call

    def _is_model(self, module: torch.nn.Module) -> bool:
        if self.model is not None:
            return module is self.model
        return not wraps(module) and any(p.requires_grad for p in module.parameters())

    def measure(self, call, module, args, kwargs) -> dict | None:
        """The two differences (None: this call has fewer than two rows — the next one is checked)."""
        rows = _rows((args, kwargs))
        if rows is None or rows < 2:
            return None
        reverse = torch.arange(rows - 1, -1, -1)
        kept = [(b, b.detach().clone()) for b in module.buffers()]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            states = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])

            def run(a, k, *, seed: int | None = None):
                if seed is None:
                    torch.set_rng_state(states[0])
                    for d, state in zip(devices, states[1]):
                        torch.cuda.set_rng_state(state, d)
                else:
                    torch.manual_seed(seed)
                try:
                    return call(module, *a, **k)
                finally:
                    for buffer, value in kept:
                        buffer.copy_(value)

            first = run(args, kwargs)
            a, k = _take((args, kwargs), rows, reverse)
            with contextlib.ExitStack() as state:
                for follow in ROW_STATE:
                    state.enter_context(follow(reverse.tolist()))
                reordered = _take(run(a, k), rows, reverse)  # (reversing twice is the identity)
            redrawn = run(args, kwargs, seed=NUDGE_SEED_BASE)
        return {
            "row_order": _units(first, reordered, self.unit),
            "random_draws": _units(first, redrawn, self.unit),
        }


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor in `value` (nested tuples, lists, mappings), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    return [t for item in items for t in _tensors(item)]


def _units(a, b, unit: torch.dtype | None) -> float:
    """The largest |a − b| over the floating tensors `a` and `b` hold alike, relative to each element's size
    plus its tensor's root mean square, in units of `unit`'s eps (default: the tensor's dtype's)."""
    worst = 0.0
    for x, y in zip(_tensors(a), _tensors(b)):
        if not (x.is_floating_point() and x.shape == y.shape and x.numel()):
            continue
        eps = torch.finfo(unit or x.dtype).eps
        x, y = dtensors.local(x).double(), dtensors.local(y).double()
        scale = x.abs() + x.square().mean().sqrt()
        moved = ((x - y).abs() / scale.clamp_min(1e-300)).max()
        worst = max(worst, float(moved) / eps)
    return worst


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


class Applied:
    """What `applied` put in place: the twin's nudge (a reader of the step's norm nudges first), its row
    order and order check, the planted weight's watch — each told the model where the script names it
    (gaeq.probe)."""

    def __init__(
        self, nudge: Nudge | None, order: RowOrder | None, watch: Outermost | None, check: OrderCheck | None = None
    ) -> None:
        self.nudge, self.order, self.watch, self.check = nudge, order, watch, check

    def name_model(self, model: torch.nn.Module) -> None:
        if self.order is not None:
            self.order.model = model
        while type(model).__name__ in WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        if self.watch is not None:
            self.watch.model = model
        if self.check is not None:
            self.check.model = model


@contextlib.contextmanager
def applied(
    *,
    twin_seed: int | None = None,
    weight: float | None = None,
    reorder_rows: bool = False,
    unit: torch.dtype | None = None,
) -> Iterator[Applied]:
    """While inside: twin `twin_seed`'s nudge (of `unit`'s size: default, each gradient's dtype) and order
    check — and, with `reorder_rows`, its model's rows in another order (a script's: gaeq's trainers reorder
    the data they own) — and/or the planted `weight` error."""
    handles, nudge, order, watch, check = [], None, None, None, None
    if twin_seed is not None:
        nudge = Nudge(twin_seed, unit)
        handles += [register_optimizer_step_pre_hook(nudge.before), register_optimizer_step_post_hook(nudge.after)]
        check = OrderCheck(unit)
        check.install()  # (before the row order: it sees the rows as the reordering hands them on)
        if reorder_rows:
            order = RowOrder(twin_seed)
            order.install()
    if weight is not None:
        watch = Outermost(on_model=lambda module, output, inside: weigh_model(output, inside, weight))
        handles += [
            torch.nn.modules.module.register_module_forward_pre_hook(watch.before),
            torch.nn.modules.module.register_module_forward_hook(watch.after, always_call=True),
        ]
    try:
        yield Applied(nudge, order, watch, check)
    finally:
        for handle in handles:
            handle.remove()
        for patched in (order, check):  # (the last installed first)
            if patched is not None:
                patched.remove()
