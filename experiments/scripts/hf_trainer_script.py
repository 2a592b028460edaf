"""Tiny causal-LM training script with the Hugging Face transformers Trainer doing the gradient accumulation.

    python hf_trainer_script.py --batch_size 32 --grad_accum 1 --max_steps 5
    torchrun --standalone --nproc_per_node 2 hf_trainer_script.py --batch_size 4 --grad_accum 4 --max_steps 5

CPU only (gloo). Global batch = batch_size * grad_accum * world_size. --bug injects a common mistake.
"""

import argparse
import os
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # transformers imports deepspeed: skip its stdout auto-detect warning

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)
from transformers.utils import logging as hf_logging

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="micro batch per rank")
parser.add_argument("--grad_accum", type=int, default=4, help="accumulation steps per rank")
parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--bug", default="none", choices=["none", "model_without_loss_kwargs", "tokens_per_device"])
args = parser.parse_args()
torch.set_num_threads(1)
hf_logging.set_verbosity_error()  # keep stdout to our one line per step

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
        # HF convention: labels = input_ids (the model shifts them), -100 on padding -> length-1 targets per row
        input_ids = torch.zeros(MAX_LEN, dtype=torch.long)  # pad token 0
        labels = torch.full((MAX_LEN,), -100, dtype=torch.long)
        attention_mask = torch.zeros(MAX_LEN, dtype=torch.long)
        input_ids[:length], labels[:length], attention_mask[:length] = toks, toks, 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


config = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    attention_dropout=0.0,
    pad_token_id=0,
)
torch.manual_seed(args.seed)  # same init on every rank and every split
model = LlamaForCausalLM(config)


class PrintLoss(TrainerCallback):
    """One line per optimizer step on rank 0 (the Trainer's logged loss is already gathered over ranks)."""

    def on_log(self, args_, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step - 1} loss {logs['loss']:.6f}", flush=True)


average_tokens = True
if args.bug == "tokens_per_device":
    average_tokens = False  # BUG (transformers#34373): each rank normalises by its own token count

training_args = TrainingArguments(
    output_dir=os.path.join(tempfile.gettempdir(), "gaeq_hf_trainer"),
    per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.grad_accum,
    max_steps=args.max_steps,
    learning_rate=3e-3,
    weight_decay=0.01,
    adam_beta1=0.9,
    adam_beta2=0.95,
    lr_scheduler_type="constant_with_warmup",
    warmup_steps=2,
    max_grad_norm=0.3,
    seed=args.seed,
    data_seed=args.seed,  # shuffle order = one permutation from this seed, whatever the split
    use_cpu=True,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    dataloader_num_workers=0,
    ddp_find_unused_parameters=False,  # the default (True) only adds a per-step DDP warning
    average_tokens_across_devices=average_tokens,
)

trainer = Trainer(
    model=model,
    args=training_args,
    train_dataset=SyntheticSeqs(N, args.seed),
    data_collator=default_data_collator,
    callbacks=[PrintLoss()],
)
trainer.remove_callback(PrinterCallback)  # disable_tqdm=True would print the raw logs dict too
if args.bug == "model_without_loss_kwargs":
    trainer.model_accepts_loss_kwargs = False  # BUG (transformers#34242): micro-batch mean / GA, no num_items_in_batch

trainer.train()

trainer.accelerator.wait_for_everyone()  # let every rank finish before tearing gloo down
trainer.accelerator.end_training()  # destroys the process group
