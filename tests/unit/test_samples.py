"""What identifies a sample in a script's model inputs (gaeq.script.samples): the same sample has the
same fingerprint whatever its neighbours padded it to, on either side — and where gaeq cannot tell
padding from data, it says so instead of fingerprinting as if it could."""

from __future__ import annotations

import torch

from gaeq.script.samples import SampleIdentity

SAMPLES = [[5, 6, 7], [8, 9, 10, 11, 12], [3]]


def padded(samples, *, to, pad=0, left=False, label_pad=-100):
    """A collator's batch: ids, mask and labels padded to `to` positions."""
    ids, mask, labels = [], [], []
    for s in samples:
        n = to - len(s)
        ids.append([pad] * n + s if left else s + [pad] * n)
        mask.append([0] * n + [1] * len(s) if left else [1] * len(s) + [0] * n)
        labels.append([label_pad] * n + s if left else s + [label_pad] * n)
    return {k: torch.tensor(v) for k, v in (("input_ids", ids), ("attention_mask", mask), ("labels", labels))}


class LM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 2)

    def forward(self, input_ids, attention_mask=None, labels=None, num_items_in_batch=None):
        return self.emb(input_ids)


def test_with_an_attention_mask_a_sample_is_the_same_whatever_its_padding_left_or_right():
    reader, model = SampleIdentity(), LM()
    alone = [reader.read(model, (), padded([s], to=len(s))).fingerprints[0] for s in SAMPLES]
    for left in (False, True):
        for to in (5, 9):
            batch = reader.read(model, (), padded(SAMPLES, to=to, left=left) | {"num_items_in_batch": torch.tensor(9)})
            assert batch.fingerprints == alone and batch.exact and batch.length == to
    # the mask passed by position, as the model's forward names it; DDP's wrapper forwards *args
    batch = padded(SAMPLES, to=7)
    wrapper = torch.nn.Module()
    wrapper.module = model
    by_position = reader.read(wrapper, (batch["input_ids"], batch["attention_mask"]), {"labels": batch["labels"]})
    assert by_position.fingerprints == alone


def test_without_a_mask_the_collations_padding_value_and_the_label_ignore_index_are_removed():
    reader, model = SampleIdentity(), LM()
    unmasked = [{k: v for k, v in padded(SAMPLES, to=to, pad=1).items() if k != "attention_mask"} for to in (5, 8)]
    unknown = [reader.read(model, (), batch) for batch in unmasked]
    assert not unknown[0].exact and unknown[0].fingerprints != unknown[1].fingerprints  # padding in the rows
    reader.pad_values.add(1)  # what pad_sequence(..., padding_value=1) told the probe
    known = [reader.read(model, (), batch) for batch in unmasked]
    assert known[0].exact and known[0].fingerprints == known[1].fingerprints
    # labels alone (the inputs fixed-length, the targets padded with -100): exact
    labels_only = [reader.read(model, (torch.tensor([[1, 2]] * 3),), {"labels": b["labels"][:, :2]}) for b in unmasked]
    assert labels_only[0].exact


def test_inputs_without_positions_are_rows_hashed_whole():
    reader = SampleIdentity()
    images = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 2))
    batch = reader.read(net, (images,), {})
    assert batch.length is None and batch.exact and len(set(batch.fingerprints)) == 2
    assert reader.read(net, (images[1:],), {}).fingerprints == batch.fingerprints[1:]
    assert reader.read(net, (), {"num_items_in_batch": torch.tensor([4])}) is None


def test_a_batch_in_a_list_a_dict_or_a_dataclass_is_read_as_its_tensors():
    """Lightning hands its module the batch as a list, `training_step([x, y], batch_idx)`; collators hand
    dicts, transformers a BatchEncoding, some users a dataclass: the same rows, the same fingerprints and
    padding rules, wherever they sit — before, a list held no tensor gaeq could see."""
    import dataclasses

    from transformers import BatchEncoding

    class Step(torch.nn.Module):  # a LightningModule's training_step, called through its wrapper's forward
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 2)

        def forward(self, batch, batch_idx=0):
            return self.emb(batch[0])

    @dataclasses.dataclass
    class Batch:
        input_ids: torch.Tensor
        attention_mask: torch.Tensor

    reader, step = SampleIdentity(), Step()
    flat = reader.read(LM(), (), padded(SAMPLES, to=6))
    x = padded(SAMPLES, to=6)
    for batch, exact in (
        (([x["input_ids"], x["attention_mask"]], 3), False),  # a list: nothing names its mask a mask
        (({"input_ids": x["input_ids"], "attention_mask": x["attention_mask"]}, 0), True),
        ((BatchEncoding({"input_ids": x["input_ids"], "attention_mask": x["attention_mask"]}), 0), True),
        ((Batch(input_ids=x["input_ids"], attention_mask=x["attention_mask"]), 0), True),
    ):
        read = reader.read(step, batch, {})
        assert read is not None and len(read.fingerprints) == 3 and read.exact == exact, batch
        assert (read.keys == flat.keys) == exact  # each sample by its token ids, its padding cut where named
    # a mask inside the container is the mask: the same samples, another padding, the same fingerprints
    wider = padded(SAMPLES, to=9)
    a = reader.read(step, ({"input_ids": x["input_ids"], "attention_mask": x["attention_mask"]},), {})
    b = reader.read(step, ({"input_ids": wider["input_ids"], "attention_mask": wider["attention_mask"]},), {})
    assert a.fingerprints == b.fingerprints and a.names == ["batch.input_ids"]  # (the mask is layout)


