"""The weight every target gets in a training step, read by the probe where the loss meets the model's output —
one run of one split, nothing run again.

For a cross-entropy over the vocabulary (transformers' models given labels, ``F.cross_entropy`` on logits), the
gradient that reaches target t's logits is w_t (p_t − e_{y_t}): one negative entry, at the label, and every
other entry w_t times its probability. So w_t is the sum of the other entries over the sum of their
probabilities, read in float64 from the gradient and the logits the forward produced. A position whose
gradient is zero is no target (``ignore_index``, padding). A row whose gradient has another shape (label
smoothing, a z-loss, a regression) is not read, and said. On per-token log-probabilities (TRL's fused forward
returns `log_probs`, its loss −Σ w_t log p_t) the gradient is −w_t itself.

Each forward's weights are kept per row (count, sum, least, largest): the probe gathers them with the rest of
the step (gaeq.script.steps), and gaeq.script.objective says what they mean. The weights are this rank's, as
its backward made them; a loss scaler's scale is taken out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

import gaeq.dtensors as dtensors
from gaeq.perturb import rows_of

CHUNK = 1 << 22
"""Elements of the logits read at once (32 MB in float64)."""
SAMPLE = 256
"""Targets of a forward whose gradients' shape is checked in full (a plain cross-entropy's): spread over it."""
UNITS = 64
"""How many units in the last place of the gradient's dtype a row may stray from w·p and still be a plain
cross-entropy's (rounding of the softmax and the subtraction, summed)."""


class TargetWeights:
    """One rank's reader: each training forward of the model hooks its logits; their backward reads the
    weights; `take` hands a phase's forwards on."""

    def __init__(self) -> None:
        self._pending: list[tuple] = []
        """Each forward's per-row counts, sums, least and largest weights and strayed share, on their device."""
        self.unread: str | None = None
        """Why the weights could not be read (the first reason met), else None."""
        self.scale = 1.0
        """The loss scale the backward in progress carries (GradScaler's), divided out of the weights."""

    def watch(self, output) -> None:
        """The model's output of a training forward: its logits are read when their gradient arrives — or its
        per-token log-probabilities (TRL's fused forward, `fused_lm_head=True`: `log_probs`, the loss −Σ w_t log p_t),
        whose gradient is −w_t itself."""
        logps = output.get("log_probs") if isinstance(output, Mapping) else None
        if isinstance(logps, torch.Tensor) and logps.requires_grad and logps.dim() == 2:
            mask = output.get("label_mask")  # (an ignored position's log p is a constant 0: its gradient no weight)
            mask = mask.detach() if isinstance(mask, torch.Tensor) and mask.shape == logps.shape else None
            logps.register_hook(
                lambda grad: self._keep(-grad.detach().double() * (1 if mask is None else mask), grad.dtype)
            )
            return
        logits = rows_of(output)
        if logits is None:
            return self._said("the model's output holds no logits (it returns its loss alone, or fuses it)")
        if dtensors.is_dtensor(logits):
            return self._said("its logits are sharded over ranks (a DTensor)")
        if logits.dim() < 2 or not logits.is_floating_point() or logits.shape[-1] < 2:
            return self._said("its output has no class dimension: not a cross-entropy over logits")
        saved = logits.detach()
        logits.register_hook(lambda grad: self._read(saved, grad))

    def take(self) -> list[dict]:
        """The forwards read since the last take (a phase's), each ``{"rows": [[n, sum, least, largest], …]}`` — read
        back from the device here, once a phase (a forward whose gradient is not a plain cross-entropy's is said)."""
        taken, self._pending = self._pending, []
        forwards = []
        for n, total, small, big, strayed, eps in taken:
            if float(strayed) > UNITS * eps:
                self._said(
                    f"the gradient at the model's output is not a plain cross-entropy's over logits (off w·p by "
                    f"{float(strayed):.1e} of it: a regression, label smoothing, a z-loss, another loss)"
                )
                continue
            rows = zip(n.tolist(), total.tolist(), small.tolist(), big.tolist())
            forwards.append(
                {"rows": [[k, s, lo, hi] if k else [0, 0.0, 0.0, 0.0] for k, s, lo, hi in rows], "eps": eps}
            )
        return forwards

    def _said(self, why: str) -> None:
        self.unread = self.unread or why

    def _read(self, logits: torch.Tensor, grad: torch.Tensor) -> None:
        classes = logits.shape[-1]
        z, g = logits.reshape(-1, classes), grad.detach().reshape(-1, classes)
        weights = torch.empty(z.shape[0], dtype=torch.float64, device=z.device)
        step = max(1, CHUNK // classes)
        for i in range(0, z.shape[0], step):
            zi, gi = z[i : i + step].float(), g[i : i + step]
            label = gi.argmin(dim=-1, keepdim=True)
            # w from the entries off the label — sums of positive terms, no cancellation where p[y] nears 1:
            # their gradient's sum over their probability's, exp(logsumexp of the others − logsumexp of all)
            others = (zi.scatter(-1, label, -torch.inf).logsumexp(dim=-1) - zi.logsumexp(dim=-1)).double().exp()
            pushed = gi.scatter(-1, label, 0).clamp_min(0).sum(dim=-1, dtype=torch.float64)
            weights[i : i + step] = torch.where(others > 0, pushed / others.clamp_min(1e-300), 0.0)
        self._keep(weights.view(logits.shape[0], -1), grad.dtype, strayed=self._strayed(z, g, weights))

    def _keep(self, weights: torch.Tensor, dtype: torch.dtype, *, strayed: torch.Tensor | None = None) -> None:
        """A forward's weights, [rows, positions] (0: no target), kept per row on their device, the loss scale
        taken out; `take` reads them back."""
        rows = weights / (self.scale if isinstance(self.scale, torch.Tensor) else float(self.scale))
        targets = rows != 0
        big = torch.where(targets, rows, -torch.inf).amax(dim=1)
        small = torch.where(targets, rows, torch.inf).amin(dim=1)
        stray = strayed if strayed is not None else torch.zeros((), device=rows.device)
        self._pending.append((targets.sum(dim=1), rows.sum(dim=1), small, big, stray, torch.finfo(dtype).eps))

    @staticmethod
    def _strayed(z: torch.Tensor, g: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """How far the gradients of SAMPLE positions spread over the forward stray from w·p off their label, relative
        to w·max p (a plain cross-entropy's: rounding), in float64 — its targets only, on their device."""
        chosen = torch.arange(0, z.shape[0], max(1, z.shape[0] // SAMPLE), device=z.device)[:SAMPLE]
        gi, p, w = g[chosen].double(), torch.softmax(z[chosen].double(), dim=-1), weights[chosen]
        rest = (gi - w[:, None] * p).scatter_(-1, gi.argmin(dim=-1, keepdim=True), 0.0).abs().amax(dim=-1)
        return torch.where(w != 0, rest / (w.abs() * p.amax(dim=-1)).clamp_min(1e-300), 0.0).amax()


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
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        atomic_write(path, json.dumps({"steps": steps, "unread": reader.unread}))


def _logits(output, inside):
    """The model's output where it holds logits, else the last output with rows a module inside it produced."""
    return output if rows_of(output) is not None else inside
