"""Tiny next-token training script with DeepSpeed's engine doing the gradient accumulation.

    python deepspeed_engine.py --deepspeed_config ds_config.json --max_steps 5
    torchrun --standalone --nproc_per_node 2 deepspeed_engine.py --deepspeed_config ds_config.json --max_steps 5

CPU only (gloo). Batch sizes come from the config only: global batch = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * world_size (= train_batch_size). --bug injects a common mistake.
"""

import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config (batch sizes live here)")
parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher; unused")
parser.add_argument("--bug", default="none", choices=["none", "loss_divided_twice", "ga_one_in_config"])
args = parser.parse_args()

# ---- distributed setup (torchrun sets these; plain `python` = one process) ----
rank = int(os.environ.get("RANK", 0))
world = int(os.environ.get("WORLD_SIZE", 1))
if world > 1:
    deepspeed.init_distributed(dist_backend="gloo")
else:  # deepspeed.initialize always sets up torch.distributed: give it a 1-process env (else it tries MPI)
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
master = rank == 0
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
        noise = torch.rand(length, generator=g) < 0.1  # 10% random tokens so it isn't trivial
        toks = torch.where(noise, torch.randint(0, VOCAB, (length,), generator=g), toks)
        x = torch.zeros(MAX_LEN - 1, dtype=torch.long)  # pad token 0 in inputs
        y = torch.full((MAX_LEN - 1,), -100, dtype=torch.long)  # -100 = ignored in labels
        x[: length - 1], y[: length - 1] = toks[:-1], toks[1:]
        return x, y


class TinyLM(nn.Module):
    """Sees the current and previous token: embeddings -> MLP -> vocab logits."""

    def __init__(self, d=32, hidden=256):
        super().__init__()
        self.emb_cur = nn.Embedding(VOCAB, d)
        self.emb_prev = nn.Embedding(VOCAB, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d, hidden), nn.GELU(), nn.Linear(hidden, VOCAB))

    def forward(self, x):
        prev = F.pad(x[:, :-1], (1, 0), value=0)
        return self.mlp(torch.cat([self.emb_cur(x), self.emb_prev(prev)], dim=-1))


with open(args.deepspeed_config) as f:
    ds_config = json.load(f)
user_ga = ds_config["gradient_accumulation_steps"]  # micro-steps the loop below runs per optimizer step
if args.bug == "ga_one_in_config":
    # BUG (open-instruct#1498): engine told GA=1 -> every engine.backward is a boundary, optimizer steps each micro
    ds_config.update(
        gradient_accumulation_steps=1, train_batch_size=ds_config["train_micro_batch_size_per_gpu"] * world
    )

torch.manual_seed(args.seed)  # same init on every rank and every split
model = TinyLM()
engine, optimizer, _, scheduler = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=ds_config
)
micro, ga = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
if args.bug == "ga_one_in_config":
    ga = user_ga  # (same BUG) the script keeps looping its own GA micro-steps per "step"

dataset = SyntheticSeqs(N, args.seed)
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=False)
sampler.set_epoch(0)
loader = DataLoader(dataset, batch_size=micro, sampler=sampler)  # DataLoader batch = the engine's micro batch

epoch, it = 0, iter(loader)


def next_batch():
    global epoch, it
    try:
        return next(it)
    except StopIteration:
        epoch += 1
        sampler.set_epoch(epoch)
        it = iter(loader)
        return next(it)


for step in range(args.max_steps):
    # prefetch this step's micro-batches so the token count is known before any backward
    micro_batches = [next_batch() for _ in range(ga)]
    n_tokens = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)))
    if world > 1:
        dist.all_reduce(n_tokens, op=dist.ReduceOp.SUM)  # valid tokens of the whole global batch
    # engine.backward divides by GA and the ZeRO gradient reduce averages over ranks: undo both
    scale = world * ga
    loss_accum = torch.zeros(())
    for x, y in micro_batches:
        logits = engine(x)
        loss_sum = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-100, reduction="sum")
        loss = loss_sum / n_tokens * scale
        if args.bug == "loss_divided_twice":
            loss = loss / ga  # BUG: the user divides by GA too, DeepSpeed divides again -> gradient / GA
        engine.backward(loss)  # scales by 1/GA, accumulates; gradients are reduced only at the GA boundary
        engine.step()  # optimizer step + clipping + scheduler only at the boundary, no-op otherwise
        loss_accum += loss.detach() / scale  # this rank's share of the global mean loss
    if world > 1:
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)
    if master:
        print(f"step {step} loss {loss_accum.item():.6f}", flush=True)

if dist.is_initialized():
    dist.barrier()  # let every rank finish before tearing gloo down (else rare 'terminate called' aborts)
    dist.destroy_process_group()
