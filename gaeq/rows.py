"""A batch's rows, as the instruments see them (a leaf: of gaeq, it imports only gaeq.dtensors).

- **which module is the model**: the one a training call reaches through the wrappers that carry it
  (`WRAPPERS`: DDP's and DeepSpeed's, whose `.module` is the model; `CALL_WRAPPERS`: those and the
  training-step wrappers of Lightning and Fabric), by their classes' names, no library imported;
- **row order** (the noise floor's twins): each batch's rows in another order — the same samples, summed in
  another order by every reduction over the batch, as a split sums them: gaeq's trainers reorder the data
  they own (`row_order`), a script's model gets its rows reordered and its output's put back (`RowOrder`),
  from its first training call on;
- **order check** (the twins too): whether the model's output depends on the order of its rows or on
  random draws — causes besides rounding that make a twin drift (`OrderCheck`; read by
  gaeq.results.floor.order_causes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch

import gaeq.dtensors as dtensors

TWIN_SEED_BASE = 7_919
"""Twin k's signs and row orders come from generators seeded from TWIN_SEED_BASE and k (any fixed numbers
would do)."""

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


def trains(module: torch.nn.Module) -> bool:
    """Whether this call of `module` is a model's training call: gradients on, and a parameter that trains (a
    loss or a metric has none, a frozen teacher's do not). The first such call's module is the model — the
    one rule the instruments (gaeq.perturb), the row order and order check here, and a script's probe use;
    each then takes the model a wrapper holds (`unwrap`) or the first module a wrapper's call reaches
    (`not wraps(module)`), as what it does needs."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside WRAPPERS (DDP's, DeepSpeed's), or `model` itself."""
    while type(model).__name__ in WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def row_order(rows: int, *, seed: int, at: tuple[int, ...]) -> list[int]:
    """A noise-floor twin's order of a batch's `rows` at `at` (its step and micro-step): seeded per twin,
    the same in every run."""
    generator = torch.Generator().manual_seed(TWIN_SEED_BASE * (seed + 1) + 1_000_003 * sum(at) + at[-1])
    return torch.randperm(rows, generator=generator).tolist()


class CallPatch:
    """`torch.nn.Module.__call__` wrapped while installed — where a forward hook cannot change a keyword argument
    or run the module again: the one place gaeq patches it. A subclass says what happens `around` each call;
    patches are removed in the reverse order of their installing."""

    def __init__(self) -> None:
        self._call = None

    def install(self) -> None:
        self._call = call = torch.nn.Module.__call__
        patch = self

        def patched(module, *args, **kwargs):
            return patch.around(call, module, args, kwargs)

        torch.nn.Module.__call__ = patched

    def remove(self) -> None:
        if self._call is not None:
            torch.nn.Module.__call__, self._call = self._call, None

    def around(self, call, module, args, kwargs):
        raise NotImplementedError


class RowOrder(CallPatch):
    """A script's model gets its rows in another order from its first training call on, every tensor of its
    arguments with as many rows permuted alike and its output's put back: the same samples, summed in
    another order by every reduction over the batch. The model is the outermost module called with gradients
    on that has trainable parameters (a wrapper's call reorders the model's rows too); its calls are caught
    where a forward hook cannot change a keyword argument — at ``Module.__call__``, while installed."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed, self.calls = seed, 0
        self.model: torch.nn.Module | None = None
        self._depth = 0

    def around(self, call, module, args, kwargs):
        if self._depth or not self._training_call(module):
            return self._inside(call, module, args, kwargs)
        rows = _rows((args, kwargs))
        if rows is None or rows < 2:
            return self._inside(call, module, args, kwargs)
        self.calls += 1
        perm = torch.tensor(row_order(rows, seed=self.seed, at=(self.calls,)))
        args, kwargs = _take((args, kwargs), rows, perm)
        return _take(self._inside(call, module, args, kwargs), rows, torch.argsort(perm))

    def _training_call(self, module) -> bool:
        if self.model is None and trains(module):
            self.model = module
        return module is self.model and torch.is_grad_enabled()

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


class OrderCheck(CallPatch):
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
        super().__init__()
        self.unit = unit
        self.model: torch.nn.Module | None = None
        """The model, where the script names it (else the first module that trains and wraps none)."""
        self.found: dict | None = None
        self._busy = False

    def around(self, call, module, args, kwargs):
        if self.found is None and not self._busy and torch.is_grad_enabled() and self._is_model(module):
            self._busy = True
            try:
                self.found = self.measure(call, module, args, kwargs)
            except Exception as exc:  # (a model that cannot be run again as called: said, never a guess)
                self.found = {"not_checked": f"{type(exc).__name__}: {exc}"}
            finally:
                self._busy = False
        return call(module, *args, **kwargs)

    def _is_model(self, module: torch.nn.Module) -> bool:
        if self.model is not None:
            return module is self.model
        return trains(module) and not wraps(module)

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
            redrawn = run(args, kwargs, seed=TWIN_SEED_BASE)
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
