"""Tiny causal LM fine-tuned with the transformers Trainer on variable-length text, padded per batch.

    python trainer_padded.py --batch_size 8 --grad_accum 4 --max_steps 5
    torchrun --standalone --nproc_per_node 2 trainer_padded.py --batch_size 8 --grad_accum 2 --max_steps 5

CPU only (gloo). Global batch = batch_size * grad_accum * world size. Nothing is downloaded: the tokenizer
and the model are built in code. --padding_side left|right; --labels input_ids copies the ids into the
labels (TRL's language-modelling collator; the model's loss shifts them) instead of leaving <s> out;
--padding_free packs each micro-batch into one row (TRL's padding_free: transformers'
DataCollatorWithFlattening, --seq_idx with its seq_idx); --bug injects a common mistake.
"""

import argparse
import os
import random

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from torch.utils.data import Dataset
from transformers import (
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="per-device micro batch")
parser.add_argument("--grad_accum", type=int, default=4)
parser.add_argument("--max_steps", type=int, default=5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--padding_side", default="right", choices=["left", "right"])
parser.add_argument(
    "--labels", default="no_bos", choices=["no_bos", "input_ids"], help="labels: <s> left out, or a copy of the ids"
)
parser.add_argument(
    "--padding_free", action="store_true", help="pack each micro-batch into one row (TRL's padding_free)"
)
parser.add_argument("--seq_idx", action="store_true", help="the packing collator's seq_idx too (TRL passes it)")
parser.add_argument("--output_dir", default="trainer_padded_out")
parser.add_argument(
    "--bug",
    default="none",
    choices=["none", "model_without_loss_kwargs", "tokens_per_device", "bos_is_target", "position_ids_run_on"],
)
args = parser.parse_args()
torch.set_num_threads(1)

# ---- a word-level tokenizer over a made-up vocabulary ----
WORDS = [f"w{i}" for i in range(40)]
vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + WORDS)}
backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
)
tokenizer.padding_side = args.padding_side


class CountingText(Dataset):
    """'<s> w3 w5 w7 ... </s>': arithmetic walks over the words, 3 to 20 of them, 10% random words."""

    def __init__(self, n):
        self.texts = []
        rng = random.Random(0)  # fixed data, whatever --seed says
        for _ in range(n):
            start, stride, length = rng.randrange(40), rng.randint(1, 3), rng.randint(3, 20)
            words = [WORDS[(start + stride * i) % 40] for i in range(length)]
            words = [rng.choice(WORDS) if rng.random() < 0.1 else w for w in words]
            self.texts.append("<s> " + " ".join(words) + " </s>")

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        ids = tokenizer(self.texts[i])["input_ids"]
        if args.bug == "bos_is_target":
            # BUG: labels = input_ids. With left padding, <s> of every row shorter than the batch's longest is
            # "predicted" from a pad position: which rows those are depends on how the batch is split
            return {"input_ids": ids, "labels": list(ids)}
        if args.labels == "input_ids":  # TRL's collator: the model's loss shifts them, <s> is never predicted
            return {"input_ids": ids, "labels": list(ids)}  # (padded on the right: see bos_is_target)
        # <s> is never a target: with left padding the model would otherwise "predict" it from a pad position
        return {"input_ids": ids, "labels": [-100] + ids[1:]}


set_seed(args.seed)  # before the model is built: same init on every rank and split
config = LlamaConfig(
    vocab_size=len(vocab),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attention_dropout=0.0,
    pad_token_id=tokenizer.pad_token_id,
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
)
model = LlamaForCausalLM(config)

training_args = TrainingArguments(
    output_dir=args.output_dir,
    per_device_train_batch_size=args.batch_size,
    gradient_accumulation_steps=args.grad_accum,
    max_steps=args.max_steps,
    learning_rate=3e-3,
    weight_decay=0.01,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_epsilon=1e-8,
    optim="adamw_torch",
    lr_scheduler_type="linear",
    warmup_steps=0,
    max_grad_norm=1.0,
    seed=args.seed,
    data_seed=args.seed,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    use_cpu=True,
    dataloader_num_workers=0,
    # BUG (trl#3538, transformers#34373): each rank divides by its own token count, DDP averages the means
    average_tokens_across_devices=args.bug != "tokens_per_device",
)


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step - 1} loss {logs['loss']:.6f}", flush=True)


class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # BUG (transformers#34242): the model's own mean over this micro-batch's tokens, num_items_in_batch
        # ignored -> a mean of micro-batch means, and the Trainer no longer divides it by GA either
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class RunOnPositions(DataCollatorWithFlattening):
    """BUG: a packing collator whose position_ids count on across the row instead of restarting at each
    sequence: the model cannot tell where one ends, and every token attends to the sequences before it."""

    def __call__(self, features, *a, **kw):
        batch = super().__call__(features, *a, **kw)
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0)
        return batch


def collator():
    # padding_free: each micro-batch's sequences end to end in one row, position_ids restarting at each, no
    # attention mask (the model masks across sequences from the positions); else padded to the batch's longest
    if args.padding_free:
        packing = RunOnPositions if args.bug == "position_ids_run_on" else DataCollatorWithFlattening
        return packing(return_seq_idx=args.seq_idx)
    return DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)


trainer_cls = MyTrainer if args.bug == "model_without_loss_kwargs" else Trainer
trainer = trainer_cls(
    model=model,
    args=training_args,
    train_dataset=CountingText(4096),
    data_collator=collator(),
    callbacks=[PrintLoss()],
)
trainer.train()

if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
