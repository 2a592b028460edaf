"""A user's DDP script with two optimizers a step, the usual Muon set-up (written here, in the style of
torch.optim.Muon's docs): torch's Muon for the hidden matrices, AdamW for the biases and the output layer;
no_sync and loss ÷ GA; both stepped once per optimizer step. --bug adamw_every_micro_batch steps the AdamW
after every micro-batch (its parameters then move GA times a step, each on one micro-batch's gradient)."""

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
parser.add_argument("--bug", default="none", choices=["none", "adamw_every_micro_batch"])
args = parser.parse_args()

ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if ddp:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)

torch.manual_seed(0)  # the same weights on every rank
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
net = DDP(model) if ddp else model
hidden = [p for name, p in model.named_parameters() if p.ndim == 2 and not name.startswith("4.")]
rest = [p for name, p in model.named_parameters() if p.ndim != 2 or name.startswith("4.")]
muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01, momentum=0.95)
adamw = torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01)

data = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(8192, 16, generator=data), torch.randn(8192, 4, generator=data)
batch = args.batch_size * args.grad_accum * world  # samples per optimizer step, over every rank

for step in range(args.max_steps):
    for k in range(args.grad_accum):
        start = step * batch + (k * world + rank) * args.batch_size  # this rank's share of the step's samples
        x, y = inputs[start : start + args.batch_size], targets[start : start + args.batch_size]
        boundary = k == args.grad_accum - 1
        with contextlib.nullcontext() if boundary or not ddp else net.no_sync():
            loss = F.mse_loss(net(x), y) / args.grad_accum
            loss.backward()
        if args.bug == "adamw_every_micro_batch" and not boundary:
            adamw.step()  # the mistake: the AdamW half stepped on a partial sum, every micro-batch
            adamw.zero_grad(set_to_none=True)
    muon.step()
    adamw.step()
    muon.zero_grad(set_to_none=True)
    adamw.zero_grad(set_to_none=True)

if ddp:
    dist.barrier()
    dist.destroy_process_group()
