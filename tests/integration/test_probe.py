"""The probe inside a script written as people write them (gaeq.script.probe), one process each:
a loss module called after the model, a collate that pads each batch to its longest with
``pad_sequence``, ``clip_grad_norm_`` on every micro-step, and a library-style wrapper that steps the
scheduler it wraps twice per call. Two splits of one batch see the same samples; the grad norm is the
boundary's; the script's scheduler calls are counted as it makes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gaeq.contract import ENV, PROBE_FILE
from tests.processes import new_tag, owned, spawn

pytestmark = pytest.mark.integration  # each test's script runs as a process of its own

SCRIPT = """
import json, sys
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

micro, ga = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
samples = [torch.randint(1, 16, (int(n),)) for n in torch.randint(2, 9, (32,))]


def collate(batch):  # each batch padded to its own longest, with the pad id 0
    return pad_sequence(batch, batch_first=True, padding_value=0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 3)

    def forward(self, ids):
        return self.out((self.emb(ids) * (ids != 0).unsqueeze(-1)).sum(1))


class Wrapper:  # a library's scheduler wrapper: one call of the script's steps the wrapped one twice
    def __init__(self, scheduler):
        self.scheduler = scheduler

    def step(self):
        for _ in range(2):
            self.scheduler.step()


model, criterion = Net(), nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = Wrapper(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)))
loader = torch.utils.data.DataLoader(samples, batch_size=micro, collate_fn=collate)
norms, it = [], iter(loader)
for step in range(2):
    for _ in range(ga):
        ids = next(it)
        loss = criterion(model(ids), ids[:, 0] % 3) / ga
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # every micro-step: the last is the boundary's
    norms.append(float(norm))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
json.dump(norms, open("norms.json", "w"))
"""


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """probe.json and the script's own boundary norms, for micro-batches of 16 (GA 1) and 4 (GA 4) —
    the two processes side by side."""
    splits, started = {16: 1, 4: 4}, {}
    with owned(new_tag()) as tag:
        for micro, ga in splits.items():
            where = tmp_path_factory.mktemp(f"mb{micro}")
            (where / "train.py").write_text(SCRIPT)
            env = os.environ | {ENV: json.dumps({"out": str(where), "steps": 3})}
            cmd = [sys.executable, "-m", "gaeq.script.attach", "train.py", str(micro), str(ga)]
            started[micro] = where, spawn(cmd, tag=tag, cwd=where, env=env, stderr=subprocess.PIPE, text=True)
        seen = {}
        for micro, (where, proc) in started.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            seen[micro] = json.loads((where / PROBE_FILE).read_text()), json.loads((where / "norms.json").read_text())
    return seen


def test_the_samples_are_the_models_inputs_without_their_padding(probed):
    """Not the loss module's inputs (logits, labels); one fingerprint per sample; the same in both splits."""
    (whole, _), (split, _) = probed[16], probed[4]
    for a, b in zip(whole["steps"], split["steps"]):
        assert len(a["samples"]) == len(b["samples"]) == 16
        assert a["samples"] == b["samples"] and a["exact"] and b["exact"]
    assert len(set(split["steps"][0]["lengths"])) > 1  # the split's micro-batches were padded to other lengths


def test_the_grad_norm_is_the_boundarys_whatever_the_script_clips_when(probed):
    for probe, norms in probed.values():
        assert [s["grad_norm"] for s in probe["steps"]] == pytest.approx(norms, rel=1e-6)
        assert [s["events"]["clip"] for s in probe["steps"]] == [len(probe["steps"][0]["rows"][0])] * 2


def test_a_wrappers_repeats_are_one_call_of_the_scripts_and_the_schedule_advances_are_counted(probed):
    probe, _ = probed[4]
    after_first = probe["steps"][1]["events"]
    assert after_first["scheduler"] == 1 and after_first["schedule_advanced"] == 2
    assert after_first["wrapper:__main__.Wrapper"] == 1


