"""What gaeq records inside every rank of a user's script, without a change to it: loaded before
the script runs (gaeq.script.attach), it hooks the calls every PyTorch training loop makes and
writes, per optimizer step, what was really optimised and on which data.

- **the objective**: every scalar handed to autograd's backward (DeepSpeed's and accelerate's ``backward``
  end there), summed over the step's micro-steps and ranks as the optimizer receives them
  (gaeq.objective.weighting.objective_factor);
- **the grad norm at the boundary, before clipping**, in float64: at the first ``clip_grad_norm_``
  after the step's last backward (whatever the script clipped before it), or at the optimizer step
  when nothing clips after it — over every optimizer of the training step, each gradient read once
  (gaeq.script.steps) — or a DeepSpeed engine's own (``get_global_grad_norm``: it clips inside
  its step, and ZeRO ≥ 1 keeps no ``.grad``);
- **events**: the calls the script makes per optimizer step — backward, clip, zero_grad, scheduler,
  optimizer step (a library wrapper's repeats of one call, one call: gaeq.script.calls);
- **the data**: each row the model being trained receives — the first module called with gradients
  on that has trainable parameters, or the one ``gaeq.probe(model=…)`` names — fingerprinted without
  its padding (gaeq.script.samples), gathered over ranks: each step's multiset of samples;
- **the cost**: rank 0's peak memory and its wrapper's collective bytes per step (gaeq.trainers.cost);
- **the weights**: the initial parameters' fingerprint and, after each step, an update sketch — DTensors
  (FSDP2's) read where they live; and **each target's weight** in the step (gaeq.script.targets);
- **the precision**: the arithmetic that ran (gaeq.script.precision) — in a cell labelled fp32, the script
  made float32; a loss scaler's skipped update is a training step recorded ``skipped``.

A failure of the probe's own code stops the script and is written down as gaeq's (``contract.FAILURE_FILE``).

A record is a training step — one optimizer's step or several (gaeq.script.steps); ``step(closure)`` is read
after its closure ran. Rank 0 writes the trace (``trace.jsonl``, the objective as its loss) and ``probe.json``;
after the asked number of steps every rank leaves (the script is stopped).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import gaeq.newton_schulz as newton_schulz
import gaeq.perturb as perturb
import gaeq.script.calls as calls
from gaeq.accelerator import fp16_answer_record
from gaeq.contract import ENV, FAILURE_FILE, PROBE_FILE, failed_in_gaeq
from gaeq.rows import trains, wraps
from gaeq.script.precision import Precision
from gaeq.script.ranks import gather, rank, versions
from gaeq.script.samples import SampleIdentity
from gaeq.script.steps import Boundary, Seen, TrainingSteps, record, write_trace
from gaeq.script.targets import TargetWeights
from gaeq.script.weights import AsLeft, UpdateSketch, active_dropout, engine_norm, fingerprint, grad_norm

ACTIVE: Probe | None = None
"""The probe of this process, once installed (what ``gaeq.probe(model=…)`` tells)."""


def guarded(method):
    """The probe's own code: an exception raised in it is gaeq's — written down (contract.FAILURE_FILE)
    before it stops the script, so that the cell's reason says so."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            self.failed(exc)
            raise

    return run


