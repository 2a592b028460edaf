"""The rules of cells whose model or batch is laid out beyond plain data parallelism: tensor and
pipeline parallelism, hybrid sharding, a mixture of experts, an epoch's short last step — each a
small named function that raises :class:`MatrixError` naming the numbers (`split_rules` asks them)."""

from __future__ import annotations

from gaeq.matrix.cell import Split
from gaeq.matrix.schema import MatrixError
from gaeq.problem.spec import HFModelSpec, ProblemSpec
from gaeq.problem.split import short_step_message
from gaeq.registry import PIPELINE_TRAINERS, SEQUENCE_PARALLEL_TRAINERS, TENSOR_PARALLEL_TRAINERS, TRAINERS


def where_of(split: Split) -> str:
    """The cell a rule names in its message."""
    return f"the {split.trainer} cell w{split.world_size} mb{split.micro_batch_size}"


def mixture_of_experts(problem: ProblemSpec) -> bool:
    """gaeq's GPT with `moe`, or a transformers model that adds its routers' balance loss."""
    model = problem.model
    return getattr(model, "moe", None) is not None or bool(getattr(model, "config", {}).get("output_router_logits"))


MOE_TRAINERS = ("torch", "deepspeed")
"""The loops that count a step's routing before its first backward (CellProblem.route_step)."""


def check_moe(split: Split) -> None:
    """A mixture of experts runs in the loops that add its balance loss per micro-batch and route ahead."""
    if split.trainer not in MOE_TRAINERS:
        raise MatrixError(
            f"a mixture of experts' balance loss runs in the {', '.join(MOE_TRAINERS)} trainers, not {split.trainer}"
        )
    if split.tensor_parallel > 1 or split.pipeline_parallel > 1:
        raise MatrixError(f"a mixture of experts with tensor or pipeline parallelism: not offered ({where_of(split)})")


def check_sequence_parallel(split: Split, problem: ProblemSpec) -> None:
    """DeepSpeed-Ulysses: each rank a contiguous slice of every sample's tokens, every head's attention
    over the whole sequence after an all-to-all — the heads and the sequence divide evenly over the
    ranks (DeepSpeed's uneven path needs its own sequence-parallel groups), the loss a per-token one,
    the rest of the layout plain data parallelism. Whose attention is wrapped is the trainer's
    (its registry entry): gaeq's GPT, or a transformers causal LM under the Trainer."""
    sp, where = split.sequence_parallel, f"{where_of(split)} sp{split.sequence_parallel}"
    wraps = TRAINERS[split.trainer].sequence_parallel
    why = None
    if not wraps:
        why = (
            f"the {split.trainer} trainer does not split sequences ({', '.join(sorted(SEQUENCE_PARALLEL_TRAINERS))} do)"
        )
    elif split.tensor_parallel > 1 or split.pipeline_parallel > 1:
        why = "with tensor or pipeline parallelism: not offered"
    elif split.world_size % sp:
        why = f"world_size {split.world_size} does not divide by it"
    elif problem.data.seq_len % sp:
        why = f"seq_len {problem.data.seq_len} must divide by it"
    else:
        why = _gpt_sequence_parallel(problem, sp) if wraps == "gpt" else _hf_sequence_parallel(problem, sp)
    if why:
        raise MatrixError(f"sequence_parallel {sp}: {why} ({where})")


def _gpt_sequence_parallel(problem: ProblemSpec, sp: int) -> str | None:
    """gaeq's loop wraps its own GPT's attention."""
    if getattr(problem.model, "kind", None) != "gpt" or problem.model.moe is not None:
        return "gaeq's dense GPT only (its attention is the one wrapped)"
    if problem.loss != "cross_entropy":
        return f"a per-token loss (cross_entropy), not {problem.loss}"
    if problem.model.dropout > 0:
        return "dropout's masks are drawn per sample, not per token slice: dropout 0"
    if problem.model.n_head % sp:
        return f"n_head {problem.model.n_head} must divide by it"
    return None