TWO_OPTIMIZERS = """
import json, sys
import torch
import torch.nn as nn

style, ga = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
G, D = nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
opt_g, opt_d = torch.optim.Adam(G.parameters(), lr=1e-3), torch.optim.SGD(D.parameters(), lr=1e-2)
noise, real = torch.randn(512, 4), torch.randn(512, 6)
bce = nn.BCEWithLogitsLoss()
norms = []


def sq(module):
    return sum(float(p.grad.double().square().sum()) for p in module.parameters() if p.grad is not None)


for step in range(10):  # the probe stops it after its steps
    rows = range(step * 8, step * 8 + 8)
    chunks = [list(rows)[k::ga] for k in range(ga)]
    if style == "gan":  # the discriminator after its own accumulation, then the generator after its own
        for idx in chunks:
            fake = G(noise[idx])
            loss_d = (bce(D(real[idx]), torch.ones(len(idx), 1)) + bce(D(fake.detach()), torch.zeros(len(idx), 1))) / ga
            loss_d.backward()
        norm_d = sq(D)
        opt_d.step()
        opt_d.zero_grad()
        for idx in chunks:
            loss_g = bce(D(G(noise[idx])), torch.ones(len(idx), 1)) / ga
            loss_g.backward()
        norms.append((norm_d + sq(G)) ** 0.5)
        json.dump(norms, open("norms.json", "w"))
        opt_g.step()
        opt_g.zero_grad()
        D.zero_grad()
    else:  # one accumulation, both optimizers stepped on it (Muon + AdamW's shape); "per_micro": Adam every micro-batch
        for idx in chunks:
            loss = bce(D(G(noise[idx])), torch.ones(len(idx), 1)) / ga
            loss.backward()
            if style == "per_micro":
                opt_g.step()
                opt_g.zero_grad()
        norms.append((sq(G) + sq(D)) ** 0.5)
        json.dump(norms, open("norms.json", "w"))
        if style != "per_micro":
            opt_g.step()
        opt_d.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
"""


@pytest.fixture(scope="module")
def two_optimizers(tmp_path_factory):
    """probe.json and the script's own norms: a GAN's pair (each optimizer after its own backward) at GA 1
    and 2, both stepped after one accumulation, and Adam stepped after every micro-batch."""
    runs, seen = {("gan", 1), ("gan", 2), ("pair", 2), ("per_micro", 2)}, {}
    with owned(new_tag()) as tag:
        started = {}
        for style, ga in runs:
            where = tmp_path_factory.mktemp(f"{style}{ga}")
            (where / "train.py").write_text(TWO_OPTIMIZERS)
            env = os.environ | {ENV: json.dumps({"out": str(where), "steps": 3})}
            cmd = [sys.executable, "-m", "gaeq.script.attach", "train.py", style, str(ga)]
            started[style, ga] = where, spawn(cmd, tag=tag, cwd=where, env=env, stderr=subprocess.PIPE, text=True)
        for key, (where, proc) in started.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            seen[key] = json.loads((where / PROBE_FILE).read_text()), json.loads((where / "norms.json").read_text())
    return seen


@pytest.mark.parametrize("ga", [1, 2])
def test_a_gans_pair_each_after_its_own_backward_is_one_training_step(two_optimizers, ga):
    """Three training steps recorded (the script stopped after them, not after one and a half), each with
    both optimizers' steps, each optimizer's accumulation, the sum of every loss handed to backward,
    and the norm of both gradients, each read at its own optimizer's step."""
    probe, norms = two_optimizers["gan", ga]
    assert probe["complete"] and len(probe["steps"]) == len(norms) == 3  # then stopped
    for step in probe["steps"]:
        assert step["events"]["optimizer_step"] == 2 and {"stepped:SGD", "stepped:Adam"} <= set(step["events"])
        assert step["phases"] == [[ga, ga]] and step["backward"] == [2 * ga]
        assert step["lr"] == 1e-2  # the first optimizer's (the discriminator's)
        assert step["rows"] == [[8 // ga] * (2 * ga)]  # the generator: its inputs, in both halves
    assert [s["grad_norm"] for s in probe["steps"]] == pytest.approx(norms[:3], rel=1e-9)
    other = two_optimizers["gan", 3 - ga][0]
    assert [s["objective"] for s in probe["steps"]] == pytest.approx([s["objective"] for s in other["steps"]], 1e-5)


def test_two_optimizers_after_one_accumulation_are_one_step_and_one_per_micro_batch_is_named(two_optimizers):
    pair, norms = two_optimizers["pair", 2]
    assert len(pair["steps"]) == 3 and all(s["phases"] == [[2]] for s in pair["steps"])
    assert [s["grad_norm"] for s in pair["steps"]] == pytest.approx(norms[:3], rel=1e-9)  # each gradient once
    assert all(s["events"]["optimizer_step"] == 2 for s in pair["steps"])
    per_micro, _ = two_optimizers["per_micro", 2]
    steps = per_micro["steps"]  # Adam's step after each micro-batch ends one; SGD's, after no backward, joins it
    assert [s["phases"] for s in steps] == [[[1]]] * 3
    assert [sorted(e for e in s["events"] if e.startswith("stepped:")) for s in steps] == [
        ["stepped:Adam"],
        ["stepped:Adam", "stepped:SGD"],
        ["stepped:Adam"],
    ]
