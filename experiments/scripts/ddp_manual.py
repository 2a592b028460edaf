"""Tiny next-token training script with manual gradient accumulation + DDP (plain PyTorch).

    python ddp_manual.py --batch_size 32 --grad_accum 1 --max_steps 5
    torchrun --standalone --nproc_per_node 2 ddp_manual.py --batch_size 4 --grad_accum 4 --max_steps 5
    torchrun --standalone --nproc_per_node 2 ddp_manual.py --amp bf16     # the forward under bf16 autocast
    torchrun --standalone --nproc_per_node 2 ddp_manual.py --amp fp16 --init_scale 268435456  # + GradScaler

On a GPU where there is one (nccl, a device per local rank, as nanoGPT picks them), else on the CPU (gloo).
Global batch = batch_size * grad_accum * world_size. --bug injects a common mistake.
"""

import argparse
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
parser.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 = off")
parser.add_argument("--d_model", type=int, default=32, help="embedding width")
parser.add_argument("--hidden", type=int, default=256, help="MLP width (640 and 8192: 10.8 M parameters)")
parser.add_argument("--min_len", type=int, default=4, help="shortest sequence (23: every one 23 or 24 tokens long)")
parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: cuda where there is one")
parser.add_argument("--memory_mb", type=float, default=0, help="CPU: a device's memory for training, past the setup")
parser.add_argument("--compile", action="store_true", help="torch.compile the model before DDP wraps it (nanoGPT)")
parser.add_argument("--amp", default="none", choices=["none", "bf16", "fp16"], help="autocast the forward pass")
parser.add_argument(
    "--init_scale", type=float, default=2.0**16, help="fp16: GradScaler's first scale (2**28: the first steps overflow)"
)
parser.add_argument("--backoff", type=float, default=0.5, help="fp16: GradScaler's backoff_factor after an overflow")
parser.add_argument("--fused", action="store_true", help="AdamW(fused=True): one kernel, GradScaler's unscale inside")
parser.add_argument(
    "--clip_by_hand",
    default="never",
    choices=["never", "beyond_world_1"],
    help="clip by its own norm (torchtitan's way)",
)
parser.add_argument(
    "--bug",
    default="none",
    choices=[
        "none",
        "no_loss_division",
        "mean_of_means",
        "sampler_seeded_by_rank",
        "clip_every_micro_step",
        "token_count_averaged_twice",
        "clip_each_tensor_by_hand",
    ],
)
args = parser.parse_args()

# ---- distributed setup (torchrun sets these; plain `python` = one process) ----
rank = int(os.environ.get("RANK", 0))
world = int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
ddp = world > 1
cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
if ddp:
    dist.init_process_group("nccl" if cuda else "gloo")
master = rank == 0
torch.set_num_threads(1)

VOCAB, MAX_LEN, N = 32, 24, 4096


class SyntheticSeqs(Dataset):
    """Variable-length (min_len..24) modular arithmetic sequences; item i is a pure function of (seed, i)."""

    def __init__(self, n, seed, min_len=4):
        self.n, self.seed, self.min_len = n, seed, min_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        length = int(torch.randint(self.min_len, MAX_LEN + 1, (1,), generator=g))
        start = torch.randint(1, VOCAB, (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        toks = (start + stride * torch.arange(length)) % VOCAB
        noise = torch.rand(length, generator=g) < 0.1  # 10% random tokens so it isn't trivial
        toks = torch.where(noise, torch.randint(0, VOCAB, (length,), generator=g), toks)
        x = torch.zeros(MAX_LEN - 1, dtype=torch.long)  # pad token 0 in inputs
        y = torch.full((MAX_LEN - 1,), -100, dtype=torch.long)  # -100 = ignored in labels
        x[: length - 1], y[: length - 1] = toks[:-1], toks[1:]
        return x, y


dataset = SyntheticSeqs(N, args.seed, args.min_len)
sampler_seed = args.seed
if args.bug == "sampler_seeded_by_rank":
    sampler_seed = args.seed + rank  # BUG: each rank shuffles differently -> samples repeated/missing
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=sampler_seed, drop_last=False)
sampler.set_epoch(0)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)


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


