"""What every trainer shares: the problem it builds, step accounting, recording, fault injection.

Everything that is *not* about how gradients are accumulated lives here, so that the two trainer
modules differ only where accumulation really differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import gaeq.rows as rows
from gaeq.bugs import GENERATION_STEPS, Bug
from gaeq.matrix import Cell
from gaeq.problem.build import BuiltProblem, build_problem
from gaeq.problem.data import IGNORE_INDEX, BatchPlan
from gaeq.problem.hf import RouterTokens, dropouts
from gaeq.problem.loss import cross_entropy_on_own_shard, cross_entropy_row_means, mean_of_means_count
from gaeq.problem.models import sample_keys
from gaeq.problem.moe import Balance, moe_layers
from gaeq.problem.spec import ProblemSpec


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """Where a cell runs: this process's place in the (already initialised) process group."""

    rank: int
    world_size: int
    device: torch.device
    cell_dir: Path
    on_step: Callable[[int], None] = lambda step: None
    """Called by rank 0 after each optimizer step (progress reporting)."""
    run_dir: Path | None = None
    """The run directory (checkpoints of resume experiments live there)."""


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    inputs: torch.Tensor
    targets: torch.Tensor
    step: int
    """The optimizer step it belongs to."""
    positions: Sequence[int]
    """Global positions of its samples, in its rows' order (keys of split-invariant dropout)."""
    loss_elements: int
    """Loss elements in this micro-batch (samples, or valid tokens)."""


