"""What a script cell's probe saw, against its baseline's, before any number is compared: the same
samples in every optimizer step, the same initial weights, the same calls per optimizer step. Each
check gives its first divergence (step, reason); the trace comparison takes them as metrics
(gaeq.matrix.schema.METRICS: data, then init, then events, then the numbers).

A check is made only where its evidence is sound, never on a guess: the data check is not made when
a difference in fingerprints could be padding gaeq cannot tell from data (:func:`_unreadable`), and
a scheduler called another number of times is a divergence only where the lr it sets differs too
(a schedule sized for it — stepped per micro-step over GA × the steps — gives the same lr)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gaeq.contract import PROBE_FILE
from gaeq.matrix.schema import SCRIPT_METRICS
from gaeq.results.floor import CEILING, FACTOR

EVENTS = {
    "optimizer_step": "optimizer.step()",
    "clip": "clip_grad_norm_ (or a clip by hand)",
    "zero_grad": "zero_grad()",
    "scheduler": "scheduler.step()",
}
"""The calls counted per optimizer step (backward calls are the split's: GA per rank, checked first)."""
JUDGED_BY_LR = ("scheduler",)
"""Calls whose count matters only through the lr they set."""
ONCE_OR_NONE = ("clip",)
"""Calls where once against none is no divergence of itself: a clip written by hand that did not act changed nothing
gaeq can see (`if norm > max_norm:`, as Megatron-LM's clip), while a clip call is counted whether it acts or not —
the update and the loss judge the step, and the reason says the counts where they diverge."""


@dataclass(frozen=True)
class ScriptChecks:
    first: dict[str, tuple[int, str] | None]
    """Each check's first divergence (step, why), None where it found none."""
    not_checked: dict[str, str] = field(default_factory=dict)
    """Checks not made, and why (the verdict then comes from the numbers)."""
    notes: dict[str, str] = field(default_factory=dict)
    """metric → what the probe saw that explains it, added to the reason when that metric is the one caught."""
    remarks: list[str] = field(default_factory=list)
    """What the probe saw that differs from the baseline without being a divergence (another layout of the
    same samples), said in the reason whatever the verdict."""
    loss_as_handed: bool = False
    """One run changed its gradients in place by no clip call where the other called a clip: that change may be a
    clip written by hand, no rescale of the objective — the losses are compared as handed to backward, combined
    over the ranks (:func:`as_handed`), not × that change."""


def as_handed(trace: list, probe: dict) -> list:
    """A script's trace with each step's loss as handed to backward and combined over the ranks: its objective
    less the rescale after the last backward (gaeq.objective.weighting.objective_factor)."""
    from dataclasses import replace

    rescale = {s["step"]: s.get("objective_rescale") or 1.0 for s in probe.get("steps") or ()}
    return [replace(r, loss=r.loss / rescale.get(r.step, 1.0)) for r in trace]


def read_probe(cell_dir: Path) -> dict | None:
    path = Path(cell_dir) / PROBE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def script_checks(
    base: dict,
    cell: dict,
    *,
    split: Any = None,
    twins: list[dict] = (),
    rtol: float = 1e-5,
    lr_rtol: float = 1e-12,
) -> ScriptChecks:
    """Each check's first divergence of `cell`'s probe from `base`'s (None: none): the split it really
    ran (against the cell `split`, when given), then data, init, events, and the update sketch —
    within `rtol`, or the envelope the run's noise-floor `twins` set (gaeq.results.floor's rules); the lr
    agrees to `lr_rtol`, as the trace comparison asks."""
    found: dict[str, tuple[int, str] | None] = dict.fromkeys(m for m in SCRIPT_METRICS if m != "weights")
    not_checked: dict[str, str] = {}
    remarks = []
    if split is not None and cell["steps"] and (why := ran_another_split(split, cell["steps"])):
        short = _short_steps(split, cell["steps"], base["steps"])
        found["split"] = None if short else (0, why)
        remarks += [short] if short else []
    steps = list(zip(base["steps"], cell["steps"]))
    for b, c in steps:
        if (why := _samples_differ(b, c)) is not None:
            if (unreadable := _unreadable(b, c)) is not None:
                not_checked["data"] = unreadable
                del found["data"]
            else:
                found["data"] = (c["step"], f"the data of step {c['step']}: {why}")
            break
    else:
        if steps and (theirs := layouts(base["steps"])) != (ours := layouts(cell["steps"])):
            remarks.append(
                f"laid out otherwise than the baseline — {', '.join(ours)}, the baseline {', '.join(theirs)} —: "
                "the same samples, each trained on the same targets, in every step"
            )
    if base["initial"] != cell["initial"]:
        found["init"] = (
            0,
            "the initial weights differ from the baseline's: the model's init depends on the rank or the split "
            "(seed before building it, the same seed on every rank)",
        )
    lr_differs = _lr_differs(steps, lr_rtol)
    notes: dict[str, str] = {}
    for b, c in steps:
        for event, call in EVENTS.items():
            theirs, ours = b["events"].get(event, 0), c["events"].get(event, 0)
            if theirs != ours and event in ONCE_OR_NONE and {theirs, ours} == {0, 1}:
                said = f" ({call} called {ours}× in optimizer step {c['step']}, the baseline {theirs}×)"
                notes = {m: said for m in ("loss", "grad_norm", "update")} | notes
                continue
            if theirs != ours and (lr_differs or event not in JUDGED_BY_LR):
                found["events"] = (
                    c["step"],
                    f"{call} called {ours}× in optimizer step {c['step']}, the baseline {theirs}× "
                    f"({'per micro-step or per process' if ours > theirs else 'not'} where the baseline calls it once "
                    "per step?)",
                )
                break
        if found["events"] is not None:
            break
    found["events"] = found["events"] or orthogonalisation_differs(steps)
    found["update"] = _update_differs(base["steps"], cell["steps"], twins=twins, rtol=rtol)
    notes |= {"lr": note} if lr_differs and (note := _schedule_advanced(steps)) else {}
    if (edited := _norms_read_apart(steps)) is not None:
        not_checked["grad_norm"] = edited
        notes["loss"] = " (the losses as handed to backward: a change in place by no clip call may be a clip)"
        return ScriptChecks(first=found, not_checked=not_checked, notes=notes, remarks=remarks, loss_as_handed=True)
    if any(c.get("edited") for _, c in steps):
        notes["grad_norm"] = (
            " (in both, the norm after the script changed its gradients in place by no call gaeq patches, as a clip "
            "written by hand does: the gradient its optimizer received)"
        )
    return ScriptChecks(first=found, not_checked=not_checked, notes=notes, remarks=remarks)


def _norms_read_apart(steps: list[tuple[dict, dict]]) -> str | None:
    """Where one run's grad norm was read after its gradients changed in place by no clip call gaeq knows and the
    other's before its clip: not comparable — why (the update and the loss judge the step)."""
    for b, c in steps:
        if bool(b.get("edited")) != bool(c.get("edited")):
            who, other = ("this split", "the baseline") if c.get("edited") else ("the baseline", "this split")
            return (
                f"from optimizer step {c['step']} {who}'s gradients changed in place after its last backward by no "
                f"call gaeq patches (as a clip written by hand does), and its norm was read after that; {other}'s was "
                "read before its clip — the update and the loss judge the step"
            )
    return None


def layouts(steps: list[dict]) -> list[str]:
    """How a run's micro-batches laid their samples out, over its steps (a micro-batch that happened to
    need no padding says nothing of how its run pads: left out where another was padded)."""
    found = sorted({layout for s in steps for layout in s.get("layouts", ())})
    padded = [f for f in found if not f.startswith("no padding")]
    return padded or found


def _layout_note(base: dict, cell: dict) -> str:
    """The cell's layout, where it differs from the baseline's in that step."""
    theirs, ours = layouts([base]), layouts([cell])
    if theirs == ours:
        return ""
    return f" (laid out {', '.join(ours)}, the baseline {', '.join(theirs)})"


def orthogonalisation_differs(steps: list[tuple[dict, dict]]) -> tuple[int, str] | None:
    """A Muon's Newton–Schulz calls per optimizer step, against the baseline's (one rank: each of its
    matrices once, after the step's last backward). Ranks share the work differently — every rank every
    matrix (DDP, ZeRO-0), or each its partition's (ZeRO ≥ 1) — so a split orthogonalised each matrix once
    when no rank ran more calls than the baseline and the ranks together no fewer, and none ran before its
    step's last backward began where the baseline ran none there: that one orthogonalised a partial
    gradient — per micro-batch (DeepSpeed#8443's shape), seen at any GA ≥ 2 and world, however evenly
    the matrices split; fewer in all skipped matrices (none at all: #8441's)."""
    for b, c in steps:
        whole, mine = sum(b.get("newton_schulz", [0])), c.get("newton_schulz", [0])
        early, theirs = max(c.get("newton_schulz_early", [0])), max(b.get("newton_schulz_early", [0]))
        if early and not theirs:
            return (
                c["step"],
                f"Newton–Schulz ran {early}× on one rank in optimizer step {c['step']} before the step's last "
                "backward call, the baseline never: your Muon orthogonalised each micro-batch's gradient, not the "
                "accumulated one",
            )
        if max(mine) > whole or sum(mine) < whole:
            said = "more than once a step" if max(mine) > whole else "never" if sum(mine) == 0 else "not every matrix"
            return (
                c["step"],
                f"Newton–Schulz ran {max(mine)}× on one rank and {sum(mine)}× in all in optimizer step {c['step']}, "
                f"the baseline {whole}×: your Muon orthogonalised {said}",
            )
    return None


def _unreadable(base: dict, cell: dict) -> str | None:
    """Why two steps' fingerprints cannot be compared (None: they can): the inputs change length
    between micro-batches and some hold padding gaeq could not remove — the same sample then has
    another fingerprint beside other neighbours."""
    lengths = {*base.get("lengths", ()), *cell.get("lengths", ())}
    if len(lengths) < 2 or (base.get("exact", True) and cell.get("exact", True)):
        return None
    return (
        f"your model's inputs change length with the micro-batch ({min(lengths)} to {max(lengths)} "
        "positions: padded to each batch's longest?) and hold no attention_mask, and gaeq knows no padding value "
        "of theirs, so a sample's rows depend on its neighbours — pass the attention mask to the model, pad with "
        "torch.nn.utils.rnn.pad_sequence, or name the pad id with gaeq.probe(pad_id=…) for the data to be checked"
    )


def _lr_differs(steps: list[tuple[dict, dict]], rtol: float) -> bool:
    """Whether the lr of some optimizer step differs from the baseline's (as the trace comparison judges it)."""
    for b, c in steps:
        theirs, ours = b.get("lr"), c.get("lr")
        if theirs is None or ours is None:
            continue
        allowed = rtol * abs(theirs)
        if not abs(ours - theirs) <= allowed:
            return True
    return False


def _schedule_advanced(steps: list[tuple[dict, dict]]) -> str | None:
    """What moved the lr: the schedule advancing another number of times per optimizer step than the
    baseline's — through a library wrapper, when one stepped it (accelerate's prepared scheduler). A
    step's counts are the calls since the previous optimizer step: a scheduler stepped after
    ``optimizer.step()`` counts in the next one."""
    for b, c in steps:
        theirs, ours = b["events"].get("schedule_advanced", 0), c["events"].get("schedule_advanced", 0)
        if theirs != ours:
            k = c["step"]
            when = f"between optimizer steps {k - 1} and {k}" if k else "before optimizer step 0"
            wrapper = next((e.split(":", 1)[1] for e in c["events"] if e.startswith("wrapper:")), None)
            through = (
                f": your scheduler.step() went through {wrapper}, which stepped the scheduler it wraps {ours}×"
                if wrapper
                else ""
            )
            return f" — the schedule advanced {ours}× {when}, the baseline's {theirs}×{through}"
    return None


def _sketch_drift(base: list[dict], cell: list[dict]) -> list[float]:
    """Per step: |Δ sketch| relative to the size of the baseline's update so far (its scale)."""
    return [
        abs(c["sketch"] - b["sketch"]) / max(b.get("sketch_scale") or abs(b["sketch"]), 1e-300)
        for b, c in zip(base, cell)
        if b.get("sketch") is not None and c.get("sketch") is not None
    ]


def _update_differs(
    base: list[dict], cell: list[dict], *, twins: list[dict] = (), rtol: float
) -> tuple[int, str] | None:
    """The first step whose update, projected, left the baseline's by more than the tolerance — `rtol`,
    widened to FACTOR × the twins' running maximum drift at that step (never past CEILING × `rtol`; twins
    drifting beyond that are not rounding, and set nothing): a difference in lr, clipping or the optimizer
    when the objective still agrees."""
    floor = [0.0] * len(base)
    for twin in twins:
        floor = [max(f, d) for f, d in zip(floor, itertools.accumulate(_sketch_drift(base, twin["steps"]), max))]
    if any(f > CEILING * rtol for f in floor):
        floor = [0.0] * len(base)  # not rounding: the constant alone
    for step, drift in enumerate(_sketch_drift(base, cell)):
        widened = min(FACTOR * floor[step], CEILING * rtol) if step < len(floor) else 0.0
        tol = max(rtol, widened)
        if not drift <= tol:
            return step, f"the parameters after step {step} differ: update sketch rel {drift:.2e} > tol {tol:.1e}"
    return None


def _samples_differ(base_step: dict, cell_step: dict) -> str | None:
    """How one step's samples differ from the baseline's (None: the same multiset) — other samples, or
    the same samples (by their first input, the token ids) with other values in their other inputs."""
    base, cell = base_step["samples"], cell_step["samples"]
    if base == cell:
        return None
    keys = base_step.get("keys"), cell_step.get("keys")
    if keys[0] and keys[0] == keys[1]:
        first, *others = cell_step.get("inputs") or ["its first input"]
        changed = sum((Counter(base) - Counter(cell)).values())
        return (
            f"the same {len(base)} samples as the baseline's (by their {first}), but {changed} with other values in "
            f"{', '.join(others) or 'their other inputs'} — targets that depend on the split, or on what the cell "
            f"changed{_layout_note(base_step, cell_step)}"
        )
    theirs, ours = Counter(base), Counter(cell)
    missing, extra = sum((theirs - ours).values()), sum((ours - theirs).values())
    twice = sum(n - 1 for n in ours.values() if n > 1)
    why = f"{missing} of the baseline's {len(base)} samples missing, {extra} others in their place"
    if disagreeing := [layout for layout in cell_step.get("layouts", ()) if "disagree" in layout]:
        return (
            f"{why}: your model was given packed rows {disagreeing[0].removeprefix('packed ')} — where one marks a "
            "sequence's start and another does not, a model reading the latter attends across it, and trains on "
            "the longer sequences they all mark, not on the samples"
        )
    laid = _layout_note(base_step, cell_step)
    if twice:
        why += f", {twice} sample(s) seen twice — ranks drawing overlapping shards (a sampler seeded per rank?)"
    elif not laid:  # (where the cell lays the data out otherwise, that is what is known: said, no sampler guessed)
        why += " (a sampler, shard or RNG that depends on the split?)"
    return why + laid


def as_received(step: dict) -> list[int]:
    """Each micro-batch's rows as the model received them, every rank's: a packed dataset's rows are its packs."""
    return [r for ranks in step.get("packs", step["rows"]) for r in ranks]


def _short_steps(cell: Any, steps: list[dict], reference: list[dict]) -> str | None:
    """Where a dataset holds fewer samples than a step (every step an epoch's short last step): said so, when the
    cell's first step trained as many rows as the reference's, fewer than the global batch, in at most GA
    micro-batches no larger than the cell's — its split, on less data; the data check compares the samples.
    None otherwise."""
    if not reference:
        return None
    first = as_received(steps[0])
    total = sum(first)
    if (
        total == sum(as_received(reference[0])) < cell.train_batch_size
        and max(first, default=0) <= cell.micro_batch_size
    ):
        if max(steps[0]["backward"]) <= cell.grad_accum_steps:
            return (
                f"every step trained {total} of {cell.train_batch_size} rows, as the reference's did: a dataset "
                "shorter than a step (each step an epoch's short last step)"
            )
    return None


def ran_another_split(cell: Any, steps: list[dict]) -> str | None:
    """The split the script really ran in its first training step, against the cell's; what stepped
    after how many micro-batches is told from the first steps, and "ignored" only where the forwards
    the probe saw prove it."""
    first = steps[0]
    if first["world_size"] != cell.world_size:
        return f"your script ran {first['world_size']} ranks, the cell {cell.world_size}"
    rows = {r for ranks in first["rows"] for r in ranks}
    packs = set(as_received(first))
    # padding-free: each micro-batch flattened into one row of its sequences (TRL's packing, then its collator) —
    # how many dataset rows it held cannot be counted; the data check compares each step's samples
    flattened = packs == {1} and min(rows, default=1) > 1
    if rows != {cell.micro_batch_size} and packs != {cell.micro_batch_size} and not flattened:
        if not rows:
            return (
                f"the probe saw no training forward of your model in its first step (the cell's micro-batches are "
                f"{cell.micro_batch_size} rows): name the model with gaeq.probe(model=…)"
            )
        packed = f" samples in {', '.join(map(str, sorted(packs)))} rows" if packs != rows else ""
        return (
            f"your script ignored {{micro_batch_size}}: it ran micro-batches of {', '.join(map(str, sorted(rows)))}"
            f"{packed}, the cell {cell.micro_batch_size}"
        )
    phases = first.get("phases") or [[n] for n in first["backward"]]
    accumulated = {n for ranks in phases for n in ranks}
    ga = cell.grad_accum_steps
    if accumulated == {ga}:
        return None
    forwards = {len(ranks) for ranks in first["rows"]}
    if accumulated == {1}:
        window = steps[:ga]  # the micro-batches of one of the cell's steps
        stepped = Counter(e.split(":", 1)[1] for s in window for e in s["events"] if e.startswith("stepped:"))
        every = sorted(name for name, n in stepped.items() if n == len(window)) or ["the optimizer"]
        rest = sorted(name for name in stepped if name not in every)
        said = f"{' and '.join(every)} stepped after every micro-batch"
        if rest:
            return f"{said}, {' and '.join(rest)} after {ga}: each micro-batch's gradient applied on its own"
        ignored = ": {grad_accum_steps} ignored, or a step per micro-batch" if forwards == {1} else ""
        return f"{said} (one backward call per step on each rank), where the cell accumulates {ga}{ignored}"
    ran = ", ".join(map(str, sorted(accumulated)))
    proven = forwards == accumulated
    return (
        f"your script accumulated {ran} micro-batches per optimizer step ({ran} {'forward and ' if proven else ''}"
        f"backward calls on each rank in its first), where the cell accumulates {ga}"
        + (": {grad_accum_steps} ignored" if proven else "")
    )
