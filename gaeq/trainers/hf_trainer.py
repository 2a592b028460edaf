"""transformers' ``Trainer`` as people use it: ``TrainingArguments`` set from the shared problem, the
loss through ``num_items_in_batch``, the trace written by a ``TrainerCallback``.

The Trainer owns the loop, so this module is not the pair's skeleton but what configures it; the
accumulation is the Trainer's own (its ``training_step``: the model's loss given the global batch's
token count, × num_processes with ``average_tokens_across_devices``, then accelerate's ``backward``,
which divides by GA). ``cell.bug`` lines plant the mistakes of gaeq/bugs.py where they are made.

Data: gaeq's plan. The dataset is the run's global positions in order and the sampler sequential;
the Trainer's (accelerate's) sharding hands rank r batch k·world + r of each step — exactly the
micro-batch the plan gives it (gaeq/problem/data.py), which Provenance checks by its rows.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.build import BuiltProblem
from gaeq.problem.data import IGNORE_INDEX
from gaeq.problem.hf import is_token_classifier
from gaeq.problem.models import sample_keys
from gaeq.problem.spec import ProblemSpec
from gaeq.registry import TRAINERS
from gaeq.trainers.base import RunContext, build_cell_problem, inject_fault
from gaeq.trainers.deepspeed_config import deepspeed_config
from gaeq.trainers.hf_sequence_parallel import (
    attention_function,
    averaged_over,
    padded_length,
    sequence_parallel_args,
)
from gaeq.trainers.library_state import forget_parallel_groups, forget_ulysses_attention, reset_accelerate_state
from gaeq.trainers.provenance import Provenance, engine_norm_dtype
from gaeq.trainers.recorder import StepRecorder

SCHEDULES = {"constant": "constant", "warmup_cosine": "cosine_with_min_lr"}
"""gaeq's schedule → transformers' lr_scheduler_type: the same lr at every step, warmup included when
the matrix follows transformers' warmup convention (lr 0 at step 0; the expander refuses gaeq's)."""


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank; returns what really ran (:mod:`gaeq.trainers.provenance`)."""
    task = build_cell_problem(cell, problem, ctx)
    plan = task.plan
    reset_accelerate_state()  # the Trainer builds its own Accelerator
    if TRAINERS[cell.trainer].deepspeed:
        forget_parallel_groups()  # ... and its own DeepSpeed engine
    # loss: hf — the transformers model's own loss takes num_items_in_batch; any other loss (a
    # transformers model's logits under cross_entropy, gaeq's models) goes through a wrapper.
    own_loss = problem.loss == "hf"
    model = task.model if own_loss else LossKwargsModel(task.model, task.built)
    spec, schedule = problem.optimizer, problem.schedule
    args = TrainingArguments(
        output_dir=str(ctx.cell_dir / "hf_trainer"),
        per_device_train_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum_steps,
        max_steps=problem.steps,
        learning_rate=spec.lr,
        optim="adamw_torch",  # torch.optim.AdamW, the torch trainer's update
        adam_beta1=spec.betas[0],
        adam_beta2=spec.betas[1],
        adam_epsilon=spec.eps,
        weight_decay=spec.weight_decay,
        lr_scheduler_type=SCHEDULES[schedule.name],
        lr_scheduler_kwargs={"min_lr_rate": schedule.min_lr_ratio} if schedule.name == "warmup_cosine" else {},
        # gaeq's constant schedule has no warmup; the cosine's is transformers' own (rules.check_hf_trainer)
        warmup_steps=schedule.warmup_steps if schedule.name == "warmup_cosine" else 0,
        # 0 would skip clip_grad_norm_ — and with it the grad norm; inf measures without clipping.
        max_grad_norm=problem.gradient_clipping or math.inf,
        # The global batch's token count, gathered over ranks; False counts each rank's own.
        average_tokens_across_devices=cell.bug != Bug.HF_TOKENS_PER_DEVICE,  # planted bug: per device
        bf16=cell.dtype == "bf16",
        seed=problem.seed,
        use_cpu=ctx.device.type == "cpu",
        logging_steps=1,  # the grad norm of every step reaches on_log
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        deepspeed=trainer_deepspeed_config(cell, problem) if TRAINERS[cell.trainer].deepspeed else None,
        **sequence_parallel_args(cell, seq_len=padded_length(task, cell)),
    )
    dataset = PositionDataset(task, cell=cell, steps=problem.steps, with_positions=not own_loss)
    trainer = PlanTrainer(model=model, args=args, train_dataset=dataset)
    if cell.sequence_parallel > 1 and problem.model.sp_loss == "global_tokens":
        trainer.global_tokens = task.normaliser
        trainer.loss_is_scaled_for_ga = True  # what the Trainer asks of a compute_loss that normalises itself
    trainer.remove_callback(PrinterCallback)  # the rank's log, not its stdout
    if (
        cell.bug == Bug.HF_DEEPSPEED_LOSS_DIVIDED_TWICE
    ):  # planted bug: transformers before #35808 let DeepSpeed ÷ GA too
        backward = trainer.accelerator.backward
        trainer.accelerator.backward = lambda loss, **kwargs: backward(loss, **{**kwargs, "scale_wrt_gas": True})
    if cell.bug == Bug.HF_LOSS_PER_MICRO_BATCH:
        trainer.model_accepts_loss_kwargs = False  # planted bug: no num_items_in_batch — each micro-batch's mean ÷ GA
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps, plan=task.plan)
    ran = Provenance(
        cell,
        promised=promised(cell, problem),
        **task.model_facts(),
        world_size=trainer.accelerator.num_processes,
        grad_accum_steps=args.gradient_accumulation_steps,
        model_accepts_loss_kwargs=trainer.model_accepts_loss_kwargs,
        average_tokens_across_devices=args.average_tokens_across_devices,
        update_rule="AdamW",
    )
    if task.routes:  # a mixture of experts: the tokens each expert took in the first step
        ran.read_at_first_step(router_tokens=task.router_tokens)
    if cell.sequence_parallel > 1:  # the loss the Trainer's compute_loss chose
        ran.read_at_first_step(sp_loss=lambda: trainer.sp_loss_ran)
    recording = Recording(task=task, recorder=recorder, ran=ran, cell=cell, rank=ctx.rank, trainer=trainer)
    trainer.add_callback(recording)
    hooks = recording.watch(model)
    try:
        trainer.train()
    finally:
        for hook in hooks:
            hook.remove()
        if cell.sequence_parallel > 1:
            forget_ulysses_attention()
    ran.facts["ddp"] = isinstance(trainer.model_wrapped, DDP)  # for the record (accelerate wraps under a launcher)
    recorder.close()
    trainer.accelerator.free_memory()
    return ran.facts