def _hf_sequence_parallel(problem: ProblemSpec, sp: int) -> str | None:
    """The Trainer wraps a transformers causal LM's attention (UlyssesSPAttentionHF): its own loss, its
    query heads split over the group, its key-value heads split too — or, fewer than the group, each
    replicated over sp ÷ kv ranks (DeepSpeed's own rule)."""
    model = problem.model
    if not isinstance(model, HFModelSpec) or problem.loss != "hf" or mixture_of_experts(problem):
        return "a dense transformers causal LM with its own loss (model: {hf: ...}, loss: hf)"
    heads, kv = model.config.get("num_attention_heads"), model.config.get("num_key_value_heads")
    if heads is None or kv is None:
        return "model.config must give num_attention_heads and num_key_value_heads (the heads Ulysses splits)"
    if heads % sp:
        return f"num_attention_heads {heads} must divide by it"
    if kv % sp and sp % kv:
        return f"num_key_value_heads {kv} must divide by it or divide it"
    return None


def reaches_short_step(problem: ProblemSpec) -> bool:
    """Whether the run trains an epoch's short last step (epoch_end short_step)."""
    batch, samples = problem.train_batch_size, problem.num_samples
    return problem.epoch_end == "short_step" and bool(samples % batch) and problem.steps >= -(-samples // batch)


def check_short_steps(split: Split, problem: ProblemSpec) -> None:
    """An epoch's short last step: a loop that asks the data plan for each step's micro-steps, and a
    step whose samples split evenly over the data-parallel ranks."""
    if not TRAINERS[split.trainer].short_steps:
        runs = ", ".join(name for name, spec in TRAINERS.items() if spec.short_steps)
        raise MatrixError(f"epoch_end short_step runs in the {runs} trainers, not {split.trainer} ({where_of(split)})")
    if split.pipeline_parallel > 1 or mixture_of_experts(problem):  # (its balance term: a share of GA micro-batches)
        raise MatrixError(
            f"epoch_end short_step with a pipeline or a mixture of experts: not offered ({where_of(split)})"
        )
    message = short_step_message(
        num_samples=problem.num_samples,
        train_batch_size=problem.train_batch_size,
        micro_batch_size=split.micro_batch_size,
        data_parallel=split.world_size // split.tensor_parallel,
    )
    if message:
        raise MatrixError(f"{message} ({where_of(split)})")


def check_hsdp(split: Split) -> None:
    """Hybrid sharding: the fsdp trainer's, replicas dividing the data-parallel ranks into shard groups."""
    where = f"the {split.trainer} cell w{split.world_size} hsdp{split.hsdp_replicas} mb{split.micro_batch_size}"
    if split.trainer != "fsdp":
        raise MatrixError(f"hsdp_replicas is FSDP2's hybrid sharding: the fsdp trainer only ({where})")
    if split.tensor_parallel > 1 or split.pipeline_parallel > 1:
        raise MatrixError(f"hsdp_replicas with tensor or pipeline parallelism: not offered ({where})")
    if split.world_size % split.hsdp_replicas:
        raise MatrixError(f"world_size {split.world_size} is not divisible by hsdp_replicas {split.hsdp_replicas}")
    if split.world_size == split.hsdp_replicas:
        raise MatrixError(
            f"hsdp_replicas {split.hsdp_replicas} = world_size leaves one rank per shard group: that is DDP ({where})"
        )


def model_parallel_fits(split: Split, axis: str, trainers: frozenset[str], where: str) -> None:
    """A model-parallel `axis` (tensor_parallel, pipeline_parallel) in a trainer that has it, its groups
    (with the other axis's) fitting the world."""
    if split.trainer not in trainers:
        raise MatrixError(f"{axis} runs in the {', '.join(sorted(trainers))} trainers, not {split.trainer} ({where})")
    if split.world_size % (split.tensor_parallel * split.pipeline_parallel):
        other = "pipeline_parallel" if axis == "tensor_parallel" else "tensor_parallel"
        said = f"{axis} {getattr(split, axis)}" + (f" × {other} {n}" if (n := getattr(split, other)) > 1 else "")
        raise MatrixError(f"world_size {split.world_size} is not divisible by {said} ({where})")


def check_tensor_parallel(split: Split, problem: ProblemSpec) -> None:
    """A tensor-parallel split that can run exactly as labelled — else bad input, naming the numbers."""
    from gaeq.problem.tp import plan_problem

    where = f"the {split.trainer} cell w{split.world_size} tp{split.tensor_parallel} mb{split.micro_batch_size}"
    model_parallel_fits(split, "tensor_parallel", TENSOR_PARALLEL_TRAINERS, where)
    if split.dtype not in ("fp32", "bf16"):
        raise MatrixError(
            f"tensor-parallel cells run fp32 and bf16 (autocast over fp32 weights), not {split.dtype} ({where})"
        )
    if split.trainer == "deepspeed" and (problem.deepspeed_config is not None or split.offload != "none"):
        raise MatrixError(f"DeepSpeed AutoTP cells run gaeq's own DeepSpeed config, without offload ({where})")
    if why := plan_problem(problem, split.tensor_parallel):
        raise MatrixError(f"tensor_parallel {split.tensor_parallel}: {why}")
    if getattr(problem.model, "loss_parallel", False) and (split.trainer != "torch" or split.pipeline_parallel > 1):
        raise MatrixError(f"model.loss_parallel runs in the torch trainer's loop, without pipeline stages ({where})")


def check_pipeline_parallel(split: Split, problem: ProblemSpec) -> None:
    """A pipeline split that can run exactly as labelled — else bad input, naming the numbers."""
    from gaeq.problem.stages import schedule_problem, stages_per_rank, stages_problem

    pp, schedule = split.pipeline_parallel, split.pipeline_schedule
    where = f"the {split.trainer} cell w{split.world_size} pp{pp} {schedule} mb{split.micro_batch_size}"
    model_parallel_fits(split, "pipeline_parallel", PIPELINE_TRAINERS, where)
    if schedule not in (offered := TRAINERS[split.trainer].pipeline_schedules):
        raise MatrixError(f"the {split.trainer} trainer's pipelines run {', '.join(offered)}, not {schedule} ({where})")
    if split.dtype != "fp32":
        raise MatrixError(f"pipeline cells run fp32, not {split.dtype} ({where})")
    if split.tensor_parallel > 1 and split.trainer != "torch":
        raise MatrixError(f"pipeline_parallel with tensor_parallel: the torch trainer only ({where})")
    micro_batches = grad_accum_of(split, problem)  # (None: an indivisible batch, said by the cell)
    if micro_batches and (why := schedule_problem(schedule, pipeline_parallel=pp, micro_batches=micro_batches)):
        raise MatrixError(f"{why} ({where})")
    if split.trainer == "deepspeed":
        if split.zero_stage > 1:
            raise MatrixError(
                f"DeepSpeed's pipeline engine runs ZeRO 0 and 1 (it refuses stage {split.zero_stage}) ({where})"
            )
        if problem.deepspeed_config is not None or split.offload != "none":
            raise MatrixError(f"DeepSpeed pipeline cells run gaeq's own DeepSpeed config, without offload ({where})")
    if why := stages_problem(problem, pp * stages_per_rank(schedule)):
        raise MatrixError(f"pipeline_parallel {pp} ({schedule}): {why}")


def grad_accum_of(split: Split, problem: ProblemSpec) -> int | None:
    """The split's GA (a pipeline's micro-batches per step), or None where the batch does not divide."""
    data_parallel = split.world_size // (split.pipeline_parallel * split.tensor_parallel * split.sequence_parallel)
    micro_batches, left = divmod(problem.train_batch_size, split.micro_batch_size * data_parallel)
    return None if left else micro_batches


def trainer_sp_gather_unsupported(split: Split, problem: ProblemSpec) -> str | None:
    """The Trainer's own sequence-parallel loss (deepspeed_sp_compute_loss) gathers the ranks' losses with
    torch.distributed.nn.functional.all_gather, whose backward on gloo (torch 2.13) is an all-to-all made of
    dist.scatter calls given the group-local rank as their global source: in any sequence-parallel group but
    the one of global ranks 0..sp−1 — every data-parallel rank's but the first — it raises "Global rank 0 is
    not part of group". NCCL's backward is a reduce-scatter; on a CPU such a cell cannot run."""
    if (
        TRAINERS[split.trainer].sequence_parallel != "hf"
        or split.sequence_parallel == 1
        or split.data_parallel == 1
        or getattr(problem.model, "sp_loss", None) != "trainer"
    ):
        return None
    from gaeq.accelerator import has_cuda  # imports torch: only for such cells

    if has_cuda():
        return None
    return (
        "the Trainer's own sequence-parallel loss cannot backpropagate over gloo at data_parallel > 1: "
        "torch.distributed.nn.functional.all_gather's backward scatters from group-local ranks read as global "
        "ones (torch 2.13), which fails in every sequence-parallel group but the first — sp_loss: global_tokens "
        "gathers nothing"
    )
