"""Tiny causal LM trained with accelerate on variable-length sequences (the run_clm_no_trainer.py loop).

    python accelerate_padded.py --batch_size 8 --grad_accum 4 --max_steps 5
    accelerate launch --multi_gpu --num_processes 2 accelerate_padded.py --batch_size 8 --grad_accum 2 --max_steps 5
    torchrun --standalone --nproc_per_node 2 accelerate_padded.py --batch_size 8 --grad_accum 2 --max_steps 5

CPU only (gloo; on a CPU-only box `accelerate launch --cpu --num_processes 2` starts ONE process, --multi_gpu
starts two). Global batch = batch_size * grad_accum * processes. Each batch is padded to its longest sequence,
so the loss is a sum over tokens divided by the valid tokens of the whole global batch.
"""

import argparse
import os
import random

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from transformers import Qwen2Config, Qwen2ForCausalLM, get_scheduler

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="per-process micro batch")
parser.add_argument("--grad_accum", type=int, default=4)
parser.add_argument("--max_steps", type=int, default=5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--bug", default="none", choices=["none", "mean_of_means", "scheduler_not_sized"])
args = parser.parse_args()
torch.set_num_threads(1)

PAD, BOS, VOCAB = 0, 1, 64
WARMUP = 1

# sync_with_dataloader=False: we pull a step's micro-batches ahead of time, so the dataloader's end must not
# decide where accumulation stops
accelerator = Accelerator(
    cpu=True,
    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.grad_accum, sync_with_dataloader=False),
)

# ---- data: 4096 sequences of 4..32 tokens, fixed whatever --seed says ----
rng = random.Random(0)
samples = []
for _ in range(4096):
    start, stride, length = rng.randrange(2, VOCAB), rng.randint(1, 5), rng.randint(3, 31)
    toks = [2 + (start + stride * i) % (VOCAB - 2) for i in range(length)]
    samples.append([BOS] + [rng.randrange(2, VOCAB) if rng.random() < 0.1 else t for t in toks])


def collate(batch):
    input_ids = pad_sequence([torch.tensor(s) for s in batch], batch_first=True, padding_value=PAD)
    attention_mask = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in batch], batch_first=True)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


train_dataloader = DataLoader(
    samples,
    batch_size=args.batch_size,
    shuffle=True,
    collate_fn=collate,
    generator=torch.Generator().manual_seed(args.seed),
)

set_seed(args.seed)  # same initial weights on every process
config = Qwen2Config(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
    pad_token_id=PAD,
    bos_token_id=BOS,
)
model = Qwen2ForCausalLM(config)

no_decay = ["bias", "norm.weight"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)

# a prepared scheduler steps once per process per optimizer step, so size it in those units
scale = 1 if args.bug == "scheduler_not_sized" else accelerator.num_processes  # BUG: lr runs ahead at world > 1
lr_scheduler = get_scheduler(
    "linear", optimizer, num_warmup_steps=WARMUP * scale, num_training_steps=args.max_steps * scale
)

model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader, lr_scheduler)
assert len(train_dataloader) >= args.max_steps * args.grad_accum, "dataset too small for --max_steps"

ga = accelerator.gradient_accumulation_steps
batches = iter(train_dataloader)
for step in range(args.max_steps):
    # this step's micro-batches up front: the token count must be known before the first backward
    micro_batches = [next(batches) for _ in range(ga)]
    n_tokens = sum((b["labels"][:, 1:] != -100).sum() for b in micro_batches)  # the model shifts labels
    n_tokens = accelerator.reduce(n_tokens, "sum")  # valid targets in the whole global batch

    total_loss = torch.zeros(())
    for batch in micro_batches:
        with accelerator.accumulate(model):
            if args.bug == "mean_of_means":
                outputs = model(**batch)
                loss = outputs.loss  # BUG: mean over this micro-batch's own tokens; short batches weigh too much
            else:
                outputs = model(**batch, num_items_in_batch=n_tokens)  # sum of token losses / n_tokens
                loss = outputs.loss * ga * accelerator.num_processes  # undo backward's / GA and DDP's mean
            total_loss += loss.detach() / ga
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

    step_loss = accelerator.reduce(total_loss, "mean")
    if accelerator.is_main_process:
        print(f"step {step} loss {step_loss.item():.6f}", flush=True)

accelerator.wait_for_everyone()
accelerator.end_training()  # destroys the process group
