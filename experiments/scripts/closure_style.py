"""A training loop in PyTorch Lightning's shape, written with torch alone: the module receives its batch
as a list, `training_step([x, y], batch_idx)` through its forward (as Lightning's DDP wrapper calls it);
under gradient accumulation the micro-batches before the boundary run their forward and backward outside
the optimizer, and the last one inside `optimizer.step(closure)` — Lightning's automatic optimisation with
`accumulate_grad_batches`. DDP, loss ÷ GA, no_sync before the boundary, clipping in the closure after
the backward (where Lightning clips). --bug zero_grad_in_closure zeroes the gradients at the start of the
closure, as a closure written for GA 1 does: every micro-batch but the last is thrown away."""

import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="micro batch per rank")
parser.add_argument("--accumulate_grad_batches", type=int, default=4)
parser.add_argument("--max_steps", type=int, default=10)
parser.add_argument("--bug", default="none", choices=["none", "zero_grad_in_closure"])
args = parser.parse_args()

ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if ddp:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)


class Regressor(nn.Module):
    """A LightningModule's shape: forward is its training_step, on a batch given as a list."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)


torch.manual_seed(0)  # the same weights on every rank
module = Regressor()
model = DDP(module) if ddp else module
optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)

data = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(8192, 16, generator=data), torch.randn(8192, 4, generator=data)
batch = args.batch_size * args.accumulate_grad_batches * world  # samples per optimizer step, over every rank


def micro_batch(step, k):
    start = step * batch + (k * world + rank) * args.batch_size  # this rank's share of the step's samples
    return [inputs[start : start + args.batch_size], targets[start : start + args.batch_size]]


def forward_backward(step, k):
    loss = model(micro_batch(step, k), k) / args.accumulate_grad_batches
    loss.backward()
    return loss


for step in range(args.max_steps):
    last = args.accumulate_grad_batches - 1
    for k in range(last):  # before the boundary: outside the optimizer, gradients kept on each rank
        with model.no_sync() if ddp else contextlib.nullcontext():
            forward_backward(step, k)

    def closure():
        if args.bug == "zero_grad_in_closure":
            optimizer.zero_grad()  # the mistake: the micro-batches accumulated so far are dropped
        loss = forward_backward(step, last)  # the boundary's micro-batch, inside the step
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)  # Lightning clips after the closure's backward
        return loss

    optimizer.step(closure)
    optimizer.zero_grad(set_to_none=True)

if ddp:
    dist.barrier()
    dist.destroy_process_group()
