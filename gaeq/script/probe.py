"""What gaeq records inside every rank of a user's script, without a change to it: loaded before
the script runs (gaeq.script.attach), it hooks the calls every PyTorch training loop makes and
writes, per optimizer step, what was really optimised and on which data.

- **the objective**: the value of every scalar handed to autograd's backward (``loss.backward()``,
  DeepSpeed's and accelerate's ``backward``, which end there: DeepSpeed's ÷ GA included), summed over
  the step's micro-steps and averaged over ranks as DDP averages gradients — a missing ÷ GA shows
  as × GA even when the logged loss looks right;
- **the grad norm at the boundary, before clipping**, in float64: at the first ``clip_grad_norm_``
  after the step's last backward (whatever the script clipped before it), or at the optimizer step
  when nothing clips after it — a DeepSpeed engine's own (``get_global_grad_norm``: it clips inside
  its step, and ZeRO ≥ 1 keeps no ``.grad``);
- **events**: the calls the script makes per optimizer step — backward, clip, zero_grad, scheduler,
  optimizer step; a library wrapper that steps the scheduler it wraps several times (accelerate's
  prepared scheduler, once per process) is one call, and how far the schedule advanced is recorded
  beside it;
- **the data**: each row the model being trained receives — the first module called with gradients
  on that has trainable parameters (a loss module has none), or the one ``gaeq.probe(model=…)`` names
  — fingerprinted without its padding (gaeq.script.samples), gathered over ranks: each step's
  multiset of samples;
- **the cost**: rank 0's peak memory and the bytes its training wrapper (DDP, a DeepSpeed engine,
  FSDP2) put through collectives, per step (gaeq.trainers.cost, as gaeq's own trainers count them);
- **the weights**: a fingerprint of the initial parameters and, after each step, a fixed random
  projection of how far they moved (an update sketch).

Rank 0 writes the trace (``trace.jsonl``, as gaeq's own trainers do, the objective as its loss)
and ``probe.json``; after the asked number of steps every rank leaves (the script is stopped).
"""

from __future__ import annotations

import functools
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

import gaeq.newton_schulz as newton_schulz
import gaeq.perturb as perturb
from gaeq.accelerator import fp16_answer_record
from gaeq.script.contract import ENV, PROBE_FILE
from gaeq.script.ranks import gather, rank, versions
from gaeq.script.samples import SampleIdentity, trainable, wraps
from gaeq.script.weights import UpdateSketch, active_dropout, engine_norm, fingerprint, grad_norm

ACTIVE: Probe | None = None
"""The probe of this process, once installed (what ``gaeq.probe(model=…)`` tells)."""


