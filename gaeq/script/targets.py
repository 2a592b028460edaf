"""The weight every target gets in a training step, read by the probe where the loss meets the model's output —
one run of one split, nothing run again.

For a cross-entropy over the vocabulary (transformers' models given labels, ``F.cross_entropy`` on logits), the
gradient that reaches target t's logits is w_t (p_t − q_t), q_t what the loss trains it towards: its label
e_{y_t}, or with label smoothing ε, (1 − ε) e_{y_t} + ε/V. So off the label every entry is w_t (p_j − ε/V), and
w_t is their sum over the sum of (p_j − ε/V), read in float64 from the gradient and the logits the forward
produced; ε, one for the loss, is fitted on a sample of positions. A position whose gradient is zero is no
target (``ignore_index``, padding). A gradient of another shape is not read, and said: a regression, or a term
beside the cross-entropy (a z-loss adds to the label's entry what it adds to the others). On per-token
log-probabilities (TRL's fused forward returns `log_probs`, its loss −Σ w_t log p_t) the gradient is −w_t itself.

Where the logits are bf16 or fp16 and the loss takes them cast to float32 (`logits.float()`, or autocast's cast
inside the loss), the gradient is read at that cast (gaeq.script.casts), before it is rounded back: as sharp as
the loss. A forward read so is checked against the gradient its logits then get: another term there is said.

Each forward's weights are kept per row (count, sum, least, largest), with their relative resolution: twice as
far as the gradient strays from the loss it is read as (a bf16 loss's own rounding shows there), never finer than
a float32 read's: the probe gathers them with the rest of the step (gaeq.script.steps), and
gaeq.objective.weighting says what they mean. The weights are this rank's, as its backward made them; a loss
scaler's scale is taken out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

import gaeq.dtensors as dtensors
from gaeq.perturb import rows_of
from gaeq.script.casts import casts_of, node_of

CHUNK = 1 << 22
"""Elements of the logits read at once (32 MB in float64)."""
SAMPLE = 256
"""Targets of a forward whose gradients' shape is checked in full: spread over it."""
FIT = 32
"""Of those, the first whose label smoothing is fitted (one ε for the loss: a few positions tell it); the fit is checked
on them all."""
UNITS = 64
"""How many units in the last place of the gradient's dtype the gradient may stray from a cross-entropy's (rounding
of the softmax and the subtraction, summed) and still be read as one."""
FINEST = UNITS * torch.finfo(torch.float32).eps
"""The finest relative resolution a weight is said to be read at (a float32 read's)."""
HALF = (torch.bfloat16, torch.float16)


@dataclass(eq=False)
class Forward:
    """One training forward of the model: what its targets' weights are read from, and what was read."""

    logits: torch.Tensor | None = None
    """Its logits, detached (until their gradient is read)."""
    read: tuple | None = None
    """On the device: per row, the count and the weights' sum, least and largest, read as a plain cross-entropy's,
    then as a smoothed one's; the two fits' residuals on the sample; the fitted ε/V."""
    eps: float = 0.0
    """The unit in the last place of the gradient read."""
    at_cast: tuple | None = None
    """Read at a float32 cast: each position's Σ |gradient| rounded to the logits' dtype, and whether the logits'
    own gradient then held the same (nothing else reached them)."""
    unread: str | None = None
    read_at: str = ""
    """Where and in what precision the gradient was read, in words."""
    output: torch.Tensor | None = None
    """Its logits as the model returned them (until read): their place in the autograd graph is looked up before
    the backward (gaeq.script.casts.node_of), never inside a compiled forward."""
    classes: int = 0


