"""The rules a split must keep to become a cell, each a small named function (bad input names the
rule it broke), and why a valid cell may still not run here. `Expander.cell` asks them in this order."""

from __future__ import annotations

import dataclasses
import importlib.util

from gaeq.bug_catalogue import BUGS
from gaeq.matrix.cell import DEFAULT_PIPELINE_SCHEDULE, Expectation, Split
from gaeq.matrix.parallel_rules import (
    check_hsdp,
    check_moe,
    check_pipeline_parallel,
    check_sequence_parallel,
    check_short_steps,
    check_tensor_parallel,
    grad_accum_of,
    mixture_of_experts,
    reaches_short_step,
    trainer_sp_gather_unsupported,
    where_of,
)
from gaeq.matrix.schema import (
    ALWAYS_COMPARED,
    SCRIPT_METRICS,
    TENSOR_METRICS,
    ExpectSpec,
    FaultSpec,
    MatrixError,
    MatrixSpec,
)
from gaeq.problem.placeholders import PlaceholderError, check
from gaeq.problem.spec import ProblemSpec
from gaeq.registry import DEEPSPEED_TRAINERS, INSTALL_HF, TRAINERS, dtypes_said


def split_rules(split: Split, problem: ProblemSpec, spec: MatrixSpec) -> Split:
    """Every cross-field rule of a split; returns it with DeepSpeed's ZeRO stage filled in (0)."""
    split = deepspeed_axes(split)
    split = pipeline_axes(split)
    manual_accumulation(split, problem, spec)
    if problem.epoch_end == "short_step":
        check_short_steps(split, problem)
    if split.hsdp_replicas > 1:
        check_hsdp(split)
    if getattr(problem.model, "moe", None) is not None:
        check_moe(split)
    if split.tensor_parallel > 1:
        check_tensor_parallel(split, problem)
    if split.sequence_parallel > 1:
        check_sequence_parallel(split, problem)
    if split.compile:
        check_compile(split)
    if split.pipeline_parallel > 1:
        check_pipeline_parallel(split, problem)
        if tracked := [m for m in TENSOR_METRICS if m in spec.track]:
            raise MatrixError(
                f"pipeline cells are compared by loss and grad norm; tracking {'/'.join(tracked)} (each stage's "
                f"tensors gathered at the boundary) is not offered for them yet ({where_of(split)})"
            )
    ds_bf16_needs_zero(split)
    library_installed(split)
    nvme_runs_own_config(split, problem)
    hf_deepspeed_rules(split)
    if split.trainer in ("hf", "hf_deepspeed"):
        check_hf_trainer(problem, spec)
    if problem.optimizer.name in ("muon", "torch_muon"):
        check_muon(split, problem.optimizer.name)
    ds_fp16_is_deepspeeds(split)
    trainer_runs_dtype(split)
    if problem.mirror is not None and split.trainer == "deepspeed":
        check_precision(problem.mirror.precision, split.dtype)
    return split


def deepspeed_axes(split: Split) -> Split:
    """zero_stage and offload are DeepSpeed settings; a DeepSpeed cell without a stage is ZeRO-0."""
    deepspeed = split.trainer in DEEPSPEED_TRAINERS
    if not deepspeed and split.zero_stage is not None:
        raise MatrixError(f"zero_stage is a DeepSpeed setting; {where_of(split)} sets it")
    if deepspeed and split.zero_stage is None:
        split = dataclasses.replace(split, zero_stage=0)
    if not deepspeed and split.offload != "none":
        raise MatrixError(f"offload is a DeepSpeed setting; {where_of(split)} sets it")
    return split


def pipeline_axes(split: Split) -> Split:
    """pipeline_schedule is a pipeline setting; a pipeline cell without one runs 1F1B."""
    if split.pipeline_parallel == 1 and split.pipeline_schedule is not None:
        raise MatrixError(f"pipeline_schedule is a pipeline setting; {where_of(split)} has no pipeline_parallel")
    if split.pipeline_parallel > 1 and split.pipeline_schedule is None:
        split = dataclasses.replace(split, pipeline_schedule=DEFAULT_PIPELINE_SCHEDULE)
    return split