class Probe:
    def __init__(self, out: Path, steps: int, perturbation: dict | None = None) -> None:
        self.out, self.steps = out, steps
        self.perturbation = perturbation or {}
        """An instrument's nudge or planted error (gaeq.perturb), applied from install on."""
        self.step = 0
        self.model: torch.nn.Module | None = None
        """The module being trained: the first called with gradients on that has trainable parameters
        (DDP's wrapper or DeepSpeed's engine, if there is one), or the one gaeq.probe(model=…) names."""
        self.reads: torch.nn.Module | None = None
        """The module whose inputs are the samples: the model, inside any wrapper (DDP, a DeepSpeed engine, a
        LightningModule whose training_step Lightning calls) — the same module at every split."""
        self.initial: str | None = None
        self.dropout: dict[str, float] = {}
        """The model's dropout modules active in its first training forward: name → p."""
        self.record: list[dict[str, Any]] = []
        self.samples = SampleIdentity()
        self._calls: list[bool] = []
        """Per module call in progress: whether it is a training call of the model (its inputs are read)."""
        self._seen = False
        self._sketch = UpdateSketch()
        self._scheduling = 0
        """Scheduler steps in progress (a scheduler stepping others inside its own step is one call)."""
        self._wrapper_call: Any = None
        self._depth = 0
        """Optimizer steps in progress (an optimizer stepping another inside its own step is one step)."""
        """The frame of the library wrapper's step that stepped the scheduler last (one call of the script's)."""
        self._memory: Any = None
        self._comm: Any = None
        self._new_step()

    @classmethod
    def from_env(cls) -> Probe:
        config = json.loads(os.environ[ENV])
        return cls(Path(config["out"]), int(config["steps"]), config.get("perturbation"))

    def _new_step(self) -> None:
        self.losses: list[float] = []
        self.rows: list[int] = []
        self.fingerprints: list[str] = []
        self.keys: list[str] = []
        self.inputs: list[str] = []
        self.lengths: list[int | None] = []
        self.exact = True
        self.events: Counter[str] = Counter()
        self._orthogonalised = newton_schulz.calls()
        self.grad_norm: float | None = None
        self._norm_after_backward: float | None = None
        """The norm at the first clip since the last backward (the boundary's, when no backward follows)."""
        self.lr: float | None = None
        self.spent = 0.0
        """Seconds the probe's own work took in this step (hashing, norms, gathering, writing)."""
        self.started = time.perf_counter()

    # --- the hooks ------------------------------------------------------------------------------

    def install(self) -> None:
        global ACTIVE
        ACTIVE = self
        backward = torch.autograd.backward

        @functools.wraps(backward)
        def probed_backward(tensors, *args, **kwargs):
            if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                started = time.perf_counter()
                self.losses.append(float(tensors.detach().double()))
                self.spent += time.perf_counter() - started
            self.events["backward"] += 1
            newton_schulz.count(loaded_only=True)  # a Muon the script has imported by now: its kernels counted
            self._norm_after_backward = None  # the gradient changes: a clip after this one reads the new norm
            return backward(tensors, *args, **kwargs)

        torch.autograd.backward = probed_backward  # Tensor.backward calls it too

        clip = torch.nn.utils.clip_grad_norm_

        @functools.wraps(clip)
        def probed_clip(parameters, *args, **kwargs):
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            self.events["clip"] += 1
            if self._norm_after_backward is None:  # before it clips: a clip per micro-step reads each one's
                started = time.perf_counter()
                self._norm_after_backward = grad_norm([p.grad for p in parameters if p.grad is not None])
                self.spent += time.perf_counter() - started
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
            if not self._scheduling:
                self.events["schedule_advanced"] += 1
                if self._called_by_script(scheduler, sys._getframe(1)):
                    self.events["scheduler"] += 1
            self._scheduling += 1
            try:
                return scheduler_step(scheduler, *args, **kwargs)
            finally:
                self._scheduling -= 1

        torch.optim.lr_scheduler.LRScheduler.step = probed_scheduler_step

        pad_sequence = torch.nn.utils.rnn.pad_sequence

        @functools.wraps(pad_sequence)
        def probed_pad_sequence(sequences, batch_first=False, padding_value=0.0, *args, **kwargs):
            self.samples.pad_values.add(padding_value)  # the collation's padding: removed before hashing
            return pad_sequence(sequences, batch_first, padding_value, *args, **kwargs)

        torch.nn.utils.rnn.pad_sequence = probed_pad_sequence

        torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        torch.nn.modules.module.register_module_forward_hook(self._after_forward, with_kwargs=True, always_call=True)
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)
        if self.perturbation:  # after the probe's own hooks: it reads each step's norm before a nudge
            self._perturbed = perturb.applied(**self.perturbation, reorder_rows=True)  # held: the process's life
            self._perturbed.__enter__()

    def _called_by_script(self, scheduler, caller) -> bool:
        """Whether this scheduler step is a call of the script's: not a library wrapper's repeat of
        one call (accelerate's prepared scheduler steps the one it wraps once per process)."""
        owner = caller.f_locals.get("self")
        if owner is None or owner is scheduler or getattr(owner, "scheduler", None) is not scheduler:
            return True
        if caller is self._wrapper_call:
            return False  # the same call of the wrapper, stepping again
        self._wrapper_call = caller
        self.events[f"wrapper:{type(owner).__module__}.{type(owner).__qualname__}"] = 1
        return True

    def _before_forward(self, module, args) -> None:
        if any(self._calls):  # inside the model: its own modules
            self._calls.append(False)
            return
        if self.model is None and torch.is_grad_enabled() and trainable(module):
            self.model = module
            self._attach_cost(module)
        if self.reads is None and torch.is_grad_enabled() and trainable(module) and not wraps(module):
            self.reads = module  # (inside a wrapper's call: what it calls is the model that gets the batch)
        self._calls.append(module is self.reads and torch.is_grad_enabled())

    def _after_forward(self, module, args, kwargs, output) -> None:
        if not self._calls.pop():
            return  # another module than the model (a loss, a metric, a teacher), or an evaluation forward
        started = time.perf_counter()
        if not self._seen:  # the first training forward: the model's dropout, as it trains
            self._seen = True
            self.dropout = active_dropout(self.model)
        batch = self.samples.read(module, args, kwargs)
        self.spent += time.perf_counter() - started
        if batch is None:
            return
        self.rows.append(len(batch.fingerprints))
        self.fingerprints.extend(batch.fingerprints)
        self.keys.extend(batch.keys)
        self.inputs = self.inputs or batch.names
        self.lengths.append(batch.length)
        self.exact &= batch.exact

    def _attach_cost(self, model: torch.nn.Module) -> None:
        """Count what the model's training wrapper sends (before its first backward: DDP takes a comm
        hook only then), and this process's peak memory from now on."""
        from gaeq.trainers.cost import CommCounter, PeakMemory

        self._memory = PeakMemory(next(model.parameters()).device)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            self._comm = CommCounter()  # a single process sends nothing
            return
        counter = CommCounter()
        try:
            counter.attach(model)
        except RuntimeError:  # DDP with a comm hook of the script's own: one hook per model
            return
        if counter.attached:
            self._comm = counter

    def _before_step(self, optimizer, args, kwargs):
        """Before an optimizer's step: the step's boundary is read now — or, for `step(closure)`, after the
        closure ran (its forward's samples and its backward's gradients are this step's: Lightning's last
        micro-batch runs inside the step). An optimizer stepping another inside its own step is one step."""
        self._depth += 1
        if self._depth > 1:
            return None
        return perturb.after_closure(args, kwargs, lambda: self._at_boundary(optimizer)) or self._at_boundary(optimizer)

    def _at_boundary(self, optimizer) -> None:
        started = time.perf_counter()
        params = self._parameters(optimizer)
        if self.initial is None:
            self.initial = fingerprint(params)
            if rank() == 0:
                self._sketch.start(params)
        # the boundary's norm before clipping: the first clip's after the last backward, else now
        self.grad_norm = self._norm_after_backward
        if self.grad_norm is None:
            self.grad_norm = grad_norm([p.grad for p in params if p.grad is not None])
        self.lr = float(optimizer.param_groups[0]["lr"])
        self.spent += time.perf_counter() - started

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._depth -= 1
        if self._depth:
            return  # a step inside another optimizer's: part of its outer step
        if self.step and not self.events["backward"]:  # no backward since the last: another optimizer of that
            if self.record:  # step (Muon for the matrices, AdamW for the rest): one step, its calls counted
                self.record[-1]["events"]["optimizer_step"] += 1
                self.record[-1]["events"].setdefault(f"stepped:{type(optimizer).__name__}", 1)
            return
        entered = time.perf_counter()
        self.events["optimizer_step"] += 1
        self.events[f"stepped:{type(optimizer).__name__}"] = 1  # which optimizers this step stepped
        if orthogonalised := newton_schulz.calls() - self._orthogonalised:  # Muon's, this step on this rank
            self.events["newton_schulz"] = orthogonalised
        # A DeepSpeed engine (the outermost module) clips inside its step and, at ZeRO ≥ 1, keeps no
        # gradient in .grad: the norm it computed before clipping is the one to compare.
        if (norm := engine_norm(self.model)) is not None:
            self.grad_norm = norm
        mine = {
            "losses": self.losses,
            "rows": self.rows,
            "samples": self.fingerprints,
            "keys": self.keys,
            "inputs": self.inputs,
            "lengths": self.lengths,
            "exact": self.exact,
            "events": dict(self.events),
        }
        comm = self._comm.take() if self._comm is not None else None  # before the probe's own gather
        ranks = gather(mine)
        if rank() == 0:
            peak = self._memory.peak_bytes() if self._memory is not None else None
            sketch = self._sketch(self._parameters(optimizer))
            self.spent += time.perf_counter() - entered
            self._write(ranks, sketch=sketch, comm=comm, peak=peak)
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

    def _write(
        self, ranks: list[dict[str, Any]], *, sketch: tuple[float, float], comm: int | None, peak: int | None
    ) -> None:
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
                "newton_schulz": [r["events"].get("newton_schulz", 0) for r in ranks],
                "events": ranks[0]["events"],
                "samples": samples,
                "keys": sorted(k for r in ranks for k in r["keys"]),
                "inputs": ranks[0]["inputs"],
                "lengths": sorted({n for r in ranks for n in r["lengths"] if n is not None}),
                "exact": all(r["exact"] for r in ranks),
                "comm_bytes": comm,
                "peak_mem_bytes": peak,
                "seconds": time.perf_counter() - self.started,
                "probe_seconds": self.spent,
            }
        )

    def finish(self) -> None:
        """The asked steps are recorded: rank 0 publishes the trace, every rank leaves together."""
        if rank() == 0:
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
        facts["versions"], facts["accelerator_fp16"] = versions(), fp16_answer_record()  # None: no DeepSpeed
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
                    comm_bytes=r["comm_bytes"],
                    peak_mem_bytes=r["peak_mem_bytes"],
                )
            )
        writer.close()
