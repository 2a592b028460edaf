"""Why a split diverged, where the run itself shows it: what ran (a cell's `ran`), its trace and the
baseline's — each note a sentence appended to a divergence's reason, or "" where the run shows nothing."""

from __future__ import annotations

from collections.abc import Mapping

from gaeq.results.floor import RANDOM_DRAWS
from gaeq.results.trace import StepRecord


def loss_scaler_note(ran: Mapping, comparison, base: list[StepRecord], trace: list[StepRecord]) -> str:
    """Why a script's loss scaler skipped other steps than the baseline's (from what ran and the traces):
    GradScaler skips a step when any micro-batch's fp16 gradient overflows (its found_inf), and the split
    sets those gradients' sizes."""
    if comparison.caught_by != "skipped" or (ran.get("precision") or {}).get("loss_scaler") != "GradScaler":
        return ""
    skipped = [[r.step for r in t if r.skipped] for t in (trace, base)]
    return (
        f" — steps skipped here {skipped[0]}, by the baseline {skipped[1]}: GradScaler skips a step when any "
        "micro-batch's fp16 gradient overflows, and the split sets those gradients' sizes (each micro-batch's "
        "share of the step's, × the ranks DDP averages over); the cell's float32 run (dtype fp32) judges the "
        "accumulation without it"
    )


def trainer_sp_note(ran: Mapping, comparison, base: list[StepRecord], trace: list[StepRecord]) -> str:
    """Why the Trainer's own sequence-parallel loss diverges, from what ran and the numbers: its
    deepspeed_sp_compute_loss (transformers 5.23.0, read in its source) gathers the sequence ranks' losses
    with a differentiable all-gather, whose backward sums every rank's share into each rank's gradient (sp ×
    its own); the engine then divides the ranks' summed gradients by the ranks `ran` read from it; and the
    Trainer's num_items_in_batch never reaches that loss, so each micro-batch is its own token mean. The
    grad norm's ratio to the baseline's is the comparison's, at the step it first diverged."""
    if ran.get("sp_loss") != "trainer" or comparison.first_divergent_step is None:
        return ""
    sp, divisor = ran["sequence_parallel"], ran["sp_gradients_averaged_over"]
    data_parallel = ran["world_size"] // sp
    note = (
        f" — the Trainer's own sequence-parallel loss ran (deepspeed_sp_compute_loss, sp {sp}): its differentiable "
        f"all-gather of the ranks' losses gives each rank's gradient {sp} × its share, "
    )
    if divisor == data_parallel:
        note += (
            f"and DeepSpeed sums them over the sequence ranks (÷ {divisor}, its data-parallel ranks): {sp} × the truth"
        )
    else:
        note += f"which DeepSpeed averages over all {divisor} ranks (ZeRO-3's reduce-scatter): the factor cancels"
    if ran.get("micro_steps", 1) > 1 or data_parallel > 1:
        note += "; and each micro-batch is normalised by its own tokens, not the step's (a mean of micro-batch means)"
    at = {r.step: r for r in base}, {r.step: r for r in trace}
    step = comparison.first_divergent_step
    if step in at[0] and step in at[1] and at[0][step].grad_norm:
        note += f" — grad norm {at[1][step].grad_norm / at[0][step].grad_norm:.4f}× the baseline's at step {step}"
    return note


def muon_norm_note(ran: Mapping, comparison) -> str:
    """Why DeepSpeed's Muon at ZeRO ≥ 1 diverges by its grad norm: that engine orthogonalises each
    partition's gradient before it measures the norm (read in its source: stage_1_and_2.py's
    get_flat_partition, stage3.py's step), so the norm it reports — and clips with — is the update's.
    Whether the loss stayed within tolerance is the comparison's, not assumed."""
    if "newton_schulz" not in ran or ran.get("zero_stage", 0) < 1 or comparison.caught_by != "grad_norm":
        return ""
    note = " — DeepSpeed's Muon at ZeRO ≥ 1 measures the norm of the orthogonalised update, not the gradient's"
    if ran.get("gradient_clipping", 0) > 0:
        note += ", and clips the update by it"
    if comparison.divergence_steps.get("loss") is None:
        note += " (the loss stayed within tolerance at every step)"
    return note + " (DeepSpeed#8439)"


def short_step_note(trace: list[StepRecord], step: int | None, batch: int) -> str:
    """Why a cell first diverges at a step that held fewer samples than a global batch (an epoch's
    short last step, epoch_end: short_step): what that step held, read from the trace's counts."""
    at = {r.step: r for r in trace}
    if step not in at or step - 1 not in at:
        return ""
    held = at[step].samples - at[step - 1].samples
    if held >= batch:
        return ""
    return (
        f" — step {step} held {held} samples, not {batch} (an epoch's short last step): a loop that still ÷ GA "
        f"there is off by {held}/{batch}"
    )


def order_note(causes: tuple[str, ...], dropout: Mapping | None) -> str:
    """Why a split of a model whose output depends on its rows' order or on random draws diverges (what
    the twins' order check measured: gaeq.rows.OrderCheck) — unless dropout, named on its own, is it."""
    if not causes or (dropout and all(c.startswith(RANDOM_DRAWS) for c in causes)):
        return ""
    return (
        f" — the model's output depends on {' and on '.join(causes)}: a split changes which rows share a "
        "forward and in what order, and so what the model computes"
    )


def dropout_note(dropout: Mapping[str, float] | None, *, script: bool = False) -> str:
    """Why a model with dropout diverges: its masks come from torch's global RNG, which the split
    changes (gaeq keeps a transformers config's dropouts as given; a script's are its own)."""
    if not dropout:
        return ""
    knobs = ", ".join(f"{key}={p:g}" for key, p in dropout.items())
    if script:
        return (
            f" — your model has active dropout ({knobs}): torch's global RNG draws its masks, so they depend on "
            "the split; set p to 0 for the check to compare accumulation"
        )
    return (
        f" — the model's config has dropout ({knobs}): torch's global RNG draws its masks, so they depend on "
        "the split; set them to 0 in model.config to compare accumulation"
    )
