"""A LightningModule trained by Lightning's own Trainer, in the style of Lightning's examples: the batch a
list (`training_step(batch, batch_idx)`), `accumulate_grad_batches`, gradient clipping, and the DDP strategy
on more than one device — the loop, the accumulation, the sampler and the clipping are Lightning's.

    python lightning_regressor.py --batch_size 32 --accumulate_grad_batches 1 --max_steps 5
    torchrun --standalone --nproc_per_node 2 lightning_regressor.py --batch_size 4 --accumulate_grad_batches 4
"""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=8, help="micro batch per device")
parser.add_argument("--accumulate_grad_batches", type=int, default=1)
parser.add_argument("--max_steps", type=int, default=5)
parser.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
args = parser.parse_args()


class LitRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


L.seed_everything(0)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(8192, 16, generator=g), torch.randn(8192, 4, generator=g))
trainer = L.Trainer(
    accelerator="cpu",
    devices=args.devices,
    strategy="ddp" if args.devices > 1 else "auto",
    accumulate_grad_batches=args.accumulate_grad_batches,
    max_steps=args.max_steps,
    gradient_clip_val=1.0,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(LitRegressor(), DataLoader(data, batch_size=args.batch_size, shuffle=False))
