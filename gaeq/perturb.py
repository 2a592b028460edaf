"""The instruments that measure a run rather than test it: a perturbation of rounding's size, and a
planted error of known size. Both act on the baseline's own split (one process, the whole batch in one
micro-batch), so no accumulation code sets what a run is judged by. A leaf: no gaeq imports.

- **nudge** (the noise floor's twins): before each optimizer step, every gradient element × (1 ± one
  unit in the last place of its dtype), the signs from a generator seeded per twin — one more rounding
  per element and step, the size of what summing a batch in another order does to it. An optimizer
  stepping another inside its own step nudges each gradient once.
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

    def before(self, optimizer, args, kwargs) -> None:
        self.depth += 1
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


def nudge_(grad: torch.Tensor, generator: torch.Generator) -> None:
    """Each element of `grad` ± eps of its dtype × the larger of its own size and the tensor's root mean
    square, in place (taken in float64, rounded once): a unit in the last place of the element — or of the
    sums it came from, where terms cancelled (a sum's rounding is relative to its terms, not to the result:
    an element near zero accumulated from terms of the tensor's typical size rounds at their scale)."""
    signs = torch.randint(0, 2, grad.shape, generator=generator, dtype=torch.int8).to(grad.device)
    exact = grad.double()
    scale = torch.maximum(exact.abs(), exact.square().mean().sqrt()) * torch.finfo(grad.dtype).eps
    grad.copy_(exact + scale * (signs.double() * 2 - 1))


class Weight:
    """The gradient at the model's output × (1 + delta) on the first half of each training forward's rows."""

    def __init__(self, delta: float) -> None:
        self.delta = delta
        self._calls: list[bool] = []

    def before(self, module, args) -> None:
        outer = not self._calls and torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())
        self._calls.append(outer)

    def after(self, module, args, output) -> None:
        if self._calls.pop():
            weigh_first_half(output, self.delta)


def weigh_first_half(output, delta: float) -> None:
    """Hook every tensor of `output` that carries a gradient (in tuples, lists, mappings: a transformers
    ModelOutput's logits) so that its first half of rows — of positions, for a single row — passes
    back its gradient × (1 + delta)."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad and output.dim() >= 1:
            dim = 0 if output.shape[0] > 1 or output.dim() == 1 else 1
            half = max(output.shape[dim] // 2, 1)
            weights = torch.ones(output.shape[dim], dtype=output.dtype, device=output.device)
            weights[:half] += delta
            shape = [1] * output.dim()
            shape[dim] = -1
            output.register_hook(lambda grad: grad * weights.view(shape))
        return
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        for item in output:
            weigh_first_half(item, delta)


@contextlib.contextmanager
def applied(*, nudge_seed: int | None = None, weight: float | None = None) -> Iterator[None]:
    """While inside: the nudge of twin `nudge_seed` and/or the planted `weight` error (nothing for None)."""
    handles = []
    if nudge_seed is not None:
        nudge = Nudge(nudge_seed)
        handles += [register_optimizer_step_pre_hook(nudge.before), register_optimizer_step_post_hook(nudge.after)]
    if weight is not None:
        weigh = Weight(weight)
        handles += [
            torch.nn.modules.module.register_module_forward_pre_hook(weigh.before),
            torch.nn.modules.module.register_module_forward_hook(weigh.after, always_call=True),
        ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