class Packed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 2)

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None, seq_idx=None):
        return self.emb(input_ids)


def pack(samples, *, restart=True, separator=-100, seq_idx=False):
    """transformers' DataCollatorWithFlattening: the samples end to end in one row, position_ids restarting
    at each (`restart`), each sample's first label `separator` (the token itself with None), no mask."""
    ids = torch.tensor([[t for s in samples for t in s]])
    labels = [[t if i or separator is None else separator for s in samples for i, t in enumerate(s)]]
    positions = [[i for s in samples for i in range(len(s))]] if restart else [list(range(ids.shape[1]))]
    batch = {"input_ids": ids, "position_ids": torch.tensor(positions), "labels": torch.tensor(labels)}
    if seq_idx:
        batch["seq_idx"] = torch.tensor([[k for k, s in enumerate(samples) for _ in s]])
    return batch


def test_packed_rows_are_read_as_their_sequences():
    """TRL's padding_free: a micro-batch of several sequences laid end to end in one row, position_ids
    restarting at each (no attention mask, on purpose). Each sequence is a sample — the same fingerprint
    as that sequence alone, whichever sequences share its row — and the rows the split check counts are
    the sequences (before: "it ran micro-batches of 1")."""
    reader, model = SampleIdentity(), Packed()
    alone = [reader.read(model, (), pack([s])).fingerprints[0] for s in SAMPLES]
    together = reader.read(model, (), pack(SAMPLES))
    assert together.fingerprints == alone and together.exact and len(together.fingerprints) == 3
    assert together.layout == "packed by position_ids"
    swapped = reader.read(model, (), pack(SAMPLES[::-1]))
    assert sorted(swapped.fingerprints) == sorted(alone)
    one = reader.read(model, (), pack([SAMPLES[1]]))
    assert one.fingerprints == [alone[1]] and one.layout == "rows as received"  # one sequence: one sample, unpacked


def test_the_targets_the_loss_learns_from_are_the_same_padded_left_right_or_packed():
    """A causal LM's labels copy its input ids (-100 on padding): its loss shifts them, position t predicting
    the label at t + 1. The same samples padded right or left (labels = ids, TRL's collator) and packed by
    DataCollatorWithFlattening (each sample's first label -100: never a target, as no position of the sample
    precedes it) are trained on the same (context, next token) pairs: the same fingerprints. What really
    moves a target still differs: a packed neighbour's first token predicted across the boundary, a label
    dropped inside a sample, positions that do not restart (the samples attend to each other)."""
    reader, model = SampleIdentity(), Packed()
    packed = reader.read(model, (), pack(SAMPLES, seq_idx=True))
    assert packed.layout == "packed by position_ids, seq_idx" and "labels (targets, shifted)" in packed.names
    for left in (False, True):
        batch = padded(SAMPLES, to=7, left=left)
        read = reader.read(model, (), batch)
        assert sorted(read.fingerprints) == sorted(packed.fingerprints), left
        assert read.layout == f"padded {'left' if left else 'right'} (attention_mask)"
    across = reader.read(model, (), pack(SAMPLES, separator=None))  # the next sample's first token a target
    assert across.fingerprints[:2] != packed.fingerprints[:2] and across.fingerprints[2] == packed.fingerprints[2]
    dropped = padded(SAMPLES, to=7)
    dropped["labels"][1, 3] = -100  # a target left out: another training signal
    assert sorted(reader.read(model, (), dropped).fingerprints) != sorted(packed.fingerprints)
    running_on = reader.read(model, (), pack(SAMPLES, restart=False, seq_idx=True))
    assert len(running_on.fingerprints) == 1  # attending across: one sequence of 9 tokens trained,
    assert running_on.samples == 3  # of the three samples the collator put in the micro-batch
    assert (
        running_on.layout
        == "packed by position_ids, seq_idx (they disagree: position_ids starts 1, seq_idx starts 3 sequences)"
    )


def test_targets_given_shifted_already_are_read_where_they_are():
    """nanoGPT's (x, y): the targets are the next tokens already, at each position — not copies of the ids,
    so not shifted again; a target changed is a sample changed."""
    reader, model = SampleIdentity(), Packed()
    x, y = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([[2, 3, 4, 5], [6, 7, 8, 9]])
    read = reader.read(model, (x,), {"labels": y})
    assert read.names == ["input_ids", "labels (targets)"]
    z = y.clone()
    z[0, 0] = 0
    assert reader.read(model, (x,), {"labels": z}).fingerprints[0] != read.fingerprints[0]
