"""What gaeq records inside every rank of a user's script, without a change to it: loaded before
the script runs (gaeq.script.attach), it hooks the calls every PyTorch training loop makes and
writes, per optimizer step, what was really optimised and on which data.

- **the objective**: the value of every scalar handed to autograd's backward (``loss.backward()``,
  DeepSpeed's and accelerate's ``backward``, which end there: DeepSpeed's ÷ GA included), summed over
  the step's micro-steps and averaged over ranks as DDP averages gradients — a missing ÷ GA shows
  as × GA even when the logged loss looks right;
- **the grad norm before clipping**, in float64, from the outermost module's gradients at the first
  ``clip_grad_norm_`` of the step (or at the optimizer step when nothing clips) — a DeepSpeed engine's
  own (``get_global_grad_norm``: it clips inside its step, and ZeRO ≥ 1 keeps no ``.grad``);
- **events**: backward, clip, zero_grad, scheduler and optimizer-step calls per optimizer step;
- **the data**: a fingerprint of every row the outermost module's training forward receives (its
  tensor arguments' rows hashed together), gathered over ranks — each step's multiset of samples;
- **the weights**: a fingerprint of the initial parameters and, after each step, a fixed random
  projection of them (an update sketch).

Rank 0 writes the trace (``trace.jsonl``, as gaeq's own trainers do, the objective as its loss)
and ``probe.json``; after the asked number of steps every rank leaves (the script is stopped).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gaeq.script.contract import ENV, PROBE_FILE

ACTIVE: Probe | None = None
"""The probe of this process, once installed (what ``gaeq.probe(model=…)`` tells)."""
SKETCH_ENTRIES = 256
"""Entries of each parameter the update sketch projects (fixed positions and weights per parameter)."""


class Probe:
    def __init__(self, out: Path, steps: int) -> None:
        self.out, self.steps = out, steps
        self.step = 0
        self.model: torch.nn.Module | None = None
        """The outermost module of the first training forward (DDP's wrapper, if there is one)."""
        self.initial: str | None = None
        self.dropout: dict[str, float] = {}
        """The model's dropout modules active in its first training forward: name → p."""
        self.record: list[dict[str, Any]] = []
        self._depth = 0
        self._seen = False
        self._outer: torch.nn.Module | None = None
        self._sketch: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._new_step()

    @classmethod
    def from_env(cls) -> Probe:
        config = json.loads(os.environ[ENV])
        return cls(Path(config["out"]), int(config["steps"]))

    def _new_step(self) -> None:
        self.losses: list[float] = []
        self.rows: list[int] = []
        self.samples: list[str] = []
        self.events: Counter[str] = Counter()
        self.grad_norm: float | None = None
        self.lr: float | None = None
        self.started = time.perf_counter()

    # --- the hooks ------------------------------------------------------------------------------

    def install(self) -> None:
        global ACTIVE
        ACTIVE = self
        backward = torch.autograd.backward

        @functools.wraps(backward)
        def probed_backward(tensors, *args, **kwargs):
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                self.losses.append(float(tensors.detach().double()))
            self.events["backward"] += 1
            return backward(tensors, *args, **kwargs)

        torch.autograd.backward = probed_backward  # Tensor.backward calls it too

        clip = torch.nn.utils.clip_grad_norm_

        @functools.wraps(clip)
        def probed_clip(parameters, *args, **kwargs):
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.events["clip"] += 1
            if self.grad_norm is None:
                self.grad_norm = _norm([p.grad for p in parameters if p.grad is not None])
            return clip(parameters, *args, **kwargs)

        torch.nn.utils.clip_grad_norm_ = probed_clip
        torch.nn.utils.clip_grad.clip_grad_norm_ = probed_clip

        zero_grad = torch.optim.Optimizer.zero_grad

        @functools.wraps(zero_grad)  # its signature too: libraries inspect it (accelerate's zero_grad)
        def probed_zero_grad(optimizer, *args, **kwargs):
            self.events["zero_grad"] += 1
            return zero_grad(optimizer, *args, **kwargs)

        torch.optim.Optimizer.zero_grad = probed_zero_grad

        scheduler_step = torch.optim.lr_scheduler.LRScheduler.step

        @functools.wraps(scheduler_step)
        def probed_scheduler_step(scheduler, *args, **kwargs):
            self.events["scheduler"] += 1
            return scheduler_step(scheduler, *args, **kwargs)

        torch.optim.lr_scheduler.LRScheduler.step = probed_scheduler_step

        torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        torch.nn.modules.module.register_module_forward_hook(self._after_forward, with_kwargs=True, always_call=True)
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)

    def _before_forward(self, module, args) -> None:
        if self._depth == 0:
            self._outer = module
        self._depth += 1

    def _after_forward(self, module, args, kwargs, output) -> None:
        self._depth -= 1
        if self._depth or module is not self._outer or not torch.is_grad_enabled():
            return  # an inner module, or an evaluation forward
        if self.model is None:
            self.model = module
        if not self._seen:  # the first training forward: the model's dropout, as it trains
            self._seen = True
            self.dropout = active_dropout(self.model)
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.ndim > 0]
        if not tensors:
            return
        rows = tensors[0].shape[0]
        same = [t.detach().cpu().contiguous() for t in tensors if t.shape[0] == rows]
        self.rows.append(rows)
        for i in range(rows):
            digest = hashlib.blake2b(digest_size=8)
            for t in same:
                digest.update(t[i].numpy().tobytes())
            self.samples.append(digest.hexdigest())

    def _before_step(self, optimizer, args, kwargs) -> None:
        params = self._parameters(optimizer)
        if self.initial is None:
            self.initial = _fingerprint(params)
        if self.grad_norm is None:  # nothing clipped: the norm the optimizer is about to use
            self.grad_norm = _norm([p.grad for p in params if p.grad is not None])
        self.lr = float(optimizer.param_groups[0]["lr"])

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.events["optimizer_step"] += 1
        # A DeepSpeed engine (the outermost module) clips inside its step and, at ZeRO ≥ 1, keeps no
        # gradient in .grad: the norm it computed before clipping is the one to compare.
        if (norm := _engine_norm(self.model)) is not None:
            self.grad_norm = norm
        mine = {
            "losses": self.losses,
            "rows": self.rows,
            "samples": self.samples,
            "events": dict(self.events),
        }
        ranks = _gather(mine)
        if _rank() == 0:
            self._write(ranks, sketch=self._project(self._parameters(optimizer)))
        self.step += 1
        self._new_step()
        if self.step == self.steps:
            self.finish()

    def _parameters(self, optimizer) -> list[torch.Tensor]:
        """The model's parameters (the outermost module's, in its order), else the optimizer's."""
        if self.model is not None:
            return list(self.model.parameters())
        return [p for group in optimizer.param_groups for p in group["params"]]

    # --- what is written ------------------------------------------------------------------------

    def _write(self, ranks: list[dict[str, Any]], *, sketch: tuple[float, float]) -> None:
        world = len(ranks)
        objective = sum(sum(r["losses"]) for r in ranks) / world  # DDP averages the ranks' gradients
        samples = sorted(s for r in ranks for s in r["samples"])
        self.record.append(
            {
                "step": self.step,
                "objective": objective,
                "grad_norm": self.grad_norm,
                "lr": self.lr,
                "sketch": sketch[0],
                "sketch_scale": sketch[1],
                "world_size": world,
                "rows": [r["rows"] for r in ranks],
                "backward": [r["events"].get("backward", 0) for r in ranks],
                "events": ranks[0]["events"],
                "samples": samples,
                "seconds": time.perf_counter() - self.started,
            }
        )

    def _project(self, params: list[torch.Tensor]) -> tuple[float, float]:
        """A fixed random projection of the parameters, and its scale (the sum of the terms' sizes, what
        a difference is relative to): the same positions and weights in every run of the same model, so
        two runs' sketches differ only where their updates do."""
        if self._sketch is None:
            self._sketch = []
            for i, p in enumerate(params):
                g = torch.Generator().manual_seed(1_000_003 * (i + 1) + p.numel())
                where = torch.randint(0, p.numel(), (min(SKETCH_ENTRIES, p.numel()),), generator=g)
                self._sketch.append((where, torch.randn(len(where), generator=g, dtype=torch.float64)))
        terms = [p.detach().reshape(-1)[w].double() * v for p, (w, v) in zip(params, self._sketch)]
        return float(sum(t.sum() for t in terms)), float(sum(t.abs().sum() for t in terms))

    def finish(self) -> None:
        """The asked steps are recorded: rank 0 publishes the trace, every rank leaves together."""
        if _rank() == 0:
            self.save(complete=True)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def save(self, *, complete: bool) -> None:
        """probe.json; and, when `complete`, the trace in gaeq's format (the objective as its loss)."""
        from gaeq.files import atomic_write
        from gaeq.results.trace import StepRecord, TraceWriter

        self.out.mkdir(parents=True, exist_ok=True)
        facts = {"steps": self.record, "initial": self.initial, "dropout": self.dropout, "complete": complete}
        facts["versions"] = _versions()
        atomic_write(self.out / PROBE_FILE, json.dumps(facts))
        if not complete:
            return
        writer = TraceWriter(self.out)
        samples = 0
        for r in self.record:
            samples += len(r["samples"])
            writer.write(
                StepRecord(
                    step=r["step"],
                    loss=r["objective"],
                    grad_norm=r["grad_norm"] if r["grad_norm"] is not None else float("nan"),
                    lr=r["lr"],
                    samples=samples,
                    seconds=r["seconds"],
                )
            )
        writer.close()