torch.manual_seed(args.seed)  # same init on every rank and every split
model = TinyLM(args.d_model, args.hidden).to(device)
if args.compile:
    model = torch.compile(model)  # as nanoGPT: compiled first, then wrapped
if ddp:
    model = DDP(model, device_ids=[local_rank] if cuda else None)
optimizer = torch.optim.AdamW(
    model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95), foreach=False, fused=args.fused or None
)  # fused: the kernel unscales itself — GradScaler hands it the scale and whether to skip, and steps it every time
# mixed precision as nanoGPT writes it: the forward under autocast, fp16's loss scaled (its steps skipped on overflow)
amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
scaler = torch.amp.GradScaler(
    device.type, init_scale=args.init_scale, backoff_factor=args.backoff, enabled=args.amp == "fp16"
)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 2))  # 2-step warmup
if args.memory_mb:  # a device of that size: an allocation past it fails (torch's own error), as on a GPU
    import ctypes
    import resource

    ctypes.CDLL(None).mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: a tensor's memory given back when it is freed
    assert not cuda, "--memory_mb caps a CPU process (on a GPU: torch.cuda.set_per_process_memory_fraction)"
    in_use = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmData:")) * 1024
    resource.setrlimit(resource.RLIMIT_DATA, (in_use + int(args.memory_mb * 2**20), resource.RLIM_INFINITY))

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
    micro_batches = [tuple(t.to(device) for t in next_batch()) for _ in range(args.grad_accum)]
    n_tokens = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)), device=device)
    if ddp:
        dist.all_reduce(n_tokens, op=dist.ReduceOp.SUM)  # valid tokens of the whole global batch
    scale = world  # x world because DDP averages gradients over ranks
    if args.bug == "token_count_averaged_twice":
        scale = 1  # BUG: count already global, then DDP averages again -> gradient / world
    loss_accum = torch.zeros((), device=device)
    for micro_step, (x, y) in enumerate(micro_batches):
        if ddp:
            model.require_backward_grad_sync = micro_step == args.grad_accum - 1  # all-reduce only on last
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(x)
        loss_sum = F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1), ignore_index=-100, reduction="sum")
        loss = loss_sum / n_tokens * scale
        if args.bug == "no_loss_division":
            loss = loss_sum / (y != -100).sum()  # BUG: per-micro-batch mean and forgot / grad_accum
        if args.bug == "mean_of_means":
            loss = loss_sum / (y != -100).sum() / args.grad_accum  # BUG: every micro-batch weighs the same
        scaler.scale(loss).backward()
        if args.bug == "clip_every_micro_step" and args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # BUG: clips partial sums
        loss_accum += loss.detach()
    # log the global mean loss: sum of micro losses / world, summed over ranks
    loss_accum /= world
    if ddp:
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)
    if args.clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients (a no-op without fp16)
        if args.clip_by_hand == "beyond_world_1" and ddp:  # the same arithmetic as clip_grad_norm_, written out
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms = [torch.linalg.vector_norm(g) for g in grads]
            if args.bug == "clip_each_tensor_by_hand":
                norms = [[n] for n in norms]  # BUG: each tensor clipped by its own norm, not the total
            for g, n in zip(grads, norms if args.bug == "clip_each_tensor_by_hand" else [norms] * len(grads)):
                g.mul_(torch.clamp(args.clip / (torch.linalg.vector_norm(torch.stack(n)) + 1e-6), max=1.0))
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    scaler.step(optimizer)  # fp16: skipped when a gradient overflowed (inf/NaN), the scale then lowered
    scaler.update()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if master:
        print(f"step {step} loss {loss_accum.item():.6f}", flush=True)

if dist.is_initialized():
    dist.barrier()  # let every rank finish before tearing gloo down (else rare 'terminate called' aborts)
    dist.destroy_process_group()
