"""A user's training step, as the probe (gaeq.script.probe) assembles it from the optimizer steps it sees.

A training step is what consumes the accumulated gradients: every optimizer stepped on them. Scripts
step one optimizer (the usual loop), several after one backward (torch's Muon for the matrices and AdamW
for the rest), or each after its own backward (a GAN's discriminator, then its generator). So an
optimizer step joins the open training step unless a backward came since the last step *and* this
optimizer already stepped in it — then the open one is over and a new one begins. The first training
step is closed only then (lazily: its optimizers are not known before); from there on, a training step
is closed as soon as every optimizer of the first has stepped (the probe can stop the script at once).

What one rank saw between two optimizer steps (a phase) is a :class:`Seen`; the training step's is the
sum of its phases'. A step per micro-batch stays a training step per micro-batch — what the split
check is there to catch — and names the optimizer that stepped (``stepped:AdamW``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from gaeq.objective.weighting import objective_factor


@dataclass
class Seen:
    """What one rank saw during a phase (or a training step, its phases summed): the values handed
    to backward, the model's rows per call and its samples, the calls made."""

    losses: list[float] = field(default_factory=list)
    resolution: float = 0.0
    """Half a unit of their dtype, summed over the losses handed to backward in bf16 or fp16."""
    rows: list[int] = field(default_factory=list)
    """Samples of each training call of the model (its micro-batch sizes; a packed row's sequences each one)."""
    packs: list[int] = field(default_factory=list)
    """Rows of each training call as received: where a row packs several samples, the micro-batch size of a script
    that packs its dataset before any sampler (TRL's packing: a pack is a dataset row)."""
    samples: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    lengths: list[int | None] = field(default_factory=list)
    exact: bool = True
    layouts: list[str] = field(default_factory=list)
    """How the micro-batches laid their samples out (gaeq.script.samples.MicroBatch.layout), each once."""
    events: Counter[str] = field(default_factory=Counter)
    phases: list[int] = field(default_factory=list)
    """Backward calls before each optimizer step that followed a backward: the micro-batches each
    optimizer accumulated (a GAN's pair: [GA, GA]; Muon + AdamW after one accumulation: [GA])."""
    newton_schulz: int = 0
    """Newton–Schulz orthogonalisations (Muon's) run on this rank."""
    newton_schulz_early: int = 0
    """… of which before a phase's last backward began: on a partial gradient (once per micro-batch)."""
    targets: list[dict | None] = field(default_factory=list)
    """The weights of each training forward's targets, per row (gaeq.script.targets), None where not read."""
    row_keys: list[list[str] | None] = field(default_factory=list)
    """Each training forward's rows' keys (gaeq.script.samples.MicroBatch.row_keys), None where no input was read:
    what its targets' weights are matched by in another split."""
    combined: str | None = None
    """How the ranks' gradients were combined by hand after the last backward (gaeq.script.weights.AsLeft.combined):
    "sum", "mean", "unread"; None: not by hand (DDP's, FSDP's or DeepSpeed's mean, or one rank)."""
    rescale: list[dict | None] = field(default_factory=list)
    """Per optimizer step: what the gradients were multiplied by after the last backward, at the step (`factor`) and
    at the first clip call (`before_clip`), the loss scale taken out (gaeq.script.weights.AsLeft.factor); None where
    not read (a DeepSpeed engine)."""

    def received(self, batch) -> None:
        """A micro-batch the model received (gaeq.script.samples.MicroBatch; None: no tensor input)."""
        self.row_keys.append(None if batch is None else batch.row_keys)
        if batch is None:
            return
        self.rows.append(batch.samples)
        self.packs.append(batch.rows if batch.rows is not None else batch.samples)
        self.samples.extend(batch.fingerprints)
        self.keys.extend(batch.keys)
        self.inputs = self.inputs or batch.names
        self.lengths.append(batch.length)
        self.exact &= batch.exact
        if batch.layout not in self.layouts:
            self.layouts.append(batch.layout)

    def ended_by_step(self, optimizer: str) -> None:
        """The optimizer step that ends this phase: its name and the micro-batches it accumulated."""
        self.events["optimizer_step"] += 1
        self.events[f"stepped:{optimizer}"] = 1
        if self.events["backward"]:
            self.phases.append(self.events["backward"])

    def add(self, later: Seen) -> None:
        """A later phase of the same training step."""
        listed = ("losses", "rows", "packs", "samples", "keys", "lengths", "phases", "targets", "row_keys", "rescale")
        for name in listed:
            getattr(self, name).extend(getattr(later, name))
        self.resolution += later.resolution
        self.combined = self.combined or later.combined
        self.inputs = self.inputs or later.inputs
        self.exact &= later.exact
        self.layouts += [layout for layout in later.layouts if layout not in self.layouts]
        stepped = {e for e in self.events if e.startswith("stepped:")}
        self.events.update(later.events)
        for e in stepped | {e for e in later.events if e.startswith("stepped:")}:
            self.events[e] = 1  # which optimizers stepped, not how often (optimizer_step counts)
        self.newton_schulz += later.newton_schulz
        self.newton_schulz_early += later.newton_schulz_early

    def shared(self) -> dict[str, Any]:
        """What is gathered from every rank."""
        return asdict(self) | {"events": dict(self.events)}


