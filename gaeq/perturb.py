"""The instruments that measure a run rather than test it: a perturbation of rounding's size, and a
planted error of known size. Both act on the baseline's own split (one process, the whole batch in one
micro-batch), so no accumulation code sets what a run is judged by. A leaf: of gaeq, it imports only
gaeq.dtensors (a gradient may be a DTensor: FSDP2's) and gaeq.rows (a batch's rows: their order, the order
check, which module is the model).

- **nudge** (the noise floor's twins): before each optimizer step, every gradient element ± a unit in the
  last place — of the element, or of its tensor's typical element where that is larger (`nudge_`) —, the
  signs from a generator seeded per twin: one more rounding per element and step. An optimizer stepping
  another inside its own step nudges each gradient once. The unit is the gradient's dtype's, or the one
  the split's rounding really happens in (`unit`): under bf16 autocast each micro-batch's weight gradient
  leaves its matmul in bfloat16 and is rounded there before it is summed in float32. A script's probe
  nudges before it reads the step's norm (`Nudge.nudge_grads`), so that the norm step 0 reports is a twin's too.
- **row order** and **order check** (the twins too, gaeq.rows): each batch's rows in another order, and
  whether the model's output depends on it (or on random draws) beyond rounding.
- **weight** (the detection limit's probe, and a control of tunable size): the gradient that reaches the
  model's output for the step's even rows × (1 + δ), for its odd rows × (1 − δ) — counted over the step's
  forwards, so that every split weighs the very rows the whole batch does: the same error in every split. A
  **zero-sum** reweighting (over a step of an even number of rows), the shape of the mistakes users make (a
  mean of micro-batch means, a token count per rank, a row weighed per pack): rows weighed wrongly against
  each other, the sum of the weights right, seen only as far as the rows' gradients differ. It is applied
  once per forward, on the one tensor the loss is taken on (`rows_of`).

The model is the outermost module called with gradients on that has trainable parameters (DDP's
wrapper, a DeepSpeed engine or the model itself: their output is the model's). Applied through
torch's global hooks, so gaeq's trainers and a user's unchanged script are perturbed alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gaeq.dtensors as dtensors
from gaeq.rows import TWIN_SEED_BASE, OrderCheck, RowOrder, trains, unwrap


class Nudge:
    """Each gradient × (1 ± eps of its dtype, or of `unit`) before the outermost optimizer step, signs
    from a seeded generator (on the CPU, so every device draws the same signs)."""

    def __init__(self, seed: int, unit: torch.dtype | None = None) -> None:
        self.generator = torch.Generator().manual_seed(TWIN_SEED_BASE + seed)  # twin k: its own signs
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


NUDGE_CHUNK = 1 << 18
"""Elements of a gradient nudged at once (2 MB in float64)."""


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
    # In float64 a chunk at a time: a twin holds no more memory than its reference (a copy of the largest
    # gradient in float64, and its temporaries, would cost several times that gradient where memory is tight).
    flat, signs = here.reshape(-1), signs.to(here.device).reshape(-1)  # (a view where `here` is contiguous)
    chunks = range(0, flat.numel(), NUDGE_CHUNK)
    squares = sum(flat[i : i + NUDGE_CHUNK].double().square().sum() for i in chunks)
    rms = (squares / max(flat.numel(), 1)).sqrt()
    eps = torch.finfo(unit or here.dtype).eps
    for i in chunks:
        exact = flat[i : i + NUDGE_CHUNK].double()
        scale = torch.maximum(exact.abs(), rms) * eps
        scale = torch.where(exact == 0, 0.0, scale)  # a sum of exact zeros is zero in any order: no rounding there
        flat[i : i + NUDGE_CHUNK].copy_(exact + scale * (signs[i : i + NUDGE_CHUNK].double() * 2 - 1))
    if flat.data_ptr() != here.data_ptr():  # a strided gradient: nudged in a copy
        here.copy_(flat.view_as(here))


class Outermost:
    """Finds the model — the outermost module called with gradients on that has trainable parameters, and
    inside a known wrapper (WRAPPERS) the model it wraps — and calls `on_model(model, output, inside, packed)`
    after each of its training calls (`inside`: the last output with rows inside it; `packed`: its input one
    padding-free row, :func:`packed_row`)."""

    def __init__(self, *, on_model) -> None:
        self.on_model = on_model
        self.model: torch.nn.Module | None = None
        self._calls: list[bool] = []
        self.last_rows = None
        """The last output with rows that a module inside the model's call produced (a model that returns its
        loss alone — a LightningModule's training_step — is weighed there)."""

    def before(self, module, args) -> None:
        if self.model is None and trains(module):
            self.model = unwrap(module)  # (a wrapper's call: the model's own comes inside it)
        self._calls.append(module is self.model and torch.is_grad_enabled())

    def after(self, module, args, *kwargs_output) -> None:
        # (module, args, kwargs, output); an always-call hook is called without kwargs when the forward raised
        kwargs, output = kwargs_output if len(kwargs_output) == 2 else ({}, kwargs_output[-1])
        if self._calls.pop():
            self.on_model(module, output, self.last_rows, packed_row(kwargs))
            self.last_rows = None
        elif any(self._calls) and isinstance(output, torch.Tensor) and output.dim() >= 1 and output.requires_grad:
            self.last_rows = output