def manual_accumulation(split: Split, problem: ProblemSpec, spec: MatrixSpec) -> None:
    """A loop accumulating by hand around a DeepSpeed engine: the deepspeed trainer's, with gaeq's config."""
    if split.deepspeed_accumulation == "managed":
        return
    if split.trainer != "deepspeed":
        raise MatrixError(f"deepspeed_accumulation is the deepspeed trainer's loop; {where_of(split)} sets it")
    if split.pipeline_parallel > 1:
        raise MatrixError(f"a pipeline's engine runs its own micro-batches: no manual accumulation ({where_of(split)})")
    if split.tensor_parallel > 1:
        raise MatrixError(f"deepspeed_accumulation with tensor_parallel: not offered ({where_of(split)})")
    if split.deepspeed_accumulation == "manual_unmanaged" and split.zero_stage == 0 and "grads" in spec.track:
        raise MatrixError(
            f"unmanaged accumulation at ZeRO-0 reduces the gradients inside step(): tracking grads, read before it, "
            f"is not offered ({where_of(split)})"
        )
    if problem.deepspeed_config is not None:
        raise MatrixError(
            f"deepspeed_accumulation {split.deepspeed_accumulation} writes GA 1 into gaeq's own config; a "
            f"deepspeed_config's cells keep its accumulation ({where_of(split)})"
        )


def check_compile(split: Split) -> None:
    """A compiled cell: a trainer that compiles its model (its registry entry's `compiles`), in a layout
    its compiled path has been measured in (data parallelism and ZeRO: no model split over ranks)."""
    if not TRAINERS[split.trainer].compiles:
        raise MatrixError(f"compile: the {split.trainer} trainer runs its model eager ({where_of(split)})")
    if split.tensor_parallel > 1 or split.pipeline_parallel > 1 or split.sequence_parallel > 1:
        raise MatrixError(f"compile with a model split over ranks: not offered yet ({where_of(split)})")
    if split.offload != "none":
        raise MatrixError(f"compile with offload: not offered yet ({where_of(split)})")


def ds_bf16_needs_zero(split: Split) -> None:
    if TRAINERS[split.trainer].script:
        return  # a script's DeepSpeed engine is its own: the label is checked against what it ran
    if split.dtype == "ds_bf16" and not (split.trainer == "deepspeed" and split.zero_stage >= 1):
        raise MatrixError(
            "dtype ds_bf16 is DeepSpeed's bf16 mixed precision: DeepSpeed cells at ZeRO ≥ 1 only "
            "(at ZeRO-0 DeepSpeed cannot accumulate bf16 gradients in fp32)"
        )


def library_installed(split: Split) -> None:
    if (package := TRAINERS[split.trainer].package) and importlib.util.find_spec(package) is None:
        raise MatrixError(f"trainer {split.trainer} needs {package}: {INSTALL_HF}")


def nvme_runs_own_config(split: Split, problem: ProblemSpec) -> None:
    if split.offload == "nvme" and problem.deepspeed_config is not None:
        raise MatrixError(
            "nvme offload runs gaeq's own DeepSpeed config (with its swap folder and aio section), not a "
            "deepspeed_config"
        )


def hf_deepspeed_rules(split: Split) -> None:
    """The Trainer's DeepSpeed config: fp32, a ZeRO stage ≥ 1, nothing else."""
    if split.trainer != "hf_deepspeed":
        return
    if split.dtype != "fp32" or split.offload != "none":
        raise MatrixError(
            "the hf_deepspeed trainer runs fp32 without offload (the Trainer's DeepSpeed config: ZeRO stage only)"
        )
    if split.zero_stage == 0:
        raise MatrixError(
            "the hf_deepspeed trainer needs ZeRO ≥ 1: at ZeRO-0 DeepSpeed's engine reports no global grad norm, "
            "so the Trainer logs none and the cell could not be compared"
        )