@dataclass(frozen=True, kw_only=True)
class CellProblem:
    """The built problem of one cell: identical for every trainer."""

    plan: BatchPlan
    """Which samples each data-parallel rank sees (its world_size: the data-parallel ranks)."""
    built: BuiltProblem
    dtype: str
    device: torch.device
    data_rank: int
    """This rank's place in the plan: its data-parallel rank (Cell.place: the ranks of one
    tensor-parallel group share micro-batches, the stages of one pipeline pass them on)."""
    balance: Balance | None = None
    """A mixture of experts' load-balancing loss (gaeq/problem/moe.py); None for a dense model."""
    aux_share: float = 1.0
    """A micro-batch's weight in a transformers mixture of experts' balance term (balance_share)."""
    routers: RouterTokens | None = None
    """A transformers mixture of experts' routing, counted (None for any other model)."""
    tokens: slice = dataclasses.field(default_factory=lambda: slice(None))
    """The tokens of each sample this rank holds: all of them, or its slice under sequence parallelism."""
    sequence_parallel: int = 1
    """Ranks each sample's tokens are split over (the slices of one micro-batch)."""
    row_order: int | None = None
    """A noise-floor twin's seed: each micro-batch's rows in another order (the same samples, summed in
    another order by every reduction over the batch — rounding alone); None: the plan's order."""

    @property
    def model(self) -> torch.nn.Module:
        return self.built.model

    def num_items(self, cell: Cell, mb: MicroBatch, *, normaliser: int) -> float:
        """What a micro-batch's loss sum is divided by: the global batch's element count
        (`normaliser`), so that every element of the global batch weighs the same whatever the
        split (÷ GA included). Counting is where the normalisation bugs are made."""
        if cell.bug == Bug.MEAN_OF_MEANS:  # planted bug: counts as if every micro-batch were this one
            return mean_of_means_count(  # (a sequence slice's own mean, with sequence parallelism: verl#2857)
                micro_elements=max(mb.loss_elements, 1),  # an empty slice's mean: 0, as masked means clamp
                grad_accum_steps=self.plan.grad_accum_steps,
                data_parallel=self.plan.data_parallel * self.sequence_parallel,
            )
        if cell.bug == Bug.SP_TOKENS_OVER_DATA_RANKS_ONLY:  # planted bug: this slice's tokens, summed over dp only
            return self.slice_loss_elements(mb.step)
        if cell.bug == Bug.HF_NUM_ITEMS_PER_MICRO_BATCH:
            return mb.loss_elements  # planted bug: num_items_in_batch of the micro-batch, not the global batch
        if cell.bug == Bug.EMPTY_MICRO_BATCH_COUNTED:  # planted bug: a micro-batch's mean ÷ all of the step's
            return max(mb.loss_elements, 1) * self.plan.grad_accum_steps * self.plan.data_parallel  # empties too
        if cell.bug == Bug.PARTIAL_LAST_WINDOW:  # planted bug: ÷ GA, even where the epoch's last window is short
            return normaliser * self.plan.grad_accum_steps / self.plan.micro_steps(mb.step)
        if cell.bug == Bug.PG_DIVIDED_BY_GA_TWICE:  # planted bug: the window's tokens, then ÷ GA once more
            return normaliser * self.plan.grad_accum_steps
        if cell.bug == Bug.PG_NORMALISED_OVER_GENERATION:  # planted bug: the tokens of the generation batch
            first = mb.step - mb.step % GENERATION_STEPS  # ... which spans several optimizer steps
            return sum(self.normaliser(step) for step in range(first, first + GENERATION_STEPS))
        if cell.bug == Bug.PG_TOKENS_PER_RANK:  # planted bug: this rank's tokens of the step, DDP's mean on top
            return self.rank_loss_elements(mb.step) * self.plan.data_parallel
        return normaliser

    def slice_loss_elements(self, step: int) -> int:
        """Loss elements of `step`'s global batch within this rank's token slice (token data)."""
        _, targets = self.built.dataset.batch(self.plan.samples_at(self.plan.step_positions(step)))
        return int((targets[:, self.tokens] != IGNORE_INDEX).sum())

    def rank_loss_elements(self, step: int) -> int:
        """Loss elements of this rank's micro-batches of `step` (its accumulation group)."""
        positions = [
            p
            for k in range(self.plan.micro_steps(step))
            for p in self.plan.positions(step=step, micro_step=k, rank=self.data_rank)
        ]
        return self.built.total_loss_elements(self.plan.samples_at(positions))

    def micro_loss(self, net: torch.nn.Module, mb: MicroBatch, *, num_items: int) -> torch.Tensor:
        """Forward the micro-batch through `net`: its loss sum ÷ `num_items` (``loss: hf``: the
        model's own loss, given ``num_items_in_batch``) — plus, for a mixture of experts, its term of
        the load-balancing loss."""
        loss = self.built.micro_loss(net, mb.inputs, mb.targets, num_items=num_items, aux_share=self.aux_share)
        return loss if self.balance is None else loss + self.balance.loss()

    def route_step(self, net: torch.nn.Module, step: int) -> None:
        """Before a step's first backward: a mixture of experts balanced over the global batch counts
        the step's routing (a forward of each of this rank's micro-batches, without gradient, summed
        over the ranks); nothing otherwise."""
        if self.balance is None:
            return

        def forward(k: int) -> Callable[[], object]:
            def run() -> object:
                mb = self.micro_batch(step=step, micro_step=k)
                with self.forwarding(mb):
                    return net(mb.inputs)

            return run

        self.balance.route(forward(k) for k in range(self.plan.grad_accum_steps))

    @property
    def routes(self) -> bool:
        """A mixture of experts: gaeq's GPT with `moe`, or a transformers model with routers."""
        return self.balance is not None or self.routers is not None

    def router_tokens(self) -> list[list[int]] | None:
        """Tokens each expert of each layer took on this rank so far (``ran``); None for a dense model."""
        if self.routers is not None:
            return self.routers.tokens()
        return None if self.balance is None else [layer.routed.tolist() for layer in self.balance.layers]

    def model_facts(self) -> dict:
        """What the model is, for the provenance: a transformers model's class and the non-zero
        dropouts of its config (their masks come from torch's global RNG, so depend on the split)."""
        config = getattr(self.model, "config", None)
        if config is None:
            return {}
        return {"model": type(self.model).__name__, "dropout": dropouts(self.model)}

    def normaliser(self, step: int) -> int:
        """Loss elements in the whole global batch of `step` (samples, or valid tokens): the
        denominator of the step's loss, known before any forward pass."""
        return self.built.total_loss_elements(self.plan.samples_at(self.plan.step_positions(step)))

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples: the ranks gradients are averaged over."""
        return self.plan.data_parallel

    def micro_batch(self, *, step: int, micro_step: int) -> MicroBatch:
        """This rank's micro-batch at (`step`, `micro_step`)."""
        positions = self.plan.positions(step=step, micro_step=micro_step, rank=self.data_rank)
        indices = self.plan.samples_at(positions)
        if self.row_order is not None:  # a noise-floor twin: the same samples, in another order
            order = rows.row_order(len(indices), seed=self.row_order, at=(step, micro_step))
            positions, indices = [positions[i] for i in order], [indices[i] for i in order]
        inputs, targets = self.built.dataset.batch(indices)
        if self.dtype in HALF_MODEL and inputs.is_floating_point():
            inputs = inputs.to(HALF_MODEL[self.dtype])  # DeepSpeed's bf16/fp16 engine holds a half model
        if self.sequence_parallel > 1:  # this rank's slice of every sample's tokens, and its valid targets
            inputs, targets = inputs[:, self.tokens], targets[:, self.tokens]
            elements = int((targets != IGNORE_INDEX).sum())
        else:
            elements = self.built.total_loss_elements(indices)
        return MicroBatch(
            step=step,
            inputs=inputs.to(self.device),
            targets=targets.to(self.device),
            positions=positions,
            loss_elements=elements,
        )

    def forwarding(self, mb: MicroBatch) -> contextlib.AbstractContextManager:
        """Around a forward pass: low-precision autocast (bf16/fp16 cells) and the sample keys
        that make dropout split-invariant."""
        if self.dtype not in AUTOCAST:
            return sample_keys(mb.positions)
        return _autocast_with_keys(self.dtype, self.device, mb.positions)


