"""Tiny next-token training with FSDP2 in torchtitan's style (plain PyTorch).

    python fsdp2_loop.py --batch_size 32 --grad_accum 1 --max_steps 5
    torchrun --standalone --nproc_per_node 2 fsdp2_loop.py --batch_size 4 --grad_accum 4 --max_steps 5

`fully_shard` on each block and on the root (parameters and gradients are DTensors sharded over the ranks;
HSDP with --replicas, bf16 compute with --mixed_precision), gradient sync (FSDP2's reduce-scatter) on the
last micro-batch only, each block's activations recomputed in the backward (activation checkpointing), and
the clipping norm of the whole model taken as torchtitan takes it: ``get_total_norm`` of the sharded
gradients, made whole, then ``clip_grads_with_norm_``. On a GPU where there is one (nccl), else on the CPU
(gloo). Global batch = batch_size * grad_accum * world_size. --bug injects a mistake FSDP2 users make.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="micro batch per rank")
parser.add_argument("--grad_accum", type=int, default=4, help="accumulation steps per rank")
parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 = off")
parser.add_argument("--layers", type=int, default=2)
parser.add_argument("--mixed_precision", action="store_true", help="bf16 compute, float32 gradient reduction")
parser.add_argument("--replicas", type=int, default=1, help="HSDP: replicas of the model, each sharded over the rest")
parser.add_argument(
    "--bug",
    default="none",
    choices=[
        "none",
        "loss_not_scaled_for_reduction",  # FSDP2 averages the ranks' gradients: the loss must be x world
        "clip_norm_of_local_shards",  # each rank clips by the norm of its own shards
        "clip_by_hand_per_shard",  # --clip_by_hand without its all-reduce: each rank's own shards again
    ],
)
parser.add_argument("--clip_by_hand", action="store_true", help="the clip written out, as Megatron-style loops do")
parser.add_argument(
    "--clip_as",
    default="torchtitan",
    choices=["torchtitan", "megatron"],
    help="--clip_by_hand's style: every shard × min(1, max / norm); or, as Megatron-LM, only where it clips, "
    "written through .data (its fused kernel moves no version counter)",
)
args = parser.parse_args()
if args.clip_by_hand and args.replicas > 1:
    parser.error("--clip_by_hand sums the norm over every rank: with --replicas each shard would count twice")

rank = int(os.environ.get("RANK", 0))
world = int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
cuda = torch.cuda.is_available()
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
if not dist.is_initialized():  # FSDP2 needs a process group, one process too
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if cuda else "gloo")
torch.set_num_threads(1)

VOCAB, MAX_LEN, N = 32, 24, 4096


class SyntheticSeqs(Dataset):
    """Variable-length (4..24) modular arithmetic sequences; item i is a pure function of (seed, i)."""

    def __init__(self, n, seed):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        length = int(torch.randint(4, MAX_LEN + 1, (1,), generator=g))
        start = torch.randint(1, VOCAB, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        toks = (start + stride * torch.arange(length)) % VOCAB
        x = torch.zeros(MAX_LEN - 1, dtype=torch.long)
        y = torch.full((MAX_LEN - 1,), -100, dtype=torch.long)
        x[: length - 1], y[: length - 1] = toks[:-1], toks[1:]
        return x, y


dataset = SyntheticSeqs(N, args.seed)
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=False)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class TinyLM(nn.Module):
    def __init__(self, d=32, layers=2):
        super().__init__()
        self.emb_cur, self.emb_prev = nn.Embedding(VOCAB, d), nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        h = self.emb_cur(x) + self.emb_prev(F.pad(x[:, :-1], (1, 0)))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)  # activations recomputed in the backward
        return self.head(h)


torch.manual_seed(args.seed)  # the same init on every rank and every split
model = TinyLM(layers=args.layers).to(device)
mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mixed_precision else None
sharding = {"mesh": mesh if args.replicas > 1 else None, **({"mp_policy": policy} if policy else {})}
for block in model.blocks:
    fully_shard(block, **sharding)
fully_shard(model, **sharding)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
it = iter(loader)

for step in range(args.max_steps):
    micro_batches = [tuple(t.to(device) for t in next(it)) for _ in range(args.grad_accum)]
    n_tokens = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)), device=device)
    dist.all_reduce(n_tokens)  # valid tokens of the whole global batch
    scale = world  # x world: FSDP2's reduce-scatter (and HSDP's all-reduce) average the ranks' gradients
    if args.bug == "loss_not_scaled_for_reduction":
        scale = 1  # BUG: the global count, then FSDP2 averages again -> gradient / world
    logged = torch.zeros((), device=device)
    for micro_step, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(micro_step == args.grad_accum - 1)  # reduce-scatter on the last only
        logits = model(x).float()
        loss_sum = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-100, reduction="sum")
        (loss_sum / n_tokens * scale).backward()
        logged += loss_sum.detach() / n_tokens
    if args.clip > 0 and args.clip_by_hand:  # clip_grad_norm_'s arithmetic on this rank's shards, written out
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        squares = torch.stack([torch.linalg.vector_norm(g) for g in grads]).pow(2).sum()
        if args.bug != "clip_by_hand_per_shard":
            dist.all_reduce(squares)  # each rank holds its own shards: the whole model's squared norm is their sum
        coefficient = torch.clamp(args.clip / (squares.sqrt() + 1e-6), max=1.0)
        for g in grads:
            if args.clip_as == "torchtitan":
                g.mul_(coefficient)  # in place on the shard: the DTensor's gradient is scaled with it
            elif coefficient < 1.0:
                g.data.mul_(coefficient)  # Megatron-LM's: only where it clips
    elif args.clip > 0:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if args.bug == "clip_norm_of_local_shards":
            grads = [g.to_local() for g in grads]  # BUG: this rank's shards only
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm  # the whole model's norm
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.clip, norm)
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(logged)  # the global batch's token mean
    if rank == 0:
        print(f"step {step} loss {logged.item():.6f}", flush=True)

dist.barrier()
dist.destroy_process_group()
