"""DeepSpeed's Muon as the problem's optimizer (gaeq/problem/optim.py, gaeq/trainers/muon.py), in this
process at world 1: the same parameters split as DeepSpeed splits them, the same update on both sides, a
split that matches, each matrix orthogonalised once a step (measured, with a control that must fail), and
the controls: Muon as SGD (DeepSpeed#8441's step) and a missing ÷ GA, which Muon hides from the loss.
Process groups and ZeRO 0–3: tests/integration/test_muon.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gaeq.matrix import MatrixError, load_matrix, matrix_from_dict
from gaeq.problem.models import GPT
from gaeq.problem.optim import build_optimizer, deepspeed_optimizer, muon_matrix
from gaeq.problem.spec import GPTSpec, ProblemSpec
from gaeq.results.report import judge
from gaeq.results.trace import TraceStore
from gaeq.trainers import muon
from tests.helpers import run_in_process, small_spec

MUON = {"name": "muon", "lr": 0.02, "momentum": 0.95, "weight_decay": 0.01, "adam_lr": 3e-3, "betas": [0.9, 0.95]}


def muon_spec(**more) -> dict:
    spec = small_spec(**more)
    spec["problem"].update(
        model={"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
        data={"kind": "tokens", "vocab_size": 16, "seq_len": 8},
        loss="cross_entropy",
        optimizer=MUON,
        steps=3,
    )
    return spec


def test_gaeqs_split_of_the_parameters_is_the_one_deepspeed_tags():
    """DeepSpeed decides by shape and name (`set_optimizer_flags`): a matrix goes to Muon unless its name
    holds "embed" or "lm_head" — so a nanoGPT-named model's wte, wpe and head are Muon's, on both sides."""
    import deepspeed

    model = GPT(GPTSpec(n_layer=1, n_head=2, n_embd=16), vocab_size=16, block_size=8, seed=0)
    deepspeed.set_optimizer_flags(SimpleNamespace(optimizer_name="muon", optimizer_params={}), model)
    tagged = {n for n, p in model.named_parameters() if p.use_muon}
    assert tagged == {n for n, p in model.named_parameters() if muon_matrix(n, p)}
    assert {"wte.weight", "wpe.weight", "head.weight"} <= tagged and "blocks.0.ln_1.weight" not in tagged
    config = deepspeed_optimizer(ProblemSpec.model_validate(muon_spec()["problem"]).optimizer)
    assert config["type"] == "Muon" and config["params"]["torch_adam"] and config["params"]["ns_method"] == "gram"


def test_the_torch_side_runs_deepspeeds_muon_update_and_torchs_adamw():
    problem = ProblemSpec.model_validate(muon_spec()["problem"])
    model = GPT(GPTSpec(n_layer=1, n_head=2, n_embd=16), vocab_size=16, block_size=8, seed=0)
    optimizer = build_optimizer(model.named_parameters(), problem)
    assert type(optimizer).__name__ == "MuonWithAuxAdam" and isinstance(optimizer.aux_optimizer, torch.optim.AdamW)
    halves = {g["use_muon"]: g for g in optimizer.param_groups}
    assert (halves[True]["lr"], halves[True]["momentum"], halves[False]["lr"]) == (0.02, 0.95, 3e-3)


def test_a_split_matches_and_a_missing_division_hardly_shows_in_the_loss_but_in_the_norm(write_matrix, tmp_path):
    cells = [
        {"trainer": "torch", "micro_batch_size": 4, "bug": "muon_without_newton_schulz"},
        {"trainer": "torch", "micro_batch_size": 4, "bug": "no_loss_division"},
    ]
    matrix = load_matrix(write_matrix(muon_spec(axes={"trainer": ["torch"], "micro_batch_size": [4]}, cells=cells)))
    report = judge(matrix, run_in_process(matrix, tmp_path), TraceStore(tmp_path))
    cells = {c.id: c for c in report.cells}
    split = cells["torch-w1-mb4-ga4"]
    assert split.verdict == "match" and split.ran["newton_schulz"] == muon.ONCE, split.reason
    assert split.ran["muon_matrices"] == 7  # wte, wpe, qkv, proj, the MLP's two, head
    as_sgd = cells["torch-w1-mb4-ga4-bug_muon_without_newton_schulz"]
    assert (as_sgd.verdict, as_sgd.caught_by) == ("diverge", "loss") and as_sgd.ran["newton_schulz"] == muon.NEVER
    hidden = cells["torch-w1-mb4-ga4-bug_no_loss_division"]  # Newton–Schulz normalises the update's scale
    assert (hidden.verdict, hidden.caught_by, hidden.first_divergent_step) == ("diverge", "grad_norm", 0)
    step0 = {cell_id: TraceStore(tmp_path).get(cell_id)[0].grad_norm for cell_id in (hidden.id, "torch-w1-mb16-ga1")}
    assert step0[hidden.id] == pytest.approx(4 * step0["torch-w1-mb16-ga1"], rel=1e-5)  # GA × the norm ...
    # ... while the loss hardly moves: Newton–Schulz drops the scale, AdamW nearly (its eps lets 5e-5 through here)
    assert hidden.max_abs_loss_diff < 1e-4 and as_sgd.max_abs_loss_diff > 1e-2


def test_the_newton_schulz_count_says_what_ran():
    """The count a cell's label is checked against: once, never, twice on a rank (DeepSpeed#8443's
    per-micro-batch orthogonalisation) — a control that must fail for each."""
    from deepspeed.runtime.zero.muon import original_muon

    for calls, word in ((2, muon.ONCE), (0, muon.NEVER), (4, muon.TWICE), (1, muon.SOME)):
        measures = {}
        muon.watch(SimpleNamespace(read_at_first_step=measures.update), matrices=2, optimizer="muon")
        with torch.compiler.set_stance("force_eager"):
            for _ in range(calls):
                original_muon.zeropower_via_gram_newtonschulz(torch.eye(2), steps=1)
        assert (measures["newton_schulz"](), measures["newton_schulz_calls"]()) == (word, calls)


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ({"trainer": "fsdp"}, "the fsdp trainer does not build it"),
        ({"trainer": "torch", "world_size": 2, "tensor_parallel": 2}, "needs every matrix whole"),
        ({"trainer": "deepspeed", "zero_stage": 2, "offload": "cpu"}, "CPU Adam takes its AdamW half"),
    ],
)
def test_where_muon_is_bad_input(cell, message):
    with pytest.raises(MatrixError, match=message):
        matrix_from_dict(muon_spec(axes=None, cells=[{"micro_batch_size": 4} | cell]))


def test_the_muon_bug_needs_muon():
    spec = small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "muon_without_newton_schulz"}])
    with pytest.raises(MatrixError, match="exists only with optimizer muon"):
        matrix_from_dict(spec)


def test_torchs_muon_pairs_with_adamw_over_the_same_matrices_and_a_schedule_moves_both():
    problem = ProblemSpec.model_validate(muon_spec()["problem"] | {"optimizer": MUON | {"name": "torch_muon"}})
    model = GPT(GPTSpec(n_layer=1, n_head=2, n_embd=16), vocab_size=16, block_size=8, seed=0)
    optimizer = build_optimizer(model.named_parameters(), problem)
    assert isinstance(optimizer.muon, torch.optim.Muon) and isinstance(optimizer.adamw, torch.optim.AdamW)
    assert muon.matrices(optimizer) == 7 and len(optimizer.adamw.param_groups[0]["params"]) == 10  # LNs, biases
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # the groups are the halves'
    assert (optimizer.muon.param_groups[0]["lr"], optimizer.adamw.param_groups[0]["lr"]) == (0.01, 1.5e-3)
    before = model.head.weight.detach().clone()
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    optimizer.step()
    scheduler.step()
    assert not torch.equal(before, model.head.weight)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cells": [{"trainer": "deepspeed", "zero_stage": 1, "micro_batch_size": 4}]}, "DeepSpeed builds its own"),
        ({"resume": {"source": {"trainer": "torch", "micro_batch_size": 4}, "at_step": 1, "targets": []}}, "resume"),
    ],
)
def test_torch_muon_runs_in_torch_loops_and_no_muon_resumes_yet(change, message):
    spec = muon_spec(axes=None, cells=change.get("cells", [{"trainer": "torch", "micro_batch_size": 4}]))
    spec["problem"]["optimizer"] = MUON | {"name": "torch_muon"}
    spec |= {k: v for k, v in change.items() if k != "cells"}
    with pytest.raises((MatrixError, ValueError), match=message):
        matrix_from_dict(spec)
