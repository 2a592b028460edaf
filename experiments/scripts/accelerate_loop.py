"""Tiny next-token training script with Hugging Face accelerate doing the gradient accumulation.

    python accelerate_loop.py --batch_size 32 --grad_accum 1 --max_steps 5
    torchrun --standalone --nproc_per_node 2 accelerate_loop.py --batch_size 4 --grad_accum 4 --max_steps 5

CPU only (gloo). Global batch = batch_size * grad_accum * world_size. --bug injects a common mistake.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="micro batch per rank")
parser.add_argument("--grad_accum", type=int, default=4, help="accumulation steps per rank")
parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--clip", type=float, default=0.3, help="max grad norm; 0 = off")
parser.add_argument("--bug", default="none", choices=["none", "loss_divided_twice", "scheduler_per_process"])
args = parser.parse_args()
torch.set_num_threads(1)

# = Accelerator(gradient_accumulation_steps=GA), but with sync_with_dataloader=False: we prefetch GA micro-batches,
# so the loader's "last batch" flag is up while the epoch's last group still accumulates and accelerate's default
# would then step the optimizer on every one of those micro-steps.
ga_plugin = GradientAccumulationPlugin(num_steps=args.grad_accum, sync_with_dataloader=False)
step_sched_with_opt = False  # we call scheduler.step() once per optimizer step ourselves
if args.bug == "scheduler_per_process":
    step_sched_with_opt = True  # BUG: accelerate's default -> prepared scheduler steps num_processes times per step
accelerator = Accelerator(
    cpu=True, gradient_accumulation_plugin=ga_plugin, step_scheduler_with_optimizer=step_sched_with_opt
)
world, master = accelerator.num_processes, accelerator.is_main_process

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


dataset = SyntheticSeqs(N, args.seed)
# accelerate's default sharding (split_batches=False) deals whole batch_size batches of ONE shuffled order
# round-robin over ranks, so an optimizer step always sees the next batch_size*GA*world samples of that order
dataloader = DataLoader(
    dataset, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(args.seed)
)

torch.manual_seed(args.seed)  # same init on every rank and every split
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95), foreach=False)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))  # 4-step warmup
model, optimizer, dataloader, scheduler = accelerator.prepare(model, optimizer, dataloader, scheduler)

it = iter(dataloader)


def next_batch():
    global it
    try:
        return next(it)
    except StopIteration:  # new epoch: the prepared loader reshuffles with its (rank-synchronised) generator
        it = iter(dataloader)
        return next(it)


for step in range(args.max_steps):
    # prefetch this step's micro-batches so the token count is known before any backward
    micro_batches = [next_batch() for _ in range(args.grad_accum)]
    n_local = torch.tensor(float(sum(int((y != -100).sum()) for _, y in micro_batches)))
    n_tokens = accelerator.reduce(n_local, "sum")  # valid tokens of the whole global batch
    # accelerator.backward divides by GA and DDP averages over ranks: undo both
    scale = world * args.grad_accum
    loss_accum = torch.zeros(())
    for x, y in micro_batches:
        with accelerator.accumulate(model):  # no_sync on all but the GA-th micro-step
            logits = model(x)
            loss_sum = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-100, reduction="sum")
            loss = loss_sum / n_tokens * scale
            if args.bug == "loss_divided_twice":
                loss = loss / args.grad_accum  # BUG (accelerate#3533): accelerator.backward divides by GA again
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                if args.clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        loss_accum += loss_sum.detach() / n_tokens  # this rank's share of the global mean loss
    loss_accum = accelerator.reduce(loss_accum, "sum")
    if master:
        print(f"step {step} loss {loss_accum.item():.6f}", flush=True)

accelerator.wait_for_everyone()  # let every rank finish before tearing gloo down
accelerator.end_training()  # destroys the process group
