"""A user's DDP script driven by a config file, as picotron, torchtitan, axolotl and LLaMA-Factory are:
everything about the split — micro-batch, accumulation, steps — is read from a JSON config
(config_driven.json), and the command line only says where it is. Manual accumulation: no_sync, loss ÷ GA.
--bug loss_not_divided forgets ÷ GA (the accumulated gradient is GA times the mean's)."""

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True, help="the training config (JSON)")
parser.add_argument("--bug", default="none", choices=["none", "loss_not_divided"])
args = parser.parse_args()
with open(args.config) as f:
    config = json.load(f)
training, opt = config["training"], config["optimizer"]
micro, accum = training["micro_batch_size"], training["gradient_accumulation_steps"]

ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
if ddp:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)

torch.manual_seed(training["seed"])  # the same weights on every rank
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
net = DDP(model) if ddp else model
optimizer = torch.optim.AdamW(model.parameters(), lr=opt["learning_rate"], weight_decay=opt["weight_decay"])

data = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(8192, 16, generator=data), torch.randn(8192, 4, generator=data)
batch = micro * accum * world  # samples per optimizer step, over every rank

for step in range(training["total_train_steps"]):
    for k in range(accum):
        start = step * batch + (k * world + rank) * micro  # this rank's share of the step's samples
        x, y = inputs[start : start + micro], targets[start : start + micro]
        with contextlib.nullcontext() if k == accum - 1 or not ddp else net.no_sync():
            loss = F.mse_loss(net(x), y)
            (loss if args.bug == "loss_not_divided" else loss / accum).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

if ddp:
    dist.barrier()
    dist.destroy_process_group()
