"""DeepSpeed's pipeline engine: a PipelineModule cut from the model by layer, ``engine.train_batch``
once per optimizer step — accumulation is the schedule.

Read it beside deepspeed_native.py: the same config, data plan and records. What differs is who
runs the micro-steps: the engine pulls GA micro-batches (first and last stage), sends activations
forward and their gradients back, divides the last stage's loss by GA, averages over the
data-parallel ranks and steps — all inside ``train_batch``. ``# ACCUMULATION:`` marks where.
The planted bugs (gaeq/bugs.py) replace one of the engine's instructions on this engine only.
"""

from __future__ import annotations

import math
import time
import types
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe import PipelineModule, p2p, schedule

from gaeq.bugs import Bug
from gaeq.matrix import Cell
from gaeq.problem.models import gpt_layers
from gaeq.problem.optim import build_scheduler, gradient_clipping
from gaeq.problem.spec import ProblemSpec
from gaeq.trainers.base import RunContext, build_cell_problem, inject_fault
from gaeq.trainers.deepspeed_config import deepspeed_config
from gaeq.trainers.library_state import forget_parallel_groups
from gaeq.trainers.provenance import Provenance
from gaeq.trainers.recorder import StepRecorder

PARTITION = "type:Block"
"""How DeepSpeed cuts the layer list: the blocks balanced over the stages, the embeddings with the
first and the head with the last (gaeq/problem/stages.py's cut, read back and checked)."""


SCHEDULES = {"1f1b": "TrainSchedule"}
"""The `pipeline_schedule` axis → the engine's schedule class (its only training schedule: 1F1B)."""


def promised(cell: Cell, problem: ProblemSpec) -> dict[str, Any]:
    """What a DeepSpeed pipeline cell's label promises — what its engine must report after set-up."""
    return {
        "pipeline_parallel": cell.pipeline_parallel,
        "zero_stage": cell.zero_stage,
        "micro_batch_size": cell.micro_batch_size,
        "grad_accum_steps": cell.grad_accum_steps,
        "pipeline_micro_batches": cell.grad_accum_steps,
        "schedule": SCHEDULES[cell.pipeline_schedule],
        "gradient_clipping": gradient_clipping(problem),
    }


def train(*, cell: Cell, problem: ProblemSpec, ctx: RunContext) -> dict:
    """Train the cell on this rank (one stage of one pipeline); returns what really ran."""
    forget_parallel_groups()
    task = build_cell_problem(cell, problem, ctx)
    plan = task.plan
    place = cell.place(ctx.rank)
    step_loss = {"sum": 0.0, "num_items": 1}  # the forward loss sums of this step (only the last stage has any)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss_sum = task.built.loss_sum(logits, targets)
        step_loss["sum"] += loss_sum.item()
        # ACCUMULATION: the engine divides the last stage's loss by GA and averages the gradients
        # over the data-parallel ranks; num_items counts the whole global batch (÷ GA is in it), so
        # we hand it GA × dp × our share — as deepspeed_native.py hands engine.backward.
        return loss_sum / step_loss["num_items"] * task.data_parallel * plan.grad_accum_steps

    module = PipelineModule(
        layers=gpt_layers(task.model),  # the whole model's own modules: the baseline's weights
        num_stages=cell.pipeline_parallel,
        loss_fn=loss_fn,
        partition_method=PARTITION,
        seed_layers=False,  # it would reseed torch's RNG per layer and micro-batch
        activation_checkpoint_interval=0,
    )
    config = deepspeed_config(cell, problem)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters()],
        config=config,
        lr_scheduler=lambda optimizer: build_scheduler(optimizer, problem),
    )
    if engine.grid.get_data_parallel_id() != place.data or engine.stage_id != place.stage:
        raise RuntimeError(f"DeepSpeed placed rank {ctx.rank} elsewhere than {place}")
    norm = _measure_norm(engine)
    if cell.bug == Bug.PIPE_LOSS_SUMMED_OVER_GA:  # planted bug (DeepSpeed#7773): the last stage's loss not ÷ GA
        engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.BackwardPass: _backward_not_divided}
    if cell.bug == Bug.PIPE_RESCALED_EVERY_STAGE:  # planted bug (DeepSpeed#8152): every stage ÷ GA again
        engine._backward_prologue_per_tensor = types.MethodType(DeepSpeedEngine._backward_prologue_per_tensor, engine)
    recorder = StepRecorder(cell=cell, ctx=ctx, steps=problem.steps, plan=task.plan)
    recorder.count_collectives(engine)
    ran_schedules = _measure_stage(engine, recorder)
    ran = Provenance(
        cell,
        promised=promised(cell, problem),
        world_size=engine.world_size,
        pipeline_parallel=engine.num_stages,
        tensor_parallel=engine.grid.get_slice_parallel_world_size(),  # the grid's ranks per layer slice
        stage=engine.stage_id,
        stage_layers=[int(p) for p in module.parts],
        partition_method=PARTITION,
        zero_stage=engine.zero_optimization_stage(),
        grad_accum_steps=engine.gradient_accumulation_steps(),
        pipeline_micro_batches=engine.micro_batches,
        micro_batch_size=engine.train_micro_batch_size_per_gpu(),
        gradient_clipping=engine.gradient_clipping(),
        update_rule=type(engine.basic_optimizer).__name__,
    )
    ran.read_at_first_step(schedule=lambda: ran_schedules[0])
    ran.watch_forwards(engine.module)

    for step in range(problem.steps):
        inject_fault(cell, rank=ctx.rank, step=step)
        started = time.perf_counter()
        lr = engine.get_lr()[0]
        normaliser = task.normaliser(step)  # loss elements (samples or valid tokens) in the global batch
        step_loss.update(sum=0.0, num_items=normaliser)
        # ACCUMULATION: one call runs the step's GA micro-batches through the stages (the first
        # stage reads their inputs, the last their targets), then reduces, clips and steps.
        micro_batches = (
            (mb.inputs, mb.targets)
            for mb in (task.micro_batch(step=step, micro_step=k) for k in range(plan.grad_accum_steps))
        )
        recorder.pipeline.start()
        engine.train_batch(data_iter=micro_batches)
        recorder.measure_model_state(step=step, micro_step=0, model=engine.module, optimizer=engine.optimizer)
        ran.step_done()
        recorder.record(
            step=step,
            local_loss_sum=step_loss["sum"],
            normaliser=normaliser,
            grad_norm=norm["value"],
            lr=lr,
            seconds=time.perf_counter() - started,
        )
    recorder.close()
    engine.destroy()
    return ran.facts


