"""The objectives post-training recipes optimise, in one plain PyTorch loop with manual accumulation: a token
loss or a policy gradient, normalised over one window or another, the ranks' gradients combined by DDP or by hand
— and the mistakes each invites.

    python objectives.py --loss pg --norm completion --batch_size 16 --grad_accum 1 --max_steps 3
    torchrun --standalone --nproc_per_node 2 objectives.py --norm rescale --combine hand_sum --grad_accum 2

--loss:
  tokens  the cross-entropy of every completion token (every weight positive)
  pg      a policy gradient: −A · log π(token), A the completion's advantage, normalised within its prompt's group
          of 4 completions (about half negative); --kl β adds β × the k3 estimate of KL(π ‖ π_ref) per token, to the
          initial policy kept frozen (GRPO's)
--norm (each the same optimisation in every split):
  tokens      ÷ the step's completion tokens over every rank (DAPO, nanoGPT)
  completion  each completion's mean over its tokens, averaged over the step's completions (GRPO)
  constant    ÷ (the longest completion × the step's completions), a constant (Dr. GRPO)
  rescale     the summed loss at backward; after the last one every gradient × world ÷ the step's tokens
              (torchtune's recipe)
--combine: ddp (DDP averages the ranks' gradients), fsdp2 (FSDP2's fully_shard: its reduce-scatter averages them),
  hand_sum (no wrapper: each gradient all-reduced by SUM after the last backward), hand_mean (SUM, then ÷ world).
--bug (each in every split, as a user has it):
  micro_batch        ÷ each micro-batch's own tokens, ÷ GA (TRL's old per-micro-batch normaliser)
  rank               ÷ this rank's tokens of the step (its ranks' means averaged)
  ga_twice           ÷ the step's tokens, ÷ GA once more
  count_from_rank    --norm rescale with the step's tokens estimated from this rank's last micro-batch × GA × world
--cast bf16: the script casts its model to bf16 (`model.to(torch.bfloat16)`), the loss taken in float32;
  bf16_loss: the loss taken in bf16 too, from the bf16 logits.

Global batch = batch_size * grad_accum * world_size rows (a whole number of groups): each step's rows, a contiguous
share per rank cut into micro-batches in order. On the CPU with gloo.
"""

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--loss", default="pg", choices=["tokens", "pg"])
parser.add_argument("--norm", default="tokens", choices=["tokens", "completion", "constant", "rescale"])
parser.add_argument("--kl", type=float, default=0.0, help="β of the KL term to the frozen initial policy (pg)")
parser.add_argument("--combine", default="ddp", choices=["ddp", "fsdp2", "hand_sum", "hand_mean"])
parser.add_argument("--bug", default="none", choices=["none", "micro_batch", "rank", "ga_twice", "count_from_rank"])
parser.add_argument("--cast", default="none", choices=["none", "bf16", "bf16_loss"])
parser.add_argument("--batch_size", type=int, default=4, help="micro batch per rank")
parser.add_argument("--grad_accum", type=int, default=4, help="accumulation steps per rank")
parser.add_argument("--max_steps", type=int, default=3, help="optimizer steps")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--clip", type=float, default=1.0, help="max grad norm; 0 = off")
args = parser.parse_args()
if args.bug == "count_from_rank" and args.norm != "rescale":
    parser.error("--bug count_from_rank is a mistake of --norm rescale")

rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
if world > 1:
    dist.init_process_group("gloo")
torch.set_num_threads(1)

VOCAB, PROMPT, LONGEST, GROUP = 32, 4, 20, 4


def completion(i):
    """Row i: a prompt of its group's and a completion of 2..LONGEST tokens, its reward the share of tokens that
    follow the prompt's rule — a function of (seed, i) alone."""
    group = torch.Generator().manual_seed(args.seed * 1_000_003 + i // GROUP)
    start, stride = int(torch.randint(1, VOCAB, (1,), generator=group)), int(torch.randint(1, 4, (1,), generator=group))
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7_919 * i + 1)
    length = int(torch.randint(2, LONGEST + 1, (1,), generator=g))
    rule = (start + stride * torch.arange(PROMPT + length)) % VOCAB
    toks = torch.where(torch.rand(PROMPT + length, generator=g) < 0.4, torch.randint(0, VOCAB, (PROMPT + length,),
                       generator=g), rule)  # fmt: skip
    toks[:PROMPT] = rule[:PROMPT]
    reward = float((toks[PROMPT:] == rule[PROMPT:]).float().mean())
    x = torch.zeros(PROMPT + LONGEST - 1, dtype=torch.long)
    y = torch.full((PROMPT + LONGEST - 1,), -100, dtype=torch.long)  # only completion tokens are targets
    x[: PROMPT + length - 1] = toks[:-1]
    y[PROMPT - 1 : PROMPT + length - 1] = toks[PROMPT:]
    return x, y, reward