class Probe:
    def __init__(self, out: Path, steps: int, perturbation: dict | None = None, *, float32: bool = False) -> None:
        self.out, self.steps = out, steps
        self.perturbation = perturbation or {}
        """An instrument's nudge or planted error (gaeq.perturb), applied from install on."""
        self.precision = Precision(force_float32=float32)
        self.targets = TargetWeights()
        self._applied = self._nudge = self._failure = None
        """(The nudge: a noise-floor twin's, applied before the probe reads a step's norm: that norm is the twin's.)"""
        self._steps_begun = self.step = 0
        self.model: torch.nn.Module | None = None
        """The module being trained (gaeq.rows.trains: DDP's wrapper or DeepSpeed's engine, if there is one), or
        the one gaeq.probe(model=…) names."""
        self.reads: torch.nn.Module | None = None
        """The module whose inputs are the samples: the model, inside any wrapper (DDP, a DeepSpeed engine, a
        LightningModule whose training_step Lightning calls) — the same module at every split."""
        self.initial, self.record, self.samples, self.steps_of = None, [], SampleIdentity(), TrainingSteps()
        self.dropout: dict[str, float] = {}
        """The model's dropout modules active in its first training forward: name → p."""
        self.open: tuple[Seen, Boundary] | None = None
        """The open training step: what this rank saw in its phases so far, what rank 0 read at their ends."""
        self._calls: list[bool] = []
        """Per module call in progress: whether it is a training call of the model (its inputs are read)."""
        self._first_forward = True
        self._resolutions: list[torch.Tensor] = []
        self._pending: list[tuple[torch.nn.Module, tuple]] = []
        """Micro-batches received on an accelerator, read at the phase's end (no host sync per forward)."""
        self._sketch = UpdateSketch()
        self._depth = 0
        """Optimizer steps in progress (an optimizer stepping another inside its own step is one step)."""
        self._memory: Any = None
        self._comm: Any = None
        self._optimizer: Any = None
        self._clip: tuple[float, set[int]] | None = None
        """The norm the first clip after the last backward read, and of which parameters (until a step reads it)."""
        self._clipped = False
        self._left = AsLeft()
        self._read: set[int] = set()
        """The parameters whose gradient this training step's norm has read since the last backward."""
        self._orthogonalised_by_backward = 0
        self._new_phase()

    @classmethod
    def from_env(cls) -> Probe:
        config = json.loads(os.environ[ENV])
        probe = cls(
            Path(config["out"]), int(config["steps"]), config.get("perturbation"), float32=config.get("float32", False)
        )
        probe.precision.switched_off.extend(config.get("switched_off", []))  # by the launch: a config's sections
        return probe

    def failed(self, exc: BaseException) -> None:
        """The probe's own code raised: written down once, for the launch to read."""
        if self._failure is None:
            self._failure = failed_in_gaeq(exc)
            self.write(FAILURE_FILE.format(rank=rank()), self._failure)

    def write(self, name: str, said: dict) -> None:
        """One of this rank's records for the launch to read (gaeq.contract), in the cell's directory."""
        from gaeq.files import atomic_write

        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write(self.out / name, json.dumps(said))

    def _new_phase(self) -> None:
        """From one optimizer step to the next: what this rank sees, what rank 0 reads at its end."""
        self.seen, self.boundary = Seen(), Boundary()
        self._orthogonalised = newton_schulz.calls()
        self.started = time.perf_counter()

    @property
    def events(self):
        return self.seen.events

    # --- the hooks ------------------------------------------------------------------------------

    def install(self) -> None:
        global ACTIVE
        ACTIVE = self
        calls.patch(self)  # backward, clipping, zero_grad, the schedulers, pad_sequence
        torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
        torch.nn.modules.module.register_module_forward_hook(self._after_forward, with_kwargs=True, always_call=True)
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)
        self.precision.install(on_skipped=self._skipped_step, steps_taken=lambda: self._steps_begun)
        if self.perturbation:  # after the probe's own hooks: it nudges each step's gradients before it reads them
            given = dict(self.perturbation)
            unit = getattr(torch, given.pop("unit")) if given.get("unit") else given.pop("unit", None)
            self._perturbed = perturb.applied(**given, unit=unit, reorder_rows=True)  # held: the process's life
            self._applied = self._perturbed.__enter__()
            self._nudge = self._applied.nudge

    def name_model(self, model: torch.nn.Module) -> None:
        """The script named its model (gaeq.probe): the instruments act on it too."""
        if self._applied is not None:
            self._applied.name_model(model)

    @guarded
    def _before_backward(self, tensors) -> None:
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            started = time.perf_counter()
            self.seen.losses.append(self.precision.unscaled(tensors))  # on its device: read at the step's end
            self.targets.before_backward(tensors, scale=self.precision.scale)  # (its targets' weights carry it)
            if (low := self.precision.loss_dtype(tensors)) is not None:  # the value known to half a unit of it
                self._resolutions.append(self.seen.losses[-1].abs() * torch.finfo(low).eps / 2)
            self.boundary.spent += time.perf_counter() - started
        self.events["backward"] += 1
        newton_schulz.count(loaded_only=True)  # a Muon the script has imported by now: its kernels counted
        self._orthogonalised_by_backward = newton_schulz.calls()  # before it: on a partial gradient
        self._clip, self._clipped, self._read = None, False, set()  # the gradient changes: read anew

    @guarded
    def _after_backward(self) -> None:
        self._left.take(self.model)

    @guarded
    def _all_reduce(self, tensor, op: str | None = None, *, done: bool = False) -> bool:
        """Before a script's all-reduce: whether `tensor` is a gradient as left; after it, read (AsLeft)."""
        return self._left.all_reduced(tensor, op) if done else self._left.holds(tensor)

    @guarded
    def _before_clip(self, parameters: list[torch.Tensor]) -> None:
        self.events["clip"] += 1
        if not self._clipped:  # before it clips: a clip per micro-step reads each one's
            started = time.perf_counter()
            self._clipped = True
            self._left.at_clip()  # a rescale before the clip (Megatron-LM's ÷ the step's tokens)
            with_grad = [p for p in parameters if p.grad is not None]
            if self._nudge is not None:
                self._nudge.nudge_grads(with_grad)
            self._clip = grad_norm([p.grad for p in with_grad]), {id(p) for p in with_grad}
            self.boundary.spent += time.perf_counter() - started

    @guarded
    def _before_forward(self, module, args) -> None:
        if any(self._calls):  # inside the model: its own modules
            self._calls.append(False)
            return
        if self.model is None and trains(module):
            self.model = module
            from gaeq.trainers.cost import watch_cost  # (loaded once a model trains)

            self._memory, self._comm = watch_cost(module)
        if self.reads is None and trains(module) and not wraps(module):
            self.reads = module  # (inside a wrapper's call: what it calls is the model that gets the batch)
        self._calls.append(module is self.reads and torch.is_grad_enabled())
        if self._calls[-1]:
            self.precision.entered(self.model if self.model is not None else module)

    @guarded
    def _after_forward(self, module, args, *kwargs_output) -> None:
        # (module, args, kwargs, output); torch calls an always-call hook without kwargs when the forward
        # raised — activation checkpointing's recomputation stops that way (_StopRecomputationError)
        kwargs, output = kwargs_output if len(kwargs_output) == 2 else ({}, kwargs_output[-1])
        self.precision.output(output)
        if not self._calls.pop():
            return  # another module than the model (a loss, a metric, a teacher), or an evaluation forward
        self.precision.left()
        self.targets.watch(output)  # each target's weight, read as its gradient arrives
        started = time.perf_counter()
        if self._first_forward:  # the first training forward: the model's dropout, as it trains
            self._first_forward = False
            self.dropout = active_dropout(self.model)
        inputs = (args, kwargs)
        if any(t.device.type != "cpu" for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)):
            # on an accelerator: read at the phase's end, in one sync with the rest (a copy, safe from reuse)
            self._pending.append((module, pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), inputs)))
        else:
            self.seen.received(self.samples.read(module, args, kwargs))
        self.boundary.spent += time.perf_counter() - started

    def _before_step(self, optimizer, args, kwargs):
        """Before an optimizer's step: the step's boundary is read now — or, for `step(closure)`, after the
        closure ran (its forward's samples and its backward's gradients are this step's: Lightning's last
        micro-batch runs inside the step). An optimizer stepping another inside its own step is one step."""
        self._depth += 1
        if self._depth > 1:
            return None
        self._steps_begun += 1
        return perturb.after_closure(args, kwargs, lambda: self._at_boundary(optimizer)) or self._at_boundary(optimizer)

    @guarded
    def _at_boundary(self, optimizer) -> None:
        if self.steps_of.ends_open(id(optimizer), backward_since=self.events["backward"] > 0):
            self._close()  # the next accumulation's step: the open training step is over
        started = time.perf_counter()
        if self.initial is None:
            params = self._parameters(optimizer)
            self.initial = fingerprint(params)
            self._sketch.start(params)
        # the boundary's norm before clipping: the first clip's after the last backward, else now — of
        # the gradients no earlier optimizer of this training step read since that backward
        read = self.boundary
        if self._clip is None and not self._clipped and self._left.changed():
            read.edited = True  # changed in place since the last backward, by no clip call: the norm read after it
            self.events["clip"] += 1  # a change before the step, as a clip call is one
        if self._clip is not None:
            norm, ids = self._clip
            read.norm_squared, self._clip = (read.norm_squared or 0.0) + norm**2, None
            self._read |= ids
        params = [p for group in optimizer.param_groups for p in group["params"]]
        fresh = [p for p in params if p.grad is not None and id(p) not in self._read]
        if self._nudge is not None:
            self._nudge.nudge_grads(fresh)
        if fresh:
            read.norm_squared = (read.norm_squared or 0.0) + grad_norm([p.grad for p in fresh]) ** 2
            self._read |= {id(p) for p in fresh}
        read.lr = float(optimizer.param_groups[0]["lr"])
        self.precision.read_fused(optimizer, read)  # GradScaler's scale and skip, handed to a fused optimizer
        self.seen.rescale.append(self._left.rescale(float(self.targets.scale) / read.scale))  # (less the loss scale)
        self.seen.combined = self.seen.combined or self._left.combined
        read.spent += time.perf_counter() - started

    @guarded
    def _skipped_step(self, optimizer) -> None:
        """A loss scaler skipped this optimizer's update (inf/NaN in its gradients): a training step
        without an update, read and recorded as one, ``skipped``."""
        self._depth += 1
        self._at_boundary(optimizer)
        self.boundary.skipped = True
        self._after_step(optimizer, (), {})
        if self._nudge is not None:
            self._nudge.step_done()

    @guarded
    def _after_step(self, optimizer, args, kwargs) -> None:
        self._depth -= 1
        if self._depth:
            return  # a step inside another optimizer's: part of its outer step
        name = type(optimizer).__name__
        if self.record and self.open is None and not self.events["backward"]:  # after a closed training step,
            self.record[-1]["events"]["optimizer_step"] += 1  # no backward since: another optimizer of that one
            self.record[-1]["events"].setdefault(f"stepped:{name}", 1)
            self.boundary = Boundary(spent=self.boundary.spent)
            return
        entered = time.perf_counter()
        for module, (args, kwargs) in self._pending:  # the phase's micro-batches read on an accelerator
            self.seen.received(self.samples.read(module, args, kwargs))
        self._pending.clear()
        seen, read = self.seen, self.boundary
        seen.ended_by_step(name)
        seen.targets = self.targets.take(seen.row_keys)
        seen.losses = [float(v) for v in torch.stack(seen.losses).cpu()] if seen.losses else []  # one sync a phase
        seen.resolution = float(sum(self._resolutions)) if self._resolutions else 0.0
        self._resolutions = []
        if orthogonalised := newton_schulz.calls() - self._orthogonalised:  # Muon's, this phase on this rank
            seen.newton_schulz = orthogonalised
            if seen.events["backward"]:
                seen.newton_schulz_early = max(0, self._orthogonalised_by_backward - self._orthogonalised)
        # A DeepSpeed engine (the outermost module) clips inside its step and, at ZeRO ≥ 1, keeps no
        # gradient in .grad: the norm it computed before clipping is the one to compare.
        read.engine_norm = engine_norm(self.model)
        read.comm = self._comm.take() if self._comm is not None else None
        read.peak = self._memory.peak_bytes() if self._memory is not None else None
        read.seconds = time.perf_counter() - self.started
        read.spent += time.perf_counter() - entered
        if self.open is None:
            self.open = (seen, read)
        else:
            self.open[0].add(seen)
            self.open[1].add(read)
        self._new_phase()
        if self.steps_of.stepped(id(optimizer)):
            self._close()

    @guarded
    def _close(self) -> None:
        """The open training step is complete: gathered over ranks, written by rank 0 (its sketch of the
        weights before any later step moves them), and the script stopped after the asked steps."""
        if self.open is None:
            return
        seen, read = self.open
        entered = time.perf_counter()
        with self._comm.paused() if self._comm is not None else contextlib.nullcontext():
            ranks = gather(seen.shared())
        sketch = self._sketch(self._parameters(None))  # every rank: a DTensor's blocks are summed over them
        if rank() == 0:
            read.spent += time.perf_counter() - entered
            self.record.append(record(self.step, ranks, read, sketch=sketch))
        self.open = None
        self.steps_of.close()
        self.step += 1
        if self.step == self.steps:
            self.finish()

    def end_of_script(self) -> None:
        """The script ended of itself (every rank): a training step still open is complete — where the
        ranks can still meet to gather it (the script may have left its process group)."""
        alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
        if alone or (dist.is_available() and dist.is_initialized()):
            self._close()

    def _parameters(self, optimizer) -> list[torch.Tensor]:
        """The model's parameters (the outermost module's, in order), else the first step's optimizer's."""
        if self.model is not None:
            return list(self.model.parameters())
        if optimizer is not None:
            self._optimizer = optimizer
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    # --- what is written ------------------------------------------------------------------------

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
        facts = {"steps": self.record, "initial": self.initial, "dropout": self.dropout, "complete": complete}
        facts["versions"], facts["accelerator_fp16"] = versions(), fp16_answer_record()  # None: no DeepSpeed
        facts["precision"], facts["targets_unread"] = self.precision.facts(), self.targets.unread
        if self._applied is not None and self._applied.check is not None:  # a twin's: what besides rounding moves it
            facts["order_check"] = self._applied.check.found
        self.write(PROBE_FILE, facts)
        if complete:
            write_trace(self.out, self.record)