def _measure_norm(engine) -> dict[str, float]:
    """The whole model's gradient norm before clipping, every step (``["value"]``): at ZeRO-1 the
    engine's own (its optimizer sums every stage's partitions); at ZeRO-0, where the engine reports
    none, measured in float64 from each stage's averaged gradients just before the optimizer step,
    summed over the pipeline's stages."""
    norm = {"value": math.nan}
    step = engine._INSTRUCTION_MAP[schedule.OptimizerStep]
    engine_reports = engine.zero_optimization_stage() > 0
    group = engine.grid.get_pipe_parallel_group()

    def optimizer_step(self, *args, **kwargs):
        if not engine_reports:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            squares = sum(g.double().pow(2).sum() for g in grads).reshape(1)
            deepspeed.comm.all_reduce(squares, group=group)
            norm["value"] = squares.sqrt().item()
        step(self, *args, **kwargs)
        if engine_reports:
            norm["value"] = float(self.get_global_grad_norm())

    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.OptimizerStep: optimizer_step}
    return norm


def _measure_stage(engine, recorder: StepRecorder) -> list[str]:
    """The engine's ForwardPass and BackwardPass instructions timed as the stage's work, the tensors
    its p2p sends and receives move counted (gaeq.trainers.cost.PipelineCost); returns the list the
    class name of each schedule the engine executes is appended to."""
    cost, schedules = recorder.pipeline, []
    engine._INSTRUCTION_MAP = {
        **engine._INSTRUCTION_MAP,
        schedule.ForwardPass: cost.computing(engine._INSTRUCTION_MAP[schedule.ForwardPass]),
        schedule.BackwardPass: cost.computing(engine._INSTRUCTION_MAP[schedule.BackwardPass]),
    }
    for name in ("send", "recv"):
        cost.patch(p2p, name, lambda fn: cost.sending(fn, lambda args, kwargs, result: [args[0]]))
    execute = engine._exec_schedule

    def exec_schedule(pipe_schedule, *args, **kwargs):
        schedules.append(type(pipe_schedule).__name__)
        return execute(pipe_schedule, *args, **kwargs)

    engine._exec_schedule = exec_schedule
    return schedules


def _backward_not_divided(self, buffer_id):
    """The engine's BackwardPass instruction with DeepSpeed#7773's mistake (0.16.0–0.18.3): the last
    stage backpropagates its loss without ÷ GA — the gradients are summed over the micro-batches,
    while the loss train_batch returns is still their average."""
    if self.is_last_stage():
        DeepSpeedEngine.backward(self, self.loss, scale_wrt_gas=False)  # planted bug: should be ÷ GA
        return None
    return type(self)._INSTRUCTION_MAP[schedule.BackwardPass](self, buffer_id)