def promised(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What a Trainer cell's label promises (:mod:`gaeq.trainers.provenance` checks it after step 1)."""
    label = {
        "grad_accum_steps": cell.grad_accum_steps,
        # what the Trainer decided: False under the planted bug, where the model says so itself, or under
        # DeepSpeed's sequence parallelism (its loss counts the slices' tokens itself)
        "model_accepts_loss_kwargs": cell.bug != Bug.HF_LOSS_PER_MICRO_BATCH
        and getattr(problem.model, "accepts_loss_kwargs", None) is not False
        and cell.sequence_parallel == 1,
        "average_tokens_across_devices": cell.bug != Bug.HF_TOKENS_PER_DEVICE,
    }
    if TRAINERS[cell.trainer].deepspeed:  # hf_deepspeed: the engine the Trainer built
        label["zero_stage"] = cell.zero_stage
    if TRAINERS[cell.trainer].sequence_parallel:  # the group DeepSpeed made, the loss that ran in it
        label["sequence_parallel"] = cell.sequence_parallel
        if cell.sequence_parallel > 1:
            label["sp_loss"] = problem.model.sp_loss
    return label


def trainer_deepspeed_config(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What `TrainingArguments(deepspeed=...)` gets: the config gaeq's own DeepSpeed trainer writes
    (every knob explicit: AdamW as torch_adam, clipping, ZeRO stage), with what the Trainer owns left
    to it as "auto": the batch triple and the clipping it derives from its arguments (it refuses an
    explicit value that differs), and no scheduler section (the Trainer's lr_scheduler_type then
    drives DeepSpeed's engine)."""
    config = deepspeed_config(cell, problem)
    for key in (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
    ):
        config[key] = "auto"
    return config


class LossKwargsModel(torch.nn.Module):
    """A model under the problem's own loss, as the Trainer wants a causal LM: ``forward(input_ids,
    labels, num_items_in_batch=None)`` → ``{"loss": loss sum ÷ num_items_in_batch}``
    (``BuiltProblem.micro_loss``) — or, without a count, the micro-batch's mean (what a model
    without loss kwargs returns). ``positions`` keys gaeq's split-invariant dropout."""

    def __init__(self, model: torch.nn.Module, built: BuiltProblem) -> None:
        super().__init__()
        self.model = model
        self.built = built  # not a submodule: the model is registered once, above

    def forward(self, input_ids, labels, positions=None, num_items_in_batch=None, **kwargs) -> dict[str, torch.Tensor]:
        count = num_items_in_batch if num_items_in_batch is not None else (labels != IGNORE_INDEX).sum()
        with sample_keys(positions.tolist() if positions is not None else range(len(input_ids))):
            return {"loss": self.built.micro_loss(self.model, input_ids, labels, num_items=count)}


class PositionDataset(torch.utils.data.Dataset):
    """Item i = the sample the plan puts where the Trainer's loader will take item i, as its collator wants
    it: input_ids, labels (already the next tokens, so also shift_labels).

    The loader hands rank r batch k·world + r of the items in order (accelerate's sharding); under
    sequence parallelism DeepSpeed's adapter then runs the sp ranks' k-th batches one after the other
    on the whole group (iteration k·sp + j is rank j's), each sliced by tokens. Each item is the
    plan's micro-batch row for that iteration — (step, micro-step) = divmod(iteration, GA), on data
    rank r ÷ sp — so every step trains the plan's samples; without sequence parallelism this is the
    plan's positions in order."""

    def __init__(self, task, *, cell: Cell, steps: int, with_positions: bool) -> None:
        self.task = task
        self.with_positions = with_positions
        self.sp, self.world = cell.sequence_parallel, cell.world_size
        self.length = padded_length(task, cell)
        per_rank = -(-steps * task.plan.grad_accum_steps // self.sp)  # the loader's batches on each rank
        self.size = per_rank * self.world * task.plan.micro_batch_size

    def __len__(self) -> int:
        return self.size

    def position(self, index: int) -> int:
        """The plan's global position of item `index`."""
        plan = self.task.plan
        batch, row = divmod(index, plan.micro_batch_size)
        round_, rank = divmod(batch, self.world)
        data_rank, sp_rank = divmod(rank, self.sp)
        step, micro_step = divmod(round_ * self.sp + sp_rank, plan.grad_accum_steps)
        return plan.positions(step=step, micro_step=micro_step, rank=data_rank)[row]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        position = self.position(index)
        inputs, targets = self.task.built.dataset.batch([self.task.plan.sample_at(position)])
        if self.sp > 1:  # labels as DeepSpeed's adapter wants them: unshifted (padded_length says why)
            pad = self.length - len(inputs[0])
            ignored = torch.full((pad,), IGNORE_INDEX, dtype=targets.dtype)
            return {
                "input_ids": torch.cat([inputs[0], torch.zeros(pad, dtype=inputs.dtype)]),
                "labels": torch.cat([ignored[:1], targets[0], ignored[1:]]),
                "position_ids": torch.arange(self.length),  # Ulysses requires them (each token's global place)
            }
        item = {"input_ids": inputs[0], "labels": targets[0]}
        if self.with_positions:
            item["positions"] = torch.tensor(position)
        else:
            item["shift_labels"] = targets[0]
        return item


class PlanTrainer(Trainer):
    """The Trainer with gaeq's order of samples, and gaeq's optimisation where the defaults differ."""

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    global_tokens = None
    """step → the global batch's tokens: under sequence parallelism with sp_loss global_tokens, the
    corrected normaliser's count (None: the Trainer's own loss)."""
    sp_loss_ran: str | None = None
    """Which loss ran under sequence parallelism, read where it is chosen (Provenance: `sp_loss`)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        pc = self.accelerator.parallelism_config
        if pc is None or not pc.sp_enabled or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.global_tokens is None:  # transformers' deepspeed_sp_compute_loss, as users run it
            self.sp_loss_ran = "trainer"
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # The corrected normaliser: this rank's token-loss sum ÷ the global batch's tokens, × the ranks
        # DeepSpeed then divides the summed gradient by (averaged_over); nothing gathered.
        self.sp_loss_ran = "global_tokens"
        labels = inputs["shift_labels"]  # the adapter's: this rank's slice, already shifted
        count = self.global_tokens(self.state.global_step) / averaged_over(model)
        outputs = model(**{**inputs, "labels": labels}, num_items_in_batch=count)
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def get_decay_parameter_names(self, model) -> list[str]:
        # The Trainer exempts biases and norm weights from weight decay; gaeq's problem (like
        # DeepSpeed's optimizer and the torch trainer) decays every parameter.
        return [name for name, _ in model.named_parameters()]


class Recording(TrainerCallback):
    """The trace, written as the Trainer goes: the lr and the clock at each step's start, the loss of
    every forward (read by hooks on the model), the grad norm from the Trainer's own log of the step
    (its clip_grad_norm_, before clipping), Provenance after the first step, parameter snapshots."""

    def __init__(
        self, *, task, recorder: StepRecorder, ran: Provenance, cell: Cell, rank: int, trainer: Trainer
    ) -> None:
        self.task, self.recorder, self.ran, self.cell, self.rank, self.trainer = (
            task,
            recorder,
            ran,
            cell,
            rank,
            trainer,
        )
        self.step, self.lr, self.started, self.local_loss_sum = 0, 0.0, 0.0, 0.0

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.step = state.global_step
        if self.step == 0:  # what the Trainer built in train(): the model's wrapper, DeepSpeed's engine
            wrapped = self.trainer.model_wrapped
            self.ran.facts["engine"] = type(wrapped).__name__
            if self.trainer.is_deepspeed_enabled:
                self.ran.facts["zero_stage"] = wrapped.zero_optimization_stage()
                self.ran.facts["grad_norm_dtype"] = engine_norm_dtype(wrapped)
                self.ran.facts["sequence_parallel"] = wrapped.sequence_parallel_size  # the engine's group
                if wrapped.sequence_parallel_size > 1:  # DeepSpeed's UlyssesSPAttentionHF, if it took it over
                    self.ran.facts["attention"] = attention_function(self.task.model)
                    self.ran.facts["sp_gradients_averaged_over"] = averaged_over(wrapped)
            else:  # accelerate's clip_grad_norm_ → torch's, in the gradients' dtype
                self.ran.facts["grad_norm_dtype"] = str(next(wrapped.parameters()).dtype).removeprefix("torch.")
        inject_fault(self.cell, rank=self.rank, step=self.step)
        self.started = time.perf_counter()
        self.lr = optimizer.param_groups[0]["lr"]
        self.local_loss_sum = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.ran.step_done()
        if self.recorder.wants("params", self.step):
            self.recorder.snapshot(
                step=self.step, kind="params", gather=lambda: dict(self.task.model.named_parameters())
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "grad_norm" not in logs:
            return  # the run's closing summary
        self.recorder.record(
            step=self.step,
            local_loss_sum=self.local_loss_sum,
            normaliser=self.task.normaliser(self.step),
            grad_norm=float(logs["grad_norm"]),
            lr=self.lr,
            seconds=time.perf_counter() - self.started,
        )

    def watch(self, model: torch.nn.Module) -> list:
        """Hooks around each forward the Trainer makes (it owns the call): Provenance (the first
        one's rows and module dtypes), and the micro-batch's loss sum = its loss × the count it was
        divided by (num_items_in_batch, or its own valid tokens for a mean — what a token classifier
        returns whatever it is given: GenericForTokenClassification drops the count)."""
        open_: list = []
        means = is_token_classifier(model)

        def before(module, args, kwargs):
            context = self.ran.forward(kwargs["input_ids"])
            context.__enter__()
            open_.append(context)

        def after(module, args, kwargs, output):
            open_.pop().__exit__(None, None, None)
            loss = output["loss"] if isinstance(output, dict) else output.loss
            count = kwargs.get("num_items_in_batch")
            if count is None or means:  # a mean over the micro-batch's own valid tokens
                labels = kwargs.get("shift_labels", kwargs["labels"])  # a sequence slice's: already shifted
                count = (labels != IGNORE_INDEX).sum()
            if float(count):  # (an empty slice's mean is 0/0: it holds no loss)
                self.local_loss_sum += loss.item() * float(count)

        return [
            model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True),
        ]
