"""The transformers Trainer's sequence parallelism through DeepSpeed (ALST/Ulysses, accelerate's
`ParallelismConfig(sp_size=2, sp_backend="deepspeed")`) against the same Trainer in one process, on the
same global batch: is it the same optimisation? A measurement of the pinned stack (transformers, accelerate,
DeepSpeed as installed) without gaeq: the independent witness of experiments/sequence_parallel.yaml's
`hf_deepspeed` cells, whose verdicts gaeq computes (docs/sequence-parallel.md).

    python benchmarks/trainer_sequence_parallel.py            # 4 runs of 4 steps, ~1 minute on 2 cores
    python benchmarks/trainer_sequence_parallel.py --tiny     # 2 runs of 2 steps, for the suite: numbers mean nothing

A Llama of 2 layers (hidden 32, 4 heads, sdpa), 64 samples of 32 tokens with 8–31 valid labels each (the
rest -100) and position_ids (Ulysses requires them), AdamW at a constant lr, clipping off (so the grad norm
the Trainer logs is the gradient's own), ZeRO-1, the batch of 8 split four ways: one process GA 1 and GA 2,
and sp 2 (world 2, dp 1) GA 1 and GA 2. Printed per step: the logged loss and grad norm of each, and each
against one process at GA 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = "tiny run (--tiny): the smallest sizes, to keep the code working — its numbers mean nothing"
SEQ, SAMPLES, BATCH = 32, 64, 8
RUNS = {"w1 GA 1": (1, 1), "w1 GA 2": (1, 2), "sp2 GA 1": (2, 1), "sp2 GA 2": (2, 2)}
"""name → (sp, GA): the global batch of 8 always, micro-batches of 8 ÷ GA on each rank."""
TINY_RUNS = ("w1 GA 1", "sp2 GA 2")
"""--tiny: the reference and one run of each other kind (a launch at sp 2, GA > 1) — every code path."""


def worker(sp: int, ga: int, steps: int, out: Path) -> None:
    """One Trainer run (on every rank of its launch); rank 0 writes each step's logged loss and grad norm."""
    import deepspeed
    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    deepspeed.init_distributed(dist_backend="gloo")  # on a CPU nothing else starts DeepSpeed's comm before Ulysses

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(1000 + i)
            ids = torch.randint(1, 64, (SEQ,), generator=g)
            labels = ids.clone()
            labels[int(torch.randint(8, SEQ, (1,), generator=g)) :] = -100  # valid labels differ per sample
            return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(SEQ)}

    class Log(TrainerCallback):
        rows: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.rows.append({"loss": float(logs["loss"]), "grad_norm": float(logs["grad_norm"])})

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation="sdpa")  # fmt: skip
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "steps_per_print": 2**31 - 1,
    }
    parallel = {}
    if sp > 1:
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ, sp_seq_length_is_variable=False,
                                                  sp_attn_implementation="sdpa")  # fmt: skip
        parallel["parallelism_config"] = ParallelismConfig(sp_size=sp, sp_backend="deepspeed", sp_handler=handler)
    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=BATCH // ga, gradient_accumulation_steps=ga,
        max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant", max_grad_norm=1e9, logging_steps=1,
        report_to=[], use_cpu=True, deepspeed=ds, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
        **parallel,
    )  # fmt: skip
    Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Data(), callbacks=[Log()]).train()
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "rows.json").write_text(json.dumps(Log.rows))


def launch(sp: int, ga: int, steps: int, out: Path) -> list[dict]:
    """A run as its user starts it: torchrun for sp 2, one process otherwise; its DeepSpeed segments freed."""
    from gaeq.runtime.dist import free_port
    from gaeq.runtime.shm import release_shm_buffers

    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    me = [str(Path(__file__).resolve()), "--worker", str(sp), str(ga), str(steps), str(out)]
    if sp > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(sp),
               "--master_addr", "127.0.0.1", "--master_port", str(port), *me]  # fmt: skip
    else:
        cmd, env = [sys.executable, *me], env | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                                 "MASTER_PORT": str(port)}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    release_shm_buffers(port=port)
    if proc.returncode != 0 or not (out / "rows.json").is_file():
        sys.exit(f"{cmd[-5:]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "rows.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sp, ga, steps, out = args.worker
        worker(int(sp), int(ga), int(steps), Path(out))
        from gaeq.runtime.worker import hard_exit

        hard_exit(0)  # a gloo or shm thread still joinable at interpreter exit aborts a finished rank (SIGABRT)
    if args.tiny:
        print(TINY, flush=True)
    steps = 2 if args.tiny else 4
    with tempfile.TemporaryDirectory() as folder:
        runs = {name: RUNS[name] for name in TINY_RUNS} if args.tiny else RUNS
        rows = {name: launch(sp, ga, steps, Path(folder) / name.replace(" ", "_")) for name, (sp, ga) in runs.items()}
    base = rows["w1 GA 1"]
    print("run        step  loss        Δloss vs w1 GA 1   grad norm   × w1 GA 1's")
    for name, trace in rows.items():
        for step, (r, b) in enumerate(zip(trace, base)):
            print(f"{name:9s}  {step:4d}  {r['loss']:.8f}  {r['loss'] - b['loss']:+.2e}          "
                  f"{r['grad_norm']:.6f}    {r['grad_norm'] / b['grad_norm']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