def check_muon(split: Split, name: str) -> None:
    """Where Muon runs as measured: DeepSpeed's in the trainers that build it, torch's in a torch loop;
    whole matrices (Newton–Schulz of a shard is another update), fp32 or bf16 autocast, no offload (its
    CPU Adam replaces the AdamW half)."""
    why = None
    if not TRAINERS[split.trainer].muon:
        why = f"the {split.trainer} trainer does not build it (torch, deepspeed do)"
    elif name == "torch_muon" and split.trainer != "torch":
        why = "torch.optim.Muon runs in the torch trainer (DeepSpeed builds its own: optimizer muon)"
    elif split.tensor_parallel > 1 or split.pipeline_parallel > 1:
        why = "its Newton–Schulz needs every matrix whole: not with tensor or pipeline parallelism"
    elif split.offload != "none":
        why = "with offload DeepSpeed's CPU Adam takes its AdamW half: not offered"
    elif split.dtype not in ("fp32", "bf16"):
        why = f"measured in fp32 and bf16 (autocast), not {split.dtype}"
    if why:
        raise MatrixError(f"optimizer {name}: {why} ({where_of(split)})")


def ds_fp16_is_deepspeeds(split: Split) -> None:
    if split.dtype == "ds_fp16" and split.trainer != "deepspeed" and not TRAINERS[split.trainer].script:
        raise MatrixError("dtype ds_fp16 is DeepSpeed's fp16 mixed precision: DeepSpeed cells only (torch: fp16)")


def trainer_runs_dtype(split: Split) -> None:
    dtypes = TRAINERS[split.trainer].dtypes
    if split.dtype not in dtypes:
        raise MatrixError(f"the {split.trainer} trainer runs {dtypes_said(dtypes)}, not {split.dtype}")


def script_rules(split: Split, problem: ProblemSpec, *, args: tuple[str, ...]) -> None:
    """A script matrix's cells run its script, and only they take script arguments."""
    script = TRAINERS[split.trainer].script
    if problem.script is not None and not script:
        raise MatrixError(f"a script matrix runs its script in every cell; {where_of(split)} names another trainer")
    if problem.script is None and script:
        raise MatrixError("trainer script runs a script matrix (script: at the matrix's top level)")
    if args and not script:
        raise MatrixError(f"args are a script cell's; {where_of(split)} trains gaeq's own loop")
    for arg in args:
        try:
            check(arg)
        except PlaceholderError as exc:
            raise MatrixError(f"args: {exc}") from None