def advantages(rewards):
    """GRPO's: each reward less its group's mean, ÷ the group's std (+ 1e-4)."""
    r = torch.tensor(rewards).view(-1, GROUP)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


torch.manual_seed(args.seed)  # the same initial weights in every split
model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, VOCAB))
reference = copy.deepcopy(model).requires_grad_(False)  # the frozen initial policy of the KL term
if args.cast != "none":
    model.to(torch.bfloat16)  # the script trains its model in bf16
if world > 1 and args.combine == "ddp":
    model = DDP(model)
elif world > 1 and args.combine == "fsdp2":
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(model)  # its reduce-scatter averages the ranks' gradients
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=False)
averaged = world if args.combine != "hand_sum" else 1  # what the ranks' gradients are divided by


def summed(n):
    """A count summed over every rank: the step's, whatever the split."""
    n = torch.tensor(float(n))
    if world > 1:
        dist.all_reduce(n)
    return n


def micro_batches():
    """Each step's micro-batches on this rank: the step's global batch of whole groups in order, a contiguous share
    per rank, cut into micro-batches in order; each row with its advantage, computed over its group."""
    batch = args.batch_size * args.grad_accum * world
    for start in range(0, 1_000_000, batch):
        rows = [completion(i) for i in range(start, start + batch)]
        adv = advantages([r for _, _, r in rows])
        mine = torch.tensor_split(torch.arange(batch), world)[rank].tolist()
        yield [
            (torch.stack([rows[i][0] for i in part]), torch.stack([rows[i][1] for i in part]), adv[part])
            for part in (mine[k : k + args.batch_size] for k in range(0, len(mine), args.batch_size))
        ]


def per_token(x, y, adv):
    """Each target's loss, [rows, positions] (0 off the completion): −log π, × A for a policy gradient, + β k3."""
    logits = model(x)
    logits = logits if args.cast == "bf16_loss" else logits.float()  # the loss in float32, whatever the model's
    logp = logits.log_softmax(-1).gather(-1, y.clamp_min(0)[..., None])[..., 0]
    mask = y != -100
    loss = -logp if args.loss == "tokens" else -adv[:, None] * logp
    if args.loss == "pg" and args.kl:
        with torch.no_grad():
            ref = reference(x).float().log_softmax(-1).gather(-1, y.clamp_min(0)[..., None])[..., 0]
        loss = loss + args.kl * (torch.exp(ref - logp) - (ref - logp) - 1)  # k3, GRPO's KL estimate
    return torch.where(mask, loss, 0.0), mask


for step, batch in zip(range(args.max_steps), micro_batches()):
    tokens = summed(sum(int((y != -100).sum()) for _, y, _ in batch))  # the step's completion tokens, every rank
    rows = summed(sum(len(y) for _, y, _ in batch))  # and its completions
    mine = sum(int((y != -100).sum()) for _, y, _ in batch)  # this rank's tokens of the step
    for i, (x, y, adv) in enumerate(batch):
        if world > 1 and args.combine == "ddp":
            model.require_backward_grad_sync = i == len(batch) - 1  # DDP averages the ranks' gradients once
        elif world > 1 and args.combine == "fsdp2":
            model.set_requires_gradient_sync(i == len(batch) - 1)  # FSDP2 too
        losses, mask = per_token(x, y, adv)
        if args.norm == "tokens":
            loss = losses.sum() / tokens * averaged
        elif args.norm == "completion":
            loss = (losses.sum(1) / mask.sum(1)).sum() / rows * averaged
        elif args.norm == "constant":
            loss = losses.sum() / (LONGEST * rows) * averaged
        else:  # rescale: the summed loss, the gradients rescaled after the last backward
            loss = losses.sum()
        if args.bug == "micro_batch":
            loss = losses.sum() / mask.sum() / args.grad_accum  # BUG: each micro-batch's own token mean
        elif args.bug == "rank":
            loss = losses.sum() / mine * averaged / world  # BUG: ÷ this rank's tokens, not the step's
        elif args.bug == "ga_twice":
            loss = loss / args.grad_accum  # BUG: the step's mean, ÷ GA once more
        loss.backward()
    if world > 1 and args.combine.startswith("hand"):
        for p in model.parameters():  # the ranks' gradients combined by hand
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            if args.combine == "hand_mean":
                p.grad.div_(world)
    if args.norm == "rescale":
        count = tokens
        if args.bug == "count_from_rank":
            count = (batch[-1][1] != -100).sum() * args.grad_accum * world  # BUG: this rank's last micro-batch
        for p in model.parameters():
            p.grad.mul_(averaged / count)  # torchtune: every gradient × world ÷ the step's tokens
    if args.clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
