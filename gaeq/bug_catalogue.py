"""The planted bugs' catalogue: each member of :class:`gaeq.bugs.Bug` with where it exists (the trainers
whose line plants it, the dtypes, losses, world sizes… where the mistake can be made), what it does and
where it was reported. gaeq/bugs.py names them; tests/unit/test_house.py checks that every member has its
entry here and a site in a trainer."""

from __future__ import annotations

from gaeq.bugs import GENERATION_STEPS, Bug, PlantedBug

BUGS: dict[str, PlantedBug] = {
    bug.name.value: bug
    for bug in (
        PlantedBug(
            name=Bug.NO_LOSS_DIVISION,
            trainers=("torch",),
            description=(
                "the manual loop forgets ÷ GA: every micro-step backpropagates its micro-batch mean, "
                "so the accumulated gradient is GA times the global-batch mean gradient"
            ),
        ),
        PlantedBug(
            name=Bug.MEAN_OF_MEANS,
            trainers=("torch", "deepspeed", "fsdp", "accelerate"),
            description=(
                "each micro-batch is normalised by its own element count, then ÷ GA: the mean of "
                "micro-batch means, not the global mean — tokens of short micro-batches weigh more"
            ),
        ),
        PlantedBug(
            name=Bug.CLIP_EVERY_MICRO_STEP,
            trainers=("torch",),
            description="gradients are clipped after every micro-step's backward, i.e. partial sums are clipped",
        ),
        PlantedBug(
            name=Bug.SCHEDULER_EVERY_MICRO_STEP,
            trainers=("torch",),
            description="the LR scheduler is stepped every micro-step: the schedule runs GA× too fast",
        ),
        PlantedBug(
            name=Bug.DEEPSPEED_DEFAULT_CLIPPING,
            trainers=("deepspeed",),
            description="gradient_clipping is left out of the DeepSpeed config: DeepSpeed clips at 1.0 by default",
        ),
        PlantedBug(
            name=Bug.GRAD_ACCUM_BF16,
            trainers=("deepspeed",),
            description="ds_bf16 gradients accumulated in bf16 (data_types.grad_accum_dtype) instead of fp32",
        ),
        PlantedBug(
            name=Bug.LOSS_SCALE_NOT_UNSCALED_BEFORE_CLIP,
            trainers=("torch",),
            dtypes=("fp16",),
            description=(
                "fp16 with a GradScaler: the loop clips before scaler.unscale_(), so it clips (and measures) "
                "the gradient × loss scale — the clip threshold acts 65536× too early"
            ),
        ),
        PlantedBug(
            name=Bug.UNMIRRORED_DEFAULT_CLIPPING,
            trainers=("torch",),
            needs_deepspeed_config=True,
            description=(
                "the PyTorch reference of a DeepSpeed config without gradient_clipping does not clip — "
                "but DeepSpeed clips at its default (1.0)"
            ),
        ),
        PlantedBug(
            name=Bug.HF_NUM_ITEMS_PER_MICRO_BATCH,
            trainers=("torch", "deepspeed", "accelerate"),
            loss="hf",
            reported="huggingface/transformers#34242",
            description=(
                "the transformers model's loss gets num_items_in_batch = the micro-batch's own valid-token count "
                "(transformers before its accumulation fix, #34242): every micro-batch mean weighs the same, "
                "and the accumulated gradient is GA × world too large"
            ),
        ),
        PlantedBug(
            name=Bug.ACCELERATE_SCHEDULER_PER_PROCESS,
            trainers=("accelerate",),
            min_world_size=2,
            reported="accelerate's AcceleratedScheduler (step_scheduler_with_optimizer=True, the default)",
            description=(
                "accelerate's default scheduler stepping: a prepared scheduler steps num_processes times per "
                "optimizer step, so a schedule written in optimizer steps runs world× too fast"
            ),
        ),
        PlantedBug(
            name=Bug.ACCELERATE_LOSS_DIVIDED_TWICE,
            trainers=("accelerate",),
            reported="",
            description=(
                "the loop divides the loss by GA as a manual loop must, then accelerator.backward divides by GA "
                "again: the accumulated gradient is GA× too small"
            ),
        ),
        PlantedBug(
            name=Bug.HF_LOSS_PER_MICRO_BATCH,
            trainers=("hf", "hf_deepspeed"),
            reported="huggingface/transformers#34242",
            description=(
                "the Trainer with a model it passes no num_items_in_batch to (model_accepts_loss_kwargs false): each "
                "micro-batch's mean loss ÷ GA — the mean of micro-batch means, transformers before its fix"
            ),
        ),
        PlantedBug(
            name=Bug.HF_TOKENS_PER_DEVICE,
            trainers=("hf", "hf_deepspeed"),
            min_world_size=2,
            reported="huggingface/transformers#34373",
            description=(
                "average_tokens_across_devices=False: each rank divides by its own token count, and the ranks' means "
                "are averaged — ranks with fewer tokens weigh more"
            ),
        ),
        PlantedBug(
            name=Bug.HF_DEEPSPEED_LOSS_DIVIDED_TWICE,
            trainers=("hf_deepspeed",),
            reported="huggingface/accelerate#3533, fixed by huggingface/transformers#35808",
            description=(
                "the Trainer with DeepSpeed lets the engine divide by GA (scale_wrt_gas) a loss already normalised "
                "by the global batch's token count: the gradient is GA× too small"
            ),
        ),
        PlantedBug(
            name=Bug.ONE_GRAD_SCALED,
            trainers=("torch", "fsdp"),
            description="the last parameter's accumulated gradient is 4× too large (a hook that forgets a division)",
        ),
        PlantedBug(
            name=Bug.TP_GRAD_NORM_PER_SHARD,
            trainers=("torch", "fsdp"),
            min_tensor_parallel=2,
            description=(
                "with tensor parallelism each rank measures the grad norm of the slices it holds, not of the "
                "whole gradient: every rank a different, smaller norm, each clipping by its own"
            ),
        ),
        PlantedBug(
            name=Bug.PIPE_LOSS_SUMMED_OVER_GA,
            trainers=("deepspeed",),
            pipeline=True,
            description=(
                "DeepSpeed's pipeline engine backpropagates the last stage's loss without ÷ GA: gradients summed over "
                "the micro-batches, GA× too large, while the loss train_batch returns is still their average"
            ),
            reported="DeepSpeed#7773 (0.16.0 until 0.18.3)",
        ),
        PlantedBug(
            name=Bug.PIPE_RESCALED_EVERY_STAGE,
            trainers=("deepspeed",),
            pipeline=True,
            description=(
                "every stage's output hook divides the gradient it receives by GA again: stage k of P gets "
                "1/GA^(P-k) — earlier stages learn too slowly"
            ),
            reported="DeepSpeed#8152 (the #7773 fix, until 0.19.3)",
        ),
        PlantedBug(
            name=Bug.PIPELINING_STEP_PER_MICRO_BATCH,
            trainers=("torch",),
            pipeline=True,
            pipeline_calls=2,
            description=(
                "accumulation on top of torch.distributed.pipelining: schedule.step() once per accumulation "
                "micro-batch (two per optimizer step, each split into GA/2 pipeline micro-batches) with the loss "
                "rescaled for it, but scale_grads left on — every step() divides ALL the gradients accumulated so "
                "far by its micro-batch count, so the first call's count GA/2 times too little"
            ),
            reported="torchtitan#1733 (fixed by #1732: scale_grads=False, the loss scaled instead); pytorch#196641",
        ),
        PlantedBug(
            name=Bug.HSDP_GRAD_NORM_OVER_REPLICAS,
            trainers=("fsdp",),
            min_hsdp_replicas=2,
            description=(
                "hybrid sharding's grad norm summed over every rank: each shard's squares counted once per "
                "replica, so the norm is √replicas too large and clipping too strong"
            ),
            reported="VeOmni#862",
        ),
        PlantedBug(
            name=Bug.TOKENS_ALL_REDUCED_THEN_DDP_AVERAGED,
            trainers=("torch",),
            min_world_size=2,
            description=(
                "the loss divided by the token count all-reduced over ranks (the global count), then DDP averages "
                "the gradients over the ranks again: every gradient ÷ world — the effective lr ÷ world; under "
                "clipping the loss hides it, the pre-clip norm does not"
            ),
            reported="verl#5366",
        ),
        PlantedBug(
            name=Bug.EMPTY_MICRO_BATCH_COUNTED,
            trainers=("torch", "deepspeed"),
            loss="cross_entropy",
            description=(
                "each micro-batch's mean ÷ the number of micro-batches of the step — the empty ones (every label "
                "masked) counted too: with equal-length samples exact without empties, with them every gradient "
                "× valid ÷ all micro-batches"
            ),
            reported="NeMo-RL#212",
        ),
        PlantedBug(
            name=Bug.PACKED_SEQUENCES_WEIGHTED_PER_PACK,
            trainers=("torch", "deepspeed"),
            loss="cross_entropy",
            packed=True,
            description=(
                "packed training reduces each pack to the mean over its own tokens, then averages the packs: every "
                "pack weighs the same, so a token of a pack with few targets weighs more — split-invariant, and "
                "wrong at any split; the loss of an untrained model hardly shows it (every token near log V), "
                "the gradient does"
            ),
            reported="ms-swift#10144 (seen with packed DPO)",
        ),
        PlantedBug(
            name=Bug.PARTIAL_LAST_WINDOW,
            trainers=("torch", "deepspeed", "fsdp"),
            short_step=True,
            description=(
                "the last accumulation window of an epoch holds fewer micro-batches than GA, and the loop still "
                "divides by GA: that step's gradient too small by its share of a full window"
            ),
            reported="Lightning#19987 (Lightning 2.0–2.2)",
        ),
        PlantedBug(
            name=Bug.MOE_AUX_LOSS_NOT_DIVIDED_BY_GA,
            trainers=("torch", "deepspeed"),
            moe=True,
            description=(
                "a mixture of experts' load-balancing term added to every micro-batch's loss whole, without the "
                "÷ GA the main loss gets: the router's gradient GA× too strong"
            ),
            reported="Megatron-LM#3769",
        ),
        PlantedBug(
            name=Bug.MOE_COUNTS_OVER_MICRO_BATCH_TOKENS,
            trainers=("torch", "deepspeed"),
            moe=True,
            moe_balance=("global", "global_buffered"),
            description=(
                "a global-batch balance loss whose experts' token counts, accumulated over the step's micro-batches "
                "(and ranks), are divided by the current micro-batch's tokens: each expert's share fᵢ inflated by "
                "the micro-batches that counted — GA × dp at the last"
            ),
            reported="Megatron-LM#7213; torchtitan PR#4772 (global-batch balance with micro-batching)",
        ),
        PlantedBug(
            name=Bug.MOE_AUX_LOSS_AVERAGED_TWICE,
            trainers=("torch", "deepspeed"),
            moe=True,
            min_world_size=2,
            description=(
                "the load-balancing term divided by the data-parallel ranks by hand, then averaged over them again "
                "by DDP: the router's balancing gradient ÷ world too weak"
            ),
            reported="NeMo-Automodel#1408",
        ),
        PlantedBug(
            name=Bug.PG_DIVIDED_BY_GA_TWICE,
            trainers=("torch", "deepspeed"),
            loss="policy_gradient",
            min_grad_accum=2,
            description=(
                "the policy loss normalised by the completion tokens of the whole accumulation window (÷ GA "
                "included), then ÷ GA again by the loop (the Trainer's training_step): gradients GA× too weak"
            ),
            reported="ms-swift#10117 (fixed by #10116)",
        ),
        PlantedBug(
            name=Bug.PG_NORMALISED_OVER_GENERATION,
            trainers=("torch", "deepspeed"),
            loss="policy_gradient",
            description=(
                f"the policy loss normalised by the completion tokens of the whole generation batch, which spans "
                f"{GENERATION_STEPS} optimizer steps (steps_per_generation = {GENERATION_STEPS} × GA): each step's "
                f"gradient scaled by its share of the generation's tokens (about 1/{GENERATION_STEPS}) — at any split"
            ),
            reported="TRL#5619 (fixed by TRL#5890/#6024: mis-scaled by GA ÷ steps_per_generation)",
        ),
        PlantedBug(
            name=Bug.PG_TOKENS_PER_RANK,
            trainers=("torch", "deepspeed"),
            loss="policy_gradient",
            min_world_size=2,
            description=(
                "the policy loss normalised by this rank's own completion tokens of the step (its accumulation "
                "group), then averaged over ranks by DDP: the mean of rank means — a token of a rank with few "
                "weighs more"
            ),
            reported="TRL#3231 (each token weighs the same only inside its device); open-instruct#1161",
        ),
        PlantedBug(
            name=Bug.MUON_WITHOUT_NEWTON_SCHULZ,
            trainers=("torch",),
            optimizer="muon",
            description=(
                "Muon's step moves each matrix by its raw gradient, as if it were already orthogonalised: no "
                "Newton–Schulz, no momentum — Muon becomes plain SGD on the matrices (the AdamW half unchanged)"
            ),
            reported="DeepSpeed#8441 (ZeRO-0; fixed by #8442, in the pinned 0.19.8 — measured)",
        ),
        PlantedBug(
            name=Bug.SP_TOKENS_OVER_DATA_RANKS_ONLY,
            trainers=("torch",),
            min_sequence_parallel=2,
            description=(
                "with sequence parallelism, each rank divides its slice's loss by the tokens of that slice summed "
                "over the data-parallel ranks only — the token count not summed over the sequence-parallel ones: "
                "each slice a mean of its own, the gradient about sp× too large and slices weighed by their counts"
            ),
            reported="verl PR#4250, #5863 (CP token counts over DP × CP)",
        ),
        PlantedBug(
            name=Bug.COMPILED_GUARDS_SKIPPED,
            trainers=("torch",),
            compiled=True,
            loss="cross_entropy",
            description=(
                "the loss ÷ its normaliser through a function compiled with every guard skipped "
                "(guard_filter_fn=torch.compiler.skip_all_guards_unsafe, to save the guards' cost): the first "
                "step's token count is traced in as a constant and divides every later step's loss — right "
                "at step 0, stale from step 1 wherever the count changes (variable-length tokens, an epoch's "
                "short last step)"
            ),
            reported="torch.compiler docs: skip_all_guards_unsafe — 'only safe if the inputs never change'; "
            "torchtitan#4099 / #2042 (compiled accumulation differing from eager)",
        ),
        PlantedBug(
            name=Bug.LOSS_PARALLEL_SHARD_SOFTMAX,
            trainers=("torch",),
            loss="cross_entropy",
            min_tensor_parallel=2,
            loss_parallel=True,
            description=(
                "vocabulary-sharded logits, each tensor-parallel rank's cross-entropy taken over its own slice of "
                "the vocabulary: the softmax normalised over the slice alone, a target outside it ignored — "
                "loss_parallel's all-reduces of the max and the sum of exponentials left out"
            ),
            reported="torchtitan#3412 (loss above the single-GPU baseline with loss_parallel); parity tests "
            "#3560, #3671",
        ),
        PlantedBug(
            name=Bug.LR_ZERO,
            trainers=("torch",),
            description="a control, not a bug: the optimizer's lr is 0, so the parameters never move",
        ),
    )
}