def bug_rules(bug: str, split: Split, problem: ProblemSpec) -> None:
    """A planted bug exists where its entry says (gaeq/bugs.py): trainers, config, world, TP, loss, dtype."""
    if bug not in BUGS:
        raise MatrixError(f"unknown bug {bug!r}; known: {', '.join(sorted(BUGS))}")
    planted = BUGS[bug]
    if split.trainer not in planted.trainers:
        raise MatrixError(f"bug {bug!r} exists only in the {'/'.join(planted.trainers)} trainer")
    if planted.needs_deepspeed_config and problem.deepspeed_config is None:
        raise MatrixError(f"bug {bug!r} exists only in a problem with a deepspeed_config")
    if split.world_size < planted.min_world_size:
        raise MatrixError(f"bug {bug!r} needs world_size ≥ {planted.min_world_size}, the cell has {split.world_size}")
    if (grad_accum := grad_accum_of(split, problem)) is not None and grad_accum < planted.min_grad_accum:
        raise MatrixError(
            f"bug {bug!r} needs GA ≥ {planted.min_grad_accum}: at GA {grad_accum} it is no mistake (a control "
            "that could not fail)"
        )
    if split.tensor_parallel < planted.min_tensor_parallel:
        raise MatrixError(
            f"bug {bug!r} needs tensor_parallel ≥ {planted.min_tensor_parallel}, the cell has {split.tensor_parallel}"
        )
    if planted.moe and not mixture_of_experts(problem):
        raise MatrixError(
            f"bug {bug!r} exists only in a mixture of experts (model.moe, or a transformers model with "
            "output_router_logits: true)"
        )
    balance = getattr(getattr(problem.model, "moe", None), "balance", None)
    if planted.moe_balance and balance not in planted.moe_balance:
        raise MatrixError(
            f"bug {bug!r} exists only in a balance over {' or '.join(planted.moe_balance)}, not {balance}"
        )
    if planted.loss_parallel and not getattr(problem.model, "loss_parallel", False):
        raise MatrixError(f"bug {bug!r} exists only where the head is split by vocabulary (model.loss_parallel)")
    if planted.compiled and not split.compile:
        raise MatrixError(f"bug {bug!r} exists only in a compiled cell (compile: true)")
    if planted.packed and not getattr(problem.data, "packed", False):
        raise MatrixError(f"bug {bug!r} exists only in packed token data (data: {{kind: tokens, packed: true}})")
    if planted.short_step and not reaches_short_step(problem):
        raise MatrixError(
            f"bug {bug!r} exists only at an epoch's short last step: epoch_end short_step, data.num_samples not a "
            f"multiple of train_batch_size {problem.train_batch_size}, and steps reaching an epoch's end"
        )
    if split.sequence_parallel < planted.min_sequence_parallel:
        raise MatrixError(
            f"bug {bug!r} needs sequence_parallel ≥ {planted.min_sequence_parallel}, the cell has "
            f"{split.sequence_parallel}"
        )
    if split.hsdp_replicas < planted.min_hsdp_replicas:
        raise MatrixError(
            f"bug {bug!r} needs hsdp_replicas ≥ {planted.min_hsdp_replicas}, the cell has {split.hsdp_replicas}"
        )
    if planted.pipeline != (split.pipeline_parallel > 1):
        raise MatrixError(
            f"bug {bug!r} "
            + (
                "lives in a pipeline's schedule: it needs pipeline_parallel ≥ 2"
                if planted.pipeline
                else "is not planted in a pipeline's loop: it needs pipeline_parallel 1"
            )
            + f", the cell has {split.pipeline_parallel}"
        )
    if planted.loss is not None and problem.loss != planted.loss:
        raise MatrixError(f"bug {bug!r} exists only with loss {planted.loss}, not {problem.loss!r}")
    if planted.optimizer is not None and problem.optimizer.name != planted.optimizer:
        raise MatrixError(f"bug {bug!r} exists only with optimizer {planted.optimizer}, not {problem.optimizer.name}")
    if planted.pipeline_calls > 1 and (micro_batches := grad_accum_of(split, problem)):
        from gaeq.problem.stages import schedule_problem

        per_call, left = divmod(micro_batches, planted.pipeline_calls)
        pp = split.pipeline_parallel
        why = schedule_problem(split.pipeline_schedule, pipeline_parallel=pp, micro_batches=per_call)
        if left or per_call < 2:  # the schedule divides by 1: no mistake to see
            why = f"each needs 2 micro-batches at least (GA a multiple of {2 * planted.pipeline_calls})"
        if why:
            raise MatrixError(
                f"bug {bug!r} runs the step's GA {micro_batches} micro-batches in {planted.pipeline_calls} schedule "
                f"runs: {why}"
            )
    if planted.dtypes and split.dtype not in planted.dtypes:
        raise MatrixError(f"bug {bug!r} exists only in {'/'.join(planted.dtypes)} cells, not {split.dtype}")


def fault_rules(fault: FaultSpec, split: Split, problem: ProblemSpec) -> None:
    if fault.rank >= split.world_size:
        raise MatrixError(f"fault.rank {fault.rank} does not exist at world_size {split.world_size}")
    if fault.step >= problem.steps:
        raise MatrixError(f"fault.step {fault.step} is past the last step ({problem.steps - 1})")


def expect_rules(expect: ExpectSpec, split: Split, problem: ProblemSpec, spec: MatrixSpec) -> Expectation:
    """The cell's expectation. A metric it names that the cell never compares is bad input — one the
    matrix does not track, or a script probe's in gaeq's own loop — and so is a step past the last."""
    for metric in (*([expect.caught_by] if expect.caught_by else []), *expect.holds):
        if metric in SCRIPT_METRICS and not TRAINERS[split.trainer].script:
            raise MatrixError(f"expect names {metric!r}, which only a script's probe records ({where_of(split)})")
        if metric not in (*SCRIPT_METRICS, *ALWAYS_COMPARED, *spec.track):
            raise MatrixError(
                f"expect names {metric!r}, which the matrix does not compare (track: {', '.join(spec.track)})"
            )
    if expect.step is not None and expect.step >= problem.steps:
        raise MatrixError(f"expect.step {expect.step} is past the last step ({problem.steps - 1})")
    return Expectation(verdict=expect.verdict, caught_by=expect.caught_by, step=expect.step, holds=tuple(expect.holds))