@contextlib.contextmanager
def _autocast_with_keys(dtype: str, device: torch.device, keys: Sequence[int]) -> Iterator[None]:
    with autocast(dtype, device), sample_keys(keys):
        yield


def build_cell_problem(cell: Cell, problem: ProblemSpec, ctx: RunContext) -> CellProblem:
    if cell.world_size != (dist.get_world_size() if dist.is_initialized() else 1):
        raise RuntimeError(f"cell {cell.id} needs world_size {cell.world_size}, process group has another")
    torch.manual_seed(problem.seed)  # the global RNG (dropout_rng: global) starts alike in every cell
    plan = plan_of(cell, problem)
    built = build_problem(problem)
    if cell.bug == Bug.LOSS_PARALLEL_SHARD_SOFTMAX:  # planted bug: each rank's softmax over its own vocabulary slice
        built = dataclasses.replace(built, loss_sum=cross_entropy_on_own_shard)
    if cell.bug == Bug.PACKED_SEQUENCES_WEIGHTED_PER_PACK:  # planted bug: each pack's mean, the packs averaged
        built = dataclasses.replace(built, loss_sum=cross_entropy_row_means, per_sample=True)
    layers = moe_layers(built.model)
    share = balance_share(cell, plan)
    sp = cell.sequence_parallel
    width = getattr(built.dataset, "seq_len", 0) // sp  # each sequence-parallel rank's contiguous slice
    first = cell.place(ctx.rank).sequence * width
    return CellProblem(
        plan=plan,
        built=built,
        dtype=cell.dtype,
        device=ctx.device,
        data_rank=cell.place(ctx.rank).data,
        balance=Balance(
            problem.model.moe,
            layers,
            share=share,
            over_own_tokens=cell.bug == Bug.MOE_COUNTS_OVER_MICRO_BATCH_TOKENS,  # planted bug (Megatron-LM#7213)
        )
        if layers
        else None,
        aux_share=share,
        routers=RouterTokens(built.model) or None,  # a transformers mixture of experts' routers, if any
        tokens=slice(first, first + width) if sp > 1 else slice(None),
        sequence_parallel=sp,
        row_order=cell.perturbation.twin_seed if cell.perturbation is not None else None,
    )