class TargetWeights:
    """One rank's reader: each training forward of the model hooks its logits (and, before the backward, the
    cast the loss takes them through); their backward reads the weights; `take` hands a phase's forwards on."""

    def __init__(self) -> None:
        self._forwards: list[Forward] = []
        self.unread: str | None = None
        """Why the weights could not be read (the first reason met), else None."""
        self.scale = 1.0
        """The loss scale the backward in progress carries (GradScaler's), divided out of the weights."""

    def watch(self, output) -> None:
        """The model's output of a training forward: its logits are read when their gradient arrives — or its
        per-token log-probabilities (TRL's fused forward, `fused_lm_head=True`: `log_probs`, the loss −Σ w_t log p_t),
        whose gradient is −w_t itself."""
        forward = Forward()
        self._forwards.append(forward)
        logps = output.get("log_probs") if isinstance(output, Mapping) else None
        if isinstance(logps, torch.Tensor) and logps.requires_grad and logps.dim() == 2:
            mask = output.get("label_mask")  # (an ignored position's log p is a constant 0: its gradient no weight)
            mask = mask.detach() if isinstance(mask, torch.Tensor) and mask.shape == logps.shape else None
            logps.register_hook(lambda grad: self._keep_log_probs(forward, grad, mask))
            return
        logits = rows_of(output)
        if logits is None:
            return self._said(forward, "the model's output holds no logits (it returns its loss alone, or fuses it)")
        if dtensors.is_dtensor(logits):
            return self._said(forward, "its logits are sharded over ranks (a DTensor)")
        if logits.dim() < 2 or not logits.is_floating_point() or logits.shape[-1] < 2:
            return self._said(forward, "its output has no class dimension (a regression, or another loss)")
        forward.logits, forward.output = logits.detach(), logits
        logits.register_hook(lambda grad: self._at_logits(forward, grad))

    def before_backward(self, tensors, *, scale: float | torch.Tensor = 1.0) -> None:
        """A backward is about to run from `tensors`, carrying the loss scale `scale`: the float32 casts of
        half-precision logits it passes through are hooked, so that their gradient is read before it is rounded."""
        self.scale = scale
        half = [f for f in self._forwards if f.output is not None and f.read is None and f.logits.dtype in HALF]
        wanted = {node: f for f in half if (node := node_of(f.output)) is not None}
        for cast, forward in casts_of(tensors, wanted) if wanted else ():
            handle = []

            def at_cast(grads, forward=forward):
                handle.pop().remove()
                self._at_cast(forward, grads[0])

            handle.append(cast.register_prehook(at_cast))

    def take(self, keys: list | None = None) -> list[dict | None]:
        """The forwards read since the last take (a phase's), in order: each ``{"rows": [[n, sum, least, largest],
        …], "resolution": r, "keys": [row keys] | None}`` — None where it was not read (said in `unread`). `keys`: each
        forward's rows' keys (gaeq.script.samples.MicroBatch.row_keys), where the probe read them. Read back from
        the device here, once a phase."""
        taken, self._forwards = self._forwards, []
        keys = keys if keys is not None and len(keys) == len(taken) else [None] * len(taken)
        return [self._taken(f, k) for f, k in zip(taken, keys)]

    def _taken(self, f: Forward, keys) -> dict | None:
        if f.read is None:
            if f.unread is None and f.logits is not None:
                self._said(f, "a training forward's logits got no gradient in its optimizer step")
            return None
        n, plain, smoothed, (off_label, plain_fit, smooth_fit, c) = f.read[0], f.read[1:4], f.read[4:7], f.read[7]
        tol = UNITS * f.eps
        said = {"keys": keys, "read": f.read_at}
        if f.at_cast is not None and f.at_cast[1] is not None and not bool(f.at_cast[1]):
            return self._said(f, "another term than the float32 loss reaches its logits (read at the loss's cast)")
        if float(plain_fit) <= tol:
            rows, fit = plain, float(plain_fit)
        elif float(smooth_fit) <= tol and float(c) > 0:
            rows, fit, said["label_smoothing"] = smoothed, float(smooth_fit), float(c) * f.classes
        elif float(off_label) <= tol:
            return self._said(
                f,
                "off the label its gradient is a cross-entropy's, at the label not: another term on the logits beside "
                f"it (a z-loss is one; off by {float(plain_fit):.1e} of the weight)",
            )
        else:
            off = float(min(plain_fit, smooth_fit))
            return self._said(
                f,
                "the gradient at the model's output is not a weighted cross-entropy's over logits (a weighted "
                f"log-probability's, of either sign), with or without label smoothing (off by {off:.1e}): a "
                "regression, a distillation, a KL over the whole distribution, an entropy bonus or another loss",
            )
        stats = zip(n.tolist(), *(t.tolist() for t in rows))
        said["resolution"] = max(FINEST, 2 * fit)  # as far as the gradient strays from the loss it is read as
        return said | {"rows": [[k, s, lo, hi] if k else [0, 0.0, 0.0, 0.0] for k, s, lo, hi in stats]}

    def _said(self, forward: Forward, why: str) -> None:
        forward.unread = forward.unread or why
        forward.logits = forward.output = None
        self.unread = self.unread or why

    def _at_cast(self, forward: Forward, grad: torch.Tensor | None) -> None:
        """The loss's own gradient at its float32 cast of the logits: read where it holds the logits' entries."""
        logits = forward.logits
        if grad is None or logits is None or grad.dtype != torch.float32 or grad.numel() != logits.numel():
            return
        grad = grad.detach().reshape(logits.shape)
        self._read(forward, logits, grad)
        forward.at_cast, forward.read_at = (_abs_sums(grad.to(logits.dtype)), None), "float32 at the loss's cast"

    def _at_logits(self, forward: Forward, grad: torch.Tensor) -> None:
        logits, forward.logits, forward.output = forward.logits, None, None
        if logits is None:
            return
        if forward.at_cast is not None:  # read at the cast: the logits' gradient must be that one, rounded
            sums = forward.at_cast[0]
            forward.at_cast = (sums, torch.isclose(_abs_sums(grad.detach()), sums, rtol=1e-12, atol=0).all())
            return
        self._read(forward, logits, grad.detach())
        forward.read_at = f"{_name(grad.dtype)} gradients at the model's output"

    def _read(self, forward: Forward, logits: torch.Tensor, grad: torch.Tensor) -> None:
        """Each target's weight, from the logits and the gradient the loss gave them (of the logits' shape)."""
        classes = forward.classes = logits.shape[-1]
        z, g = logits.reshape(-1, classes), grad.reshape(-1, classes)
        fits = _fits(z, g)
        c = fits[-1]
        plain = torch.empty(z.shape[0], dtype=torch.float64, device=z.device)
        smoothed = torch.empty_like(plain)
        step = max(1, CHUNK // classes)
        for i in range(0, z.shape[0], step):
            zi, gi = z[i : i + step].float(), g[i : i + step]
            label = _labels(gi)
            # off the label: Σ g over Σ p (and Σ p − (V − 1) ε/V) — Σ p as the others' exp(z − max) summed in
            # float64 over all of them: the label's own float32 term subtracted exactly, no cancellation where p[y]
            # nears 1 (each sum is the whole row less one entry it holds: one pass, no copy of the row)
            e = (zi - zi.amax(dim=-1, keepdim=True)).exp_()
            total = e.sum(dim=-1, dtype=torch.float64)
            others = (total - e.gather(-1, label)[:, 0].double()) / total
            pushed = gi.sum(dim=-1, dtype=torch.float64) - gi.gather(-1, label)[:, 0].double()
            target = pushed != 0
            plain[i : i + step] = torch.where(target, pushed / others.clamp_min(1e-300), 0.0)
            smoothed[i : i + step] = torch.where(target, pushed / (others - (classes - 1) * c), 0.0)
        rows = logits.shape[0]
        scale = self.scale if isinstance(self.scale, torch.Tensor) else float(self.scale)
        counts, *plain_rows = _rows(plain.view(rows, -1) / scale)
        _, *smoothed_rows = _rows(smoothed.view(rows, -1) / scale)
        forward.read, forward.eps = (counts, *plain_rows, *smoothed_rows, fits), torch.finfo(grad.dtype).eps

    def _keep_log_probs(self, forward: Forward, grad: torch.Tensor, mask: torch.Tensor | None) -> None:
        weights = -grad.detach().double() * (1 if mask is None else mask)
        scale = self.scale if isinstance(self.scale, torch.Tensor) else float(self.scale)
        counts, *rows = _rows(weights / scale)
        exact = torch.zeros((), dtype=torch.float64, device=weights.device)
        rounded = exact + torch.finfo(grad.dtype).eps / 2  # −w itself, rounded once to the gradient's dtype
        forward.read, forward.eps = (
            (counts, *rows, *rows, (exact, rounded, rounded, exact)),
            torch.finfo(grad.dtype).eps,
        )
        forward.read_at = f"{_name(grad.dtype)} gradients at the per-token log-probabilities"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rows(weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A forward's weights, [rows, positions] (0: no target): per row the count, sum, least and largest."""
    targets = weights != 0
    big = torch.where(targets, weights, -torch.inf).amax(dim=1)
    small = torch.where(targets, weights, torch.inf).amin(dim=1)
    return targets.sum(dim=1), weights.sum(dim=1), small, big


def _abs_sums(grad: torch.Tensor) -> torch.Tensor:
    """Each position's Σ |gradient| over the classes, in float64 (what tells two gradients of one dtype apart)."""
    return grad.reshape(-1, grad.shape[-1]).abs().sum(dim=-1, dtype=torch.float64)


def _labels(g: torch.Tensor) -> torch.Tensor:
    """Each position's label, [positions, 1]: the entry of w (p − e_y) whose sign is not the weight's. Its size is the
    others' sum, so it is the largest: the least entry where w > 0, the largest where w < 0 (a policy gradient's
    negative advantage) — the least where they tie (two classes: w's sign cannot be told, a positive weight read)."""
    low, high = g.argmin(dim=-1, keepdim=True), g.argmax(dim=-1, keepdim=True)
    return torch.where(g.gather(-1, low).abs() >= g.gather(-1, high).abs(), low, high)


def _fits(z: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """On SAMPLE positions spread over the forward, in float64: how far the gradient strays from a plain
    cross-entropy's w (p − e_y) off the label (relative to w·max p, as the weights are read there) and then at the
    label too (relative to w: p − 1 is rounded to a unit of 1 where p nears 1); on the first FIT of them, from a
    smoothed one's w (p − q) with the ε/V fitted to them (the median of each position's least-squares fit; relative
    to the largest entry); and that ε/V."""
    chosen = torch.arange(0, z.shape[0], max(1, z.shape[0] // SAMPLE), device=z.device)[:SAMPLE]
    g, p = g[chosen].double(), torch.softmax(z[chosen].double(), dim=-1)
    classes = p.shape[-1]
    label = _labels(g)
    g_y, p_y = g.gather(-1, label)[:, 0], p.gather(-1, label)[:, 0]
    pushed, others = g.sum(dim=-1) - g_y, p.sum(dim=-1) - p_y
    target = pushed != 0
    w = pushed / others.clamp_min(1e-300)
    strayed = (g - w[:, None] * p).scatter_(-1, label, 0.0)
    off_label = strayed.abs().amax(dim=-1) / (w.abs() * p.amax(dim=-1)).clamp_min(1e-300)
    plain = torch.maximum(off_label, (g_y - w * (p_y - 1)).abs() / w.abs().clamp_min(1e-300))
    # label smoothing: off the label g = w (p − c), one c = ε/V for the loss — fitted position by position on the
    # first FIT, then checked on every sampled position (a fit is said only where it fits them all)
    mean_p, mean_g = others[:FIT] / (classes - 1), pushed[:FIT] / (classes - 1)
    dp = (p[:FIT] - mean_p[:, None]).scatter_(-1, label[:FIT], 0.0)
    slope = (dp * (g[:FIT] - mean_g[:, None])).sum(dim=-1) / (dp * dp).sum(dim=-1)
    c = torch.nan_to_num(torch.nanmedian(torch.where(target[:FIT], mean_p - mean_g / slope, torch.nan)), nan=0.0)
    w1 = pushed / (others - (classes - 1) * c)
    # off the label g − w1 (p − c) is what a plain fit left (`strayed`) + (w − w1) p + w1 c: four passes, not eight
    off = torch.addcmul(strayed, (w - w1)[:, None], p).add_((w1 * c)[:, None]).scatter_(-1, label, 0.0)
    at_label = (g_y - w1 * (p_y - c) + w1 * (1 - classes * c)).abs()
    low, high = torch.aminmax(g, dim=-1)
    smooth = torch.maximum(off.abs_().amax(dim=-1), at_label) / torch.maximum(-low, high).clamp_min(1e-300)

    def worst(x, among):
        return torch.where(among, torch.nan_to_num(x, nan=torch.inf), 0.0).amax()

    return worst(off_label, target), worst(plain, target), worst(smooth, target), c


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """While a rank of gaeq's own trainers trains: the model's training forwards read (its outermost trainable
    module, as the instruments find it), each optimizer step's kept — an optimizer stepping another inside its
    own step is one step — and written to `path` at the end: {"steps": [forwards…], "unread": why | None}."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from gaeq.files import atomic_write
    from gaeq.perturb import Outermost

    reader, steps, depth = TargetWeights(), [], [0]
    # a model that returns its loss alone (gaeq's Trainer models): the last output with rows inside it, its logits
    watch = Outermost(
        on_model=lambda module, output, inside, packed: reader.watch(
            output if inside is None else _logits(output, inside)
        )
    )

    def before(*_):
        depth[0] += 1

    def after(*_):
        depth[0] -= 1
        if not depth[0]:
            steps.append(reader.take())

    hooks = torch.nn.modules.module
    handles = [
        hooks.register_module_forward_pre_hook(watch.before),
        hooks.register_module_forward_hook(watch.after, with_kwargs=True, always_call=True),
        register_optimizer_step_pre_hook(before),
        register_optimizer_step_post_hook(after),
    ]
    backward = torch.autograd.backward

    def read_casts(tensors, *args, **kwargs):
        reader.before_backward(tensors)
        return backward(tensors, *args, **kwargs)

    torch.autograd.backward = read_casts  # (Tensor.backward calls it too)
    try:
        yield
    finally:
        torch.autograd.backward = backward
        for handle in handles:
            handle.remove()
        atomic_write(path, json.dumps({"steps": steps, "unread": reader.unread}))


def _logits(output, inside):
    """The model's output where it holds logits, else the last output with rows a module inside it produced."""
    return output if rows_of(output) is not None else inside
