"""The loss styles real codebases weigh their targets with on purpose, in one plain PyTorch DDP loop with manual
accumulation — and the mistake each style invites.

    python loss_styles.py --loss tokens --batch_size 16 --grad_accum 1 --max_steps 3
    torchrun --standalone --nproc_per_node 2 loss_styles.py --loss rescale --batch_size 4 --grad_accum 2

--loss (each the same optimisation in every split):
  tokens      the step's summed token loss ÷ its token count over every rank (nanoGPT, transformers)
  sequences   each row's mean over its own targets, averaged over the step's rows (GRPO's original normalisation)
  rescale     the summed token loss at backward, every gradient ÷ the step's token count before the optimizer
              step (Megatron-LM's calculate_per_token_loss, fairseq's sample_size)
  sum         the summed token loss, the learning rate set for it
  smoothing   tokens, with label smoothing 0.1

--bug (each in every split, as a user has it):
  count_from_one_micro_batch  rescale, the step's token count estimated as GA × its first micro-batch's
  sequences_per_micro_batch   sequences, each micro-batch's mean of row means ÷ GA: right while every micro-batch
                              is full, wrong in an epoch's short last step (--num_samples)
  mean_of_means               tokens, each micro-batch's own token mean ÷ GA

Global batch = batch_size * grad_accum * world_size: each step's rows, a contiguous share per rank cut into
micro-batches in order (Megatron-LM's sampler deals them so). --amp bf16 runs the forward under autocast, the logits
cast to float32 for the loss as usual. On the CPU with gloo (a GPU with nccl where there is one).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--loss", default="tokens", choices=["tokens", "sequences", "rescale", "sum", "smoothing"])
MISTAKE_OF = {
    "count_from_one_micro_batch": "rescale",
    "sequences_per_micro_batch": "sequences",
    "mean_of_means": "tokens",
}
parser.add_argument("--bug", default="none", choices=["none", *MISTAKE_OF])
parser.add_argument("--batch_size", type=int, default=4, help="micro batch per rank")
parser.add_argument("--grad_accum", type=int, default=4, help="accumulation steps per rank")
parser.add_argument("--max_steps", type=int, default=3, help="optimizer steps")
parser.add_argument(
    "--num_samples", type=int, default=4096, help="the dataset's rows (an epoch's last step may be short)"
)
parser.add_argument("--min_len", type=int, default=4, help="shortest sequence (22: micro-batches of nearly one size)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--lr", type=float, default=3e-3, help="the sum's is this ÷ 200 (about a step's targets)")
parser.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 = off")
parser.add_argument("--amp", default="none", choices=["none", "bf16"], help="autocast the forward pass")
args = parser.parse_args()
if args.bug != "none" and args.loss != MISTAKE_OF[args.bug]:
    parser.error(f"--bug {args.bug} is a mistake of another --loss")

rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
cuda = torch.cuda.is_available()
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
if world > 1:
    dist.init_process_group("nccl" if cuda else "gloo")
torch.set_num_threads(1)

VOCAB, MAX_LEN = 32, 24


def sequence(i):
    """Row i of the dataset: a modular sequence of min_len..24 tokens, a function of (seed, i) alone."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + i)
    length = int(torch.randint(args.min_len, MAX_LEN + 1, (1,), generator=g))
    toks = torch.randint(1, VOCAB, (1,), generator=g) + torch.randint(1, 4, (1,), generator=g) * torch.arange(length)
    toks = torch.where(
        torch.rand(length, generator=g) < 0.1, torch.randint(0, VOCAB, (length,), generator=g), toks % VOCAB
    )
    x = torch.zeros(MAX_LEN - 1, dtype=torch.long)  # input padding: token 0
    y = torch.full((MAX_LEN - 1,), -100, dtype=torch.long)  # label padding: ignored
    x[: length - 1], y[: length - 1] = toks[:-1], toks[1:]
    return x, y


torch.manual_seed(args.seed)  # the same initial weights in every split
model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, VOCAB)).to(device)
if world > 1:
    model = DDP(model)
lr = args.lr / 200 if args.loss == "sum" else args.lr  # a summed loss's gradient is ~200 × the mean's
optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)


def summed(n):
    """A count summed over every rank: the step's, whatever the split."""
    n = torch.tensor(float(n), device=device)
    if world > 1:
        dist.all_reduce(n)
    return n


def micro_batches():
    """Each step's micro-batches on this rank: the step's global batch (the epoch's shuffled rows, fewer in its
    last step), a contiguous share of it per rank, cut into micro-batches in order (the last may be short)."""
    batch = args.batch_size * args.grad_accum * world
    for epoch in range(1_000_000):
        order = torch.randperm(args.num_samples, generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
        for start in range(0, args.num_samples, batch):
            mine = torch.tensor_split(torch.tensor(order[start : start + batch]), world)[rank].tolist()
            rows = [sequence(i) for i in mine]
            yield [
                tuple(torch.stack(t).to(device) for t in zip(*rows[k : k + args.batch_size]))
                for k in range(0, len(rows), args.batch_size)
            ]


for step, batch in zip(range(args.max_steps), micro_batches()):
    targets = summed(sum(int((y != -100).sum()) for _, y in batch))  # the step's tokens over every rank
    rows = summed(sum(len(y) for _, y in batch))  # and its rows
    if args.bug == "count_from_one_micro_batch":
        targets = summed((batch[0][1] != -100).sum() * args.grad_accum)  # BUG: one micro-batch's count × GA
    for i, (x, y) in enumerate(batch):
        if world > 1:
            model.require_backward_grad_sync = i == len(batch) - 1  # DDP averages the ranks' gradients once
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            logits = model(x)
        per_token = F.cross_entropy(
            logits.float().transpose(1, 2),  # the loss in float32, whatever the forward's precision
            y,
            ignore_index=-100,
            reduction="none",
            label_smoothing=0.1 if args.loss == "smoothing" else 0.0,
        )
        if args.loss in ("tokens", "smoothing"):
            loss = per_token.sum() / targets * world  # × world: DDP averages the ranks' gradients
            if args.bug == "mean_of_means":
                loss = per_token.sum() / (y != -100).sum() / args.grad_accum  # BUG: each micro-batch's own mean
        elif args.loss == "sequences":
            row_means = per_token.sum(1) / (y != -100).sum(1)
            loss = row_means.sum() / rows * world
            if args.bug == "sequences_per_micro_batch":
                loss = row_means.mean() / args.grad_accum  # BUG: a short micro-batch's rows weigh more
        else:  # rescale, sum: the summed token loss
            loss = per_token.sum() * world
        loss.backward()
    if args.loss == "rescale":
        for p in model.parameters():
            p.grad.div_(targets)  # Megatron-LM, fairseq: every gradient ÷ the step's token count
    if args.clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

if world > 1:
    dist.barrier()
    dist.destroy_process_group()