def plan_of(cell: Cell, problem: ProblemSpec) -> BatchPlan:
    """Which samples each of the cell's data-parallel ranks sees at each (step, micro-step)."""
    return BatchPlan(
        train_batch_size=cell.train_batch_size,
        micro_batch_size=cell.micro_batch_size,
        data_parallel=cell.data_parallel,
        num_samples=problem.num_samples,
        short_steps=problem.epoch_end == "short_step",
        seed=problem.seed,
    )


def short_step_label(cell: Cell, problem: ProblemSpec) -> dict[str, int]:
    """What a loop that runs short steps (registry `short_steps`) promises where an epoch ends in one
    within the run: the micro-steps of the first (Provenance measures them when it comes)."""
    plan = plan_of(cell, problem)
    short = plan.first_short_step()
    return {} if short is None or short >= problem.steps else {"short_step_micro_steps": plan.micro_steps(short)}


def balance_share(cell: Cell, plan: BatchPlan) -> float:
    """A micro-batch's weight in a mixture of experts' load-balancing loss: its share of the step's
    GA × dp micro-batches — as the main loss's num_items carries ÷ GA. Where the MoE bugs are made."""
    share = 1.0 / (plan.grad_accum_steps * plan.data_parallel)
    if cell.bug == Bug.MOE_AUX_LOSS_NOT_DIVIDED_BY_GA:
        share = 1.0 / plan.data_parallel  # planted bug: the auxiliary term added to every micro-batch whole
    if cell.bug == Bug.MOE_AUX_LOSS_AVERAGED_TWICE:
        share = share / plan.data_parallel  # planted bug: ÷ dp by hand, then DDP's average again
    return share


def times(loss: torch.Tensor, factor: int) -> torch.Tensor:
    """`loss` × `factor` (a count of ranks or micro-steps), where the wrapper averages what it sums: the loss
    itself where the factor is 1 — exact either way, and a multiplication by one is a node of the backward graph
    each micro-step pays for nothing (benchmarks/lab_speed.py: the trainer against a bare loop)."""
    return loss if factor == 1 else loss * factor


HALF_MODEL = {"ds_bf16": torch.bfloat16, "ds_fp16": torch.float16}
"""Dtypes in which DeepSpeed holds the model itself in half precision."""
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""Dtypes computed by forward-pass autocast over fp32 weights, on every trainer."""


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Forward-pass autocast for `bf16`/`fp16` cells; a no-op in fp32 (and ds_bf16/ds_fp16, where
    DeepSpeed itself holds the model in half precision)."""
    if dtype in AUTOCAST:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST[dtype])
    return contextlib.nullcontext()


def autocast_inside(module: torch.nn.Module, dtype: str, device: torch.device) -> None:
    """Forward-pass autocast entered inside `module`'s forward (hooks on it), for a model a DeepSpeed
    engine calls: on CUDA the engine turns off a torch.autocast entered around its forward unless its
    config's `torch_autocast` section is on — measured on an H200: gaeq's bf16 and fp16 DeepSpeed
    cells computed in float32, caught by their label check. (On a CPU it leaves the CPU's autocast alone.)
    Inside, the cell autocasts exactly as the torch trainer does; nothing where `dtype` does not autocast."""
    if dtype not in AUTOCAST:
        return
    entered: list[contextlib.AbstractContextManager] = []

    def enter(module, args) -> None:
        entered.append(autocast(dtype, device))
        entered[-1].__enter__()

    def leave(module, args, output) -> None:
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def inject_fault(cell: Cell, *, rank: int, step: int) -> None:
    """Test knob (matrix `fault:`): make this rank fail at the start of `step`."""
    fault = cell.fault
    if fault is None or fault.rank != rank or fault.step != step:
        return
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raises at step {step}")
    if fault.kind == "exit":
        os._exit(17)
    if fault.kind == "crash":
        import ctypes

        ctypes.string_at(0)  # SIGSEGV, as a bug in a library's native code dies
    if fault.kind == "oom":
        torch.empty(1 << 60, dtype=torch.uint8)  # torch's allocator fails for real, as past a device's memory
    while True:  # "hang": a rank that never answers again
        time.sleep(3600)