def active_dropout(model: torch.nn.Module) -> dict[str, float]:
    """Dropout modules in training mode with p > 0: their masks come from torch's global RNG, which
    draws them for other rows in every split — a split-dependent update, named in the verdict."""
    return {
        name or type(m).__name__: float(m.p)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0
    }


def _engine_norm(model: torch.nn.Module | None) -> float | None:
    """A DeepSpeed engine's global grad norm of this step, before clipping: its ZeRO optimizer's
    (computed before it steps the optimizer whose hook asks), else the engine's own (ZeRO-0)."""
    zero = getattr(getattr(model, "optimizer", None), "_global_grad_norm", None)
    if zero is not None:
        return float(zero)
    engine = getattr(model, "get_global_grad_norm", None)
    norm = engine() if callable(engine) else None
    return None if norm is None else float(norm)


def _norm(grads: list[torch.Tensor]) -> float:
    return float(sum(g.detach().double().pow(2).sum() for g in grads) ** 0.5) if grads else float("nan")


def _fingerprint(params: list[torch.Tensor]) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for p in params:
        digest.update(p.detach().cpu().contiguous().float().numpy().tobytes())
    return digest.hexdigest()


def _rank() -> int:
    """This rank: the process group's, or — before it is joined or after it is destroyed — the launcher's."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in ("torch", "deepspeed", "accelerate", "transformers"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found