@dataclass
class Boundary:
    """What rank 0 reads at a training step's optimizer steps."""

    norm_squared: float | None = None
    """The gradients' squared norm, each read once: at a clip after the last backward, else at the step."""
    lr: float | None = None
    """The first optimizer's."""
    engine_norm: float | None = None
    """A DeepSpeed engine's own norm (it clips inside its step; ZeRO ≥ 1 keeps no .grad), when there is one."""
    comm: int | None = None
    peak: int | None = None
    seconds: float = 0.0
    spent: float = 0.0
    """Seconds the probe's own work took."""
    skipped: bool = False
    """A loss scaler skipped the update (inf/NaN in the gradients): a step without an update."""
    edited: bool = False
    """The gradients changed in place between the last backward and the step by no clip call gaeq knows (a clip
    written by hand, an unscale, an average): the norm was read after that change."""
    scale: float = 1.0
    """What the gradients read were still multiplied by (a loss scale a fused optimizer removes inside its step)."""

    @property
    def grad_norm(self) -> float:
        if self.engine_norm is not None:
            return self.engine_norm
        return float("nan") if self.norm_squared is None else self.norm_squared**0.5 / self.scale

    def add(self, later: Boundary) -> None:
        if later.norm_squared is not None:
            self.norm_squared = (self.norm_squared or 0.0) + later.norm_squared
        self.lr = self.lr if self.lr is not None else later.lr
        self.engine_norm = later.engine_norm if later.engine_norm is not None else self.engine_norm
        if later.comm is not None:
            self.comm = (self.comm or 0) + later.comm
        if later.peak is not None:
            self.peak = max(self.peak or 0, later.peak)
        self.seconds += later.seconds
        self.spent += later.spent
        self.skipped |= later.skipped
        self.scale = later.scale if later.scale != 1.0 else self.scale


class TrainingSteps:
    """Which optimizer steps make one training step (the module's rule), by the optimizers' identities."""

    def __init__(self) -> None:
        self.open: list[int] = []
        """The optimizers stepped in the open training step."""
        self.first: frozenset[int] | None = None
        """The first training step's optimizers, once it is closed."""

    def ends_open(self, optimizer: int, *, backward_since: bool) -> bool:
        """Before an optimizer steps: whether the open training step is over (it already stepped in it,
        and a backward came since: the next accumulation's)."""
        return bool(self.open) and backward_since and optimizer in self.open

    def stepped(self, optimizer: int) -> bool:
        """After it stepped (a part of the open training step): whether that one is complete — every
        optimizer of the first training step has stepped."""
        self.open.append(optimizer)
        return self.first is not None and self.first <= set(self.open)

    def close(self) -> None:
        if self.first is None:
            self.first = frozenset(self.open)
        self.open = []


def record(step: int, ranks: list[dict[str, Any]], read: Boundary, *, sketch: tuple[float, float]) -> dict[str, Any]:
    """A training step's record in probe.json: every rank's :meth:`Seen.shared`, rank 0's readings."""
    world = len(ranks)
    rescale, times = objective_factor(ranks)
    return {
        "step": step,
        "objective": sum(sum(r["losses"]) for r in ranks) * times,
        "objective_resolution": sum(r["resolution"] for r in ranks) * abs(times),
        "objective_rescale": rescale,
        "grad_norm": read.grad_norm,
        "lr": read.lr,
        "sketch": sketch[0],
        "sketch_scale": sketch[1],
        "world_size": world,
        "rows": [r["rows"] for r in ranks],
        "packs": [r["packs"] for r in ranks],
        "backward": [r["events"].get("backward", 0) for r in ranks],
        "phases": [r["phases"] for r in ranks],
        "newton_schulz": [r["newton_schulz"] for r in ranks],
        "newton_schulz_early": [r["newton_schulz_early"] for r in ranks],
        "targets": [r["targets"] for r in ranks],
        "rescale": [r["rescale"] for r in ranks],
        "combined": [r.get("combined") for r in ranks],
        "events": ranks[0]["events"],
        "samples": sorted(s for r in ranks for s in r["samples"]),
        "keys": sorted(k for r in ranks for k in r["keys"]),
        "inputs": ranks[0]["inputs"],
        "lengths": sorted({n for r in ranks for n in r["lengths"] if n is not None}),
        "exact": all(r["exact"] for r in ranks),
        "layouts": sorted({layout for r in ranks for layout in r["layouts"]}),
        "comm_bytes": read.comm,
        "peak_mem_bytes": read.peak,
        "seconds": read.seconds,
        "probe_seconds": read.spent,
        "skipped": read.skipped,
        "edited": read.edited,
    }


def write_trace(out, records: list[dict[str, Any]]) -> None:
    """The records as gaeq's trace (the objective as its loss; a skipped update ``skipped``)."""
    from gaeq.results.trace import StepRecord, TraceWriter

    writer = TraceWriter(out)
    samples = 0
    for r in records:
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
                skipped=r.get("skipped", False),
                loss_resolution=r.get("objective_resolution", 0.0),
            )
        )
    writer.close()