def skip_reason(split: Split, problem: ProblemSpec) -> str | None:
    """Why a valid cell does not run (here): a rule of DeepSpeed's, or what this machine lacks."""
    if (reason := trainer_sp_gather_unsupported(split, problem)) is not None:
        return reason
    if split.offload != "none" and split.zero_stage == 0:
        return "offload needs ZeRO ≥ 1 (ZeRO-0 has no partitioned optimizer to offload)"
    if split.offload == "nvme" and split.zero_stage < 3:
        return NVME_NEEDS_ZERO3
    if split.offload == "nvme" and (reason := _nvme_unsupported()):
        return reason
    # torch's autocast computes fp16 on any CPU (a script's fp16 runs as its author wrote it); DeepSpeed's
    # fp16 and gaeq's own fp16 cells follow DeepSpeed's accelerator (gaeq/accelerator.py)
    fp16 = split.dtype == "ds_fp16" or (split.dtype == "fp16" and not TRAINERS[split.trainer].script)
    if fp16 and (reason := _fp16_unsupported()):
        return reason
    return None


def check_precision(precision: str, dtype: str) -> None:
    """A DeepSpeed cell of a deepspeed_config problem is labelled with the file's precision."""
    if precision == "fp32" and dtype in ("ds_bf16", "ds_fp16"):
        section = "bf16" if dtype == "ds_bf16" else "fp16"
        raise MatrixError(f"dtype {dtype} is DeepSpeed's {section} section, which deepspeed_config does not enable")
    if precision != "fp32" and dtype != precision:
        section = "bf16" if precision == "ds_bf16" else "fp16"
        raise MatrixError(
            f"deepspeed_config enables {section} ({section}.enabled: true): its DeepSpeed cells are {precision}, "
            f"not {dtype} — set dtype: {precision} (with a DeepSpeed baseline)"
        )


def check_hf_trainer(problem: ProblemSpec, spec: MatrixSpec) -> None:
    """What the transformers Trainer can be set to from the problem, exactly — else bad input, why."""
    why = None
    if getattr(problem.data, "kind", None) != "tokens":
        why = "it counts num_items_in_batch as the labels that are not -100: token data only"
    elif problem.loss == "policy_gradient":
        why = "it counts num_items_in_batch from plain labels, not a policy gradient's (targets with advantages)"
    elif problem.deepspeed_config is not None:
        why = "a deepspeed_config goes to the Trainer through TrainingArguments(deepspeed=...), not offered yet"
    elif problem.optimizer.name != "adamw":
        why = f"its optimizer is AdamW (optim=adamw_torch), the problem's is {problem.optimizer.name}"
    elif problem.schedule.warmup_steps and problem.schedule.warmup_convention != "transformers":
        why = (
            "transformers' linear warmup starts at lr 0 at step 0, gaeq's at lr / warmup_steps: no "
            "lr_scheduler_type gives gaeq's — set schedule.warmup_convention: transformers (every trainer of the "
            "matrix then warms up as the Trainer does)"
        )
    elif "grads" in spec.track:
        why = "the Trainer clips before a callback sees the gradients: track params, not grads"
    if why:
        raise MatrixError(f"trainer hf / hf_deepspeed: {why}")


NVME_NEEDS_ZERO3 = (
    "nvme offload needs ZeRO-3: DeepSpeed's ZeRO-1/2 optimizer takes device nvme for cpu "
    "(the state stays in memory, no file is written)"
)


def _nvme_unsupported() -> str | None:
    from gaeq.accelerator import nvme_unsupported_reason  # imports DeepSpeed: only for nvme cells

    return nvme_unsupported_reason()


def _fp16_unsupported() -> str | None:
    from gaeq.accelerator import fp16_unsupported_reason  # imports torch/DeepSpeed: only for fp16 cells

    return fp16_unsupported_reason()
