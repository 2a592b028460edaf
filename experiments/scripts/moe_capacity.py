"""Tiny next-token LM with a capacity-limited mixture of experts (Switch Transformer style), trained with
manual gradient accumulation + DDP (plain PyTorch), as ddp_manual.py trains its dense model.

    python moe_capacity.py --batch_size 32 --grad_accum 1 --max_steps 5
    torchrun --standalone --nproc_per_node 2 moe_capacity.py --batch_size 4 --grad_accum 4 --max_steps 5
    python moe_capacity.py --capacity_factor 0      # no capacity: every token reaches its expert

Each forward routes every token to one expert (top-1); an expert takes at most capacity_factor × the
forward's tokens / experts of them, in the order they come — the rest pass by on the residual alone. So a
token's output depends on which other tokens share its forward and on their order: the model's output
depends on the order of its rows, and a split of the batch into micro-batches changes which tokens are
dropped. Global batch = batch_size * grad_accum * world_size.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="micro batch per rank")
parser.add_argument("--grad_accum", type=int, default=4, help="accumulation steps per rank")
parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--experts", type=int, default=4)
parser.add_argument(
    "--capacity_factor", type=float, default=1.0, help="tokens an expert takes per forward, × fair share; 0: all"
)
args = parser.parse_args()

rank = int(os.environ.get("RANK", 0))
world = int(os.environ.get("WORLD_SIZE", 1))
ddp = world > 1
if ddp:
    dist.init_process_group("gloo")
torch.set_num_threads(1)

VOCAB, LEN, N, D = 32, 16, 4096, 32


class Sequences(Dataset):
    """Modular arithmetic sequences with 10% noise; item i is a pure function of (seed, i)."""

    def __init__(self, n, seed):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start, stride = torch.randint(1, VOCAB, (1,), generator=g), torch.randint(1, 4, (1,), generator=g)
        toks = (start + stride * torch.arange(LEN + 1)) % VOCAB
        noise = torch.rand(LEN + 1, generator=g) < 0.1
        toks = torch.where(noise, torch.randint(0, VOCAB, (LEN + 1,), generator=g), toks)
        return toks[:-1], toks[1:]


class CapacityMoE(nn.Module):
    """Top-1 routing; each expert takes at most `capacity` of the forward's tokens, first come first served."""

    def __init__(self, d, experts, capacity_factor):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(experts)
        )
        self.capacity_factor = capacity_factor

    def forward(self, h):
        flat = h.reshape(-1, h.shape[-1])
        gates = self.router(flat).softmax(-1)
        weight, choice = gates.max(-1)
        fair_share = flat.shape[0] / len(self.experts)
        capacity = math.ceil(self.capacity_factor * fair_share) if self.capacity_factor else flat.shape[0]
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            taken = (choice == e).nonzero().flatten()[:capacity]  # in the order the tokens come
            out = out.index_add(0, taken, weight[taken, None] * expert(flat[taken]))
        return h + out.view_as(h)


class TinyMoELM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.moe = CapacityMoE(D, args.experts, args.capacity_factor)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        return self.head(self.moe(self.emb(x)))


dataset = Sequences(N, args.seed)
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
loader = iter(DataLoader(dataset, batch_size=args.batch_size, sampler=sampler))

torch.manual_seed(args.seed)
model = TinyMoELM()
if ddp:
    model = DDP(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

for step in range(args.max_steps):
    micro_batches = [next(loader) for _ in range(args.grad_accum)]
    tokens = sum(y.numel() for _, y in micro_batches) * world  # every sequence has LEN targets
    for micro_step, (x, y) in enumerate(micro_batches):
        if ddp:
            model.require_backward_grad_sync = micro_step == args.grad_accum - 1
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), reduction="sum") / tokens * world
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

if dist.is_initialized():
    dist.barrier()
    dist.destroy_process_group()