class RowCount:
    """Rows the model's training forwards produced since the last optimizer step: where in its step the next
    forward's first row stands (the planted weight alternates over the step's rows, not each forward's)."""

    def __init__(self) -> None:
        self.seen = self.positions = 0

    def reset(self, *_) -> None:
        self.seen = self.positions = 0


def packed_row(kwargs) -> bool:
    """A padding-free micro-batch: one row of several sequences end to end, its `position_ids` restarting."""
    ids = kwargs.get("position_ids") if isinstance(kwargs, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        return False
    return bool((ids[0, 1:] <= ids[0, :-1]).any())


def weigh_model(output, inside, delta: float, count: RowCount | None = None, packed: bool = False) -> None:
    """The model's output weighed (:func:`weigh_rows`) — or, where it holds no tensor with rows (a model
    that returns its loss), `inside`: the last output with rows a module inside it produced, from which
    every parameter before it gets its gradient. Its rows counted on from `count`'s — a `packed` row's
    positions instead (its sequences are the samples: a row of them weighed as one would be a scale, not a
    reweighing)."""
    rows = rows_of(output)
    if rows is None and inside is not None:
        rows = rows_of(inside)
    if rows is None:
        return
    along = 1 if packed and rows.dim() >= 2 else 0
    start = 0 if count is None else count.positions if along else count.seen
    weigh_rows(rows, delta, start=start, dim=along)
    if count is not None and along:
        count.positions += rows.shape[1]
    elif count is not None:
        count.seen += rows.shape[0]


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


def row_weights(rows: int, delta: float, *, start: int = 0, dtype=torch.float32, device=None) -> torch.Tensor:
    """Rows weighed 1 + δ and 1 − δ in turn, the first being the step's row `start`: the even rows of the step
    up, the odd ones down — zero-sum over a step of an even number of rows. By the row's place in its step,
    not in its forward: a split weighs the very rows the whole batch does, whatever its micro batch (on one
    rank, its micro-batches cut from the batch in order)."""
    signs = 1 - 2 * ((torch.arange(rows, dtype=torch.int64) + start) % 2)
    return (1 + delta * signs.to(torch.float64)).to(dtype=dtype, device=device)


def weigh_rows(output: torch.Tensor, delta: float, *, start: int = 0, dim: int = 0) -> None:
    """Hook `output` so that its rows (along `dim`: 1 for a packed row's positions) pass back their gradient ×
    :func:`row_weights` (its first the step's `start`): alternate ones × (1 + delta), the others × (1 − delta)."""
    weights = row_weights(output.shape[dim], delta, start=start, dtype=output.dtype, device=output.device)
    shape = [1] * output.dim()
    shape[dim] = -1
    output.register_hook(lambda grad: None if grad is None else grad * weights.view(shape))


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
        model = unwrap(model)
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
        count = RowCount()
        watch = Outermost(on_model=lambda module, out, inside, packed: weigh_model(out, inside, weight, count, packed))
        handles += [
            register_optimizer_step_post_hook(count.reset),
            torch.nn.modules.module.register_module_forward_pre_hook(watch.before),
            torch.nn.modules.module.register_module_forward_hook(watch.after, with_kwargs=True, always_call=True),
        ]
    try:
        yield Applied(nudge, order, watch, check)
    finally:
        for handle in handles:
            handle.remove()
        for patched in (order, check):  # (the last installed first)
            if patched is not None:
                patched.remove()
