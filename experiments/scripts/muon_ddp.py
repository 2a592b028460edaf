"""A user's DDP training script with torch's Muon (written here, in the style of torch.optim.Muon's docs):
a bias-free MLP regressor, so every parameter is a matrix Muon takes; DDP; accumulation with no_sync and
loss ÷ GA; one Muon step per optimizer step. --bug step_every_micro_batch steps the optimizer after every
micro-batch (Muon then orthogonalises each micro-batch's gradient: per-micro-batch accumulation)."""

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
parser.add_argument("--grad_accum", type=int, default=4)
parser.add_argument("--max_steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.02)
parser.add_argument("--bug", default="none", choices=["none", "step_every_micro_batch"])
args = parser.parse_args()

ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if ddp:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)

torch.manual_seed(0)  # the same weights on every rank
model = nn.Sequential(
    nn.Linear(16, 64, bias=False), nn.Tanh(), nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 4, bias=False)
)
net = DDP(model) if ddp else model
optimizer = torch.optim.Muon(model.parameters(), lr=args.lr, weight_decay=0.01, momentum=0.95)

data = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(8192, 16, generator=data), torch.randn(8192, 4, generator=data)
batch = args.batch_size * args.grad_accum * world  # samples per optimizer step, over every rank

for step in range(args.max_steps):
    for k in range(args.grad_accum):
        start = step * batch + (k * world + rank) * args.batch_size  # this rank's share of the step's samples
        x, y = inputs[start : start + args.batch_size], targets[start : start + args.batch_size]
        boundary = k == args.grad_accum - 1 or args.bug == "step_every_micro_batch"
        with contextlib.nullcontext() if boundary or not ddp else net.no_sync():
            loss = F.mse_loss(net(x), y) / args.grad_accum
            loss.backward()
        if args.bug == "step_every_micro_batch":
            optimizer.step()  # the mistake: each micro-batch's gradient orthogonalised and applied on its own
            optimizer.zero_grad(set_to_none=True)
    if args.bug == "none":
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
