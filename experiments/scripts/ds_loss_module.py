"""Small image classifier trained with DeepSpeed, in the style of DeepSpeed's CIFAR-10 tutorial.

    torchrun --standalone --nproc_per_node 2 ds_loss_module.py --deepspeed_config ds_loss_module.json
    python ds_loss_module.py --deepspeed_config ds_loss_module.json

CPU only (gloo; the `deepspeed` launcher wants GPUs to count, so use torchrun or plain python here). The batch
sizes live in the DeepSpeed config (train_batch_size = micro * GA * world); engine.backward and engine.step
run on every micro-batch and DeepSpeed does the accumulation. --bug injects a common mistake.
"""

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

parser = argparse.ArgumentParser(description="tiny CIFAR-like classifier")
parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed by the deepspeed launcher")
parser.add_argument("--max_steps", type=int, default=20, help="optimizer steps to run")
parser.add_argument("--seed", type=int, default=1234)
parser.add_argument("--bug", default="none", choices=["none", "no_distributed_sampler", "criterion_sum"])
parser = deepspeed.add_config_arguments(parser)  # adds --deepspeed and --deepspeed_config
args = parser.parse_args()

torch.set_num_threads(1)
if "RANK" not in os.environ:  # plain `python`: a one-process group (deepspeed would otherwise look for MPI)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 20000))
deepspeed.init_distributed()  # the CPU accelerator picks gloo
rank, world = dist.get_rank(), dist.get_world_size()

# ---- data: 4096 random 3x8x8 "images"; the label is which of 10 fixed templates each one matches best ----
N_SAMPLES, N_CLASSES = 4096, 10
g = torch.Generator().manual_seed(0)  # the dataset itself is fixed, whatever --seed says
images = torch.randn(N_SAMPLES, 3, 8, 8, generator=g)
templates = torch.randn(N_CLASSES, 3 * 8 * 8, generator=g)
labels = (images.flatten(1) @ templates.T).argmax(dim=1)
trainset = TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(16 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, N_CLASSES)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))  # 8x4x4
        x = self.pool(torch.relu(self.conv2(x)))  # 16x2x2
        x = torch.flatten(x, 1)
        return self.fc2(torch.relu(self.fc1(x)))


torch.manual_seed(args.seed)  # same initial weights on every rank
net = Net()
model_engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters())
micro_bs = model_engine.train_micro_batch_size_per_gpu()
ga = model_engine.gradient_accumulation_steps()

if args.bug == "no_distributed_sampler":
    # BUG: shuffled with a seeded generator but no DistributedSampler -> every rank gets the same batches,
    # so at world 2 the global batch is half duplicates (a classic with hand-written DataLoaders)
    sampler = None
    trainloader = DataLoader(
        trainset, batch_size=micro_bs, shuffle=True, generator=torch.Generator().manual_seed(args.seed)
    )
else:
    sampler = DistributedSampler(trainset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    trainloader = DataLoader(trainset, batch_size=micro_bs, sampler=sampler)

if args.bug == "criterion_sum":
    criterion = nn.CrossEntropyLoss(reduction="sum")  # BUG: loss (and gradient) grow with the micro batch
else:
    criterion = nn.CrossEntropyLoss()  # a mean over the micro batch: every sample weighs the same

step, micro_step, running_loss = 0, 0, 0.0
epoch = 0
while step < args.max_steps:
    if sampler is not None:
        sampler.set_epoch(epoch)
    for inputs, targets in trainloader:
        outputs = model_engine(inputs)
        loss = criterion(outputs, targets)
        model_engine.backward(loss)  # scales by 1/GA; gradients are reduced across ranks at the boundary
        model_engine.step()  # clipping + optimizer + scheduler at the boundary only
        running_loss += loss.item()
        micro_step += 1
        if micro_step % ga == 0:  # an optimizer step just happened
            step_loss = torch.tensor(running_loss / ga)
            dist.all_reduce(step_loss)  # mean over ranks = the global batch's mean loss
            if rank == 0:
                print(f"step {step} loss {step_loss.item() / world:.6f}", flush=True)
            running_loss = 0.0
            step += 1
            if step == args.max_steps:
                break
    epoch += 1

dist.barrier()
dist.destroy_process_group()
