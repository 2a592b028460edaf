"""transformers models by name (model: {hf: ...}) and their own loss (loss: hf): built from a config
with the data's vocabulary and positions, never downloaded; dropouts kept as the config gives them;
the model's loss with the global batch's token count accumulates to the full-batch gradient, and
the per-micro-batch count (transformers before its fix) does not."""

from __future__ import annotations

import sys

import pytest
import torch

from gaeq.matrix import MatrixError, matrix_from_dict
from gaeq.problem.build import build_problem, check_problem
from gaeq.problem.data import BatchPlan
from gaeq.problem.hf import INSTALL_HINT, HFModelError, dropouts
from gaeq.problem.spec import HFModelSpec, ProblemSpec
from gaeq.results.notes import dropout_note
from tests.helpers import small_spec

LLAMA = {
    "hf": "LlamaForCausalLM",
    "config": {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    },
}
GPT2 = {"hf": "GPT2LMHeadModel", "config": {"n_embd": 16, "n_layer": 1, "n_head": 2}}
TOKENS = {"kind": "tokens", "vocab_size": 24, "seq_len": 12}


def problem(model=LLAMA, loss="hf", **more) -> ProblemSpec:
    return ProblemSpec.model_validate({"model": model, "data": TOKENS, "loss": loss, "train_batch_size": 8, **more})


def test_the_model_is_built_from_its_config_with_the_datas_vocabulary_and_positions():
    gpt2 = build_problem(problem(GPT2)).model
    assert type(gpt2).__name__ == "GPT2LMHeadModel"
    assert (gpt2.config.vocab_size, gpt2.config.n_positions, gpt2.config.n_embd) == (24, 12, 16)
    llama = build_problem(problem(LLAMA)).model
    assert (llama.config.vocab_size, llama.config.max_position_embeddings) == (24, 12)
    assert all(p.dtype == torch.float32 for p in llama.parameters())
    again = build_problem(problem(LLAMA)).model  # the problem's seed: the same init in every cell
    assert all(torch.equal(a, b) for a, b in zip(llama.state_dict().values(), again.state_dict().values()))
    other = build_problem(problem(LLAMA, seed=1)).model
    assert not torch.equal(llama.lm_head.weight, other.lm_head.weight)


@pytest.mark.parametrize("key", ["vocab_size", "max_position_embeddings", "n_positions"])
def test_vocabulary_and_positions_are_never_written_twice(key):
    with pytest.raises(ValueError, match=f"model.config.{key}: the vocabulary and positions come from the token data"):
        problem({"hf": "LlamaForCausalLM", "config": {key: 64}})


def test_pairings_loss_hf_needs_a_transformers_model_and_tokens():
    with pytest.raises(ValueError, match="loss hf is a transformers model's own loss"):
        ProblemSpec.model_validate({"model": {"kind": "gpt"}, "data": TOKENS, "loss": "hf", "train_batch_size": 8})
    with pytest.raises(ValueError, match="model hf trains on data kind tokens"):
        ProblemSpec.model_validate({"model": LLAMA, "loss": "hf", "train_batch_size": 8})
    assert problem(LLAMA, loss="cross_entropy").loss == "cross_entropy"  # gaeq's own normalisation of its logits


def test_a_class_that_is_not_a_causal_lm_is_refused_by_name():
    with pytest.raises(
        HFModelError,
        match=r"'BertModel' is not a transformers causal-LM or token-classification class .*transformers 5\.",
    ):
        build_problem(problem({"hf": "BertModel"}))
    with pytest.raises(HFModelError, match="LlamaForCausalLM: cannot build from model.config .*no_such_knob"):
        build_problem(
            problem({"hf": "LlamaForCausalLM", "config": {"no_such_knob": "x", "hidden_act": "no_such_knob"}})
        )


def test_a_token_classifier_predicts_the_next_token_and_its_own_loss_is_given_the_count_its_forward_drops():
    from gaeq.problem.hf import model_loss

    spec = {**LLAMA, "hf": "LlamaForTokenClassification"}
    model = build_problem(problem(spec)).model
    assert model.config.num_labels == 24  # one label per vocabulary token: the next one
    assert dropouts(model) == {"classifier_dropout": 0.1}  # its head's default, masks from torch's global RNG
    model = build_problem(problem({**spec, "config": {**spec["config"], "classifier_dropout": 0.0}})).model
    # nothing said: the Trainer guesses from GenericForTokenClassification.forward's **kwargs
    assert dropouts(model) == {} and not hasattr(model, "accepts_loss_kwargs")
    inputs, targets = torch.randint(0, 24, (2, 8)), torch.randint(0, 24, (2, 8))
    targets[1, 5:] = -100  # padding
    logits = model(input_ids=inputs).logits
    summed = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    # the forward ignores num_items_in_batch (a mean over the micro-batch: what the Trainer gets) ...
    forward = model(input_ids=inputs, labels=targets, num_items_in_batch=100).loss
    torch.testing.assert_close(forward, summed / 13)
    # ... gaeq's loop calls its loss function with the count, as a correct loop must
    torch.testing.assert_close(model_loss(model, inputs, targets, num_items=100), summed / 100)
    fixed = build_problem(problem({**spec, "accepts_loss_kwargs": False})).model
    assert fixed.accepts_loss_kwargs is False  # what the Trainer reads instead of guessing from **kwargs


def test_without_transformers_one_line_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: import raises
    with pytest.raises(HFModelError) as info:
        check_problem(problem())
    assert str(info.value) == INSTALL_HINT == "transformers models need the hf extra: pip install 'gaeq[hf]'"


def test_dropouts_are_the_configs_as_given():
    assert dropouts(build_problem(problem(GPT2)).model) == {"attn_pdrop": 0.1, "embd_pdrop": 0.1, "resid_pdrop": 0.1}
    assert dropouts(build_problem(problem(LLAMA)).model) == {}
    quiet = {**GPT2, "config": {**GPT2["config"], "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}}
    assert dropouts(build_problem(problem(quiet)).model) == {}
    note = dropout_note({"attn_pdrop": 0.1, "resid_pdrop": 0.1})
    assert "config has dropout (attn_pdrop=0.1, resid_pdrop=0.1): torch's global RNG draws its masks" in note
    assert dropout_note({}) == ""


def accumulated_grads(built, plan: BatchPlan, *, count: str) -> list[torch.Tensor]:
    """Step 0's gradient, accumulated over the plan's micro-batches of rank 0..world-1 (averaged over
    ranks as DDP does) — through the model's own loss given the global or the per-micro-batch count."""
    model = built.model
    model.zero_grad(set_to_none=True)
    positions = range(plan.train_batch_size)
    normaliser = built.total_loss_elements([plan.sample_at(p) for p in positions])
    for rank in range(plan.data_parallel):
        for micro_step in range(plan.grad_accum_steps):
            indices = [plan.sample_at(p) for p in plan.positions(step=0, micro_step=micro_step, rank=rank)]
            inputs, targets = built.dataset.batch(indices)
            num_items = normaliser if count == "global" else built.total_loss_elements(indices)
            loss = built.micro_loss(model, inputs, targets, num_items=num_items) * plan.data_parallel
            (loss / plan.data_parallel).backward()  # the all-reduce's average over ranks
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("model", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_the_models_own_loss_with_the_global_count_accumulates_to_the_full_batch_gradient(model):
    config = {
        **model,
        "config": {
            **model["config"],
            **({"attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0} if model is GPT2 else {}),
        },
    }
    built = build_problem(problem(config, train_batch_size=16))
    whole = BatchPlan(train_batch_size=16, micro_batch_size=16, data_parallel=1)
    full = accumulated_grads(built, whole, count="global")
    for micro, world in [(2, 1), (4, 2), (1, 4)]:
        plan = BatchPlan(train_batch_size=16, micro_batch_size=micro, data_parallel=world)
        split = accumulated_grads(built, plan, count="global")
        for a, b in zip(full, split):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        # control: each micro-batch's own count (the pre-fix behaviour) is another gradient
        wrong = accumulated_grads(built, plan, count="per_micro_batch")
        assert max((w - a).abs().max().item() for w, a in zip(wrong, full)) > 1e-3


def test_the_hf_bugs_exist_only_with_the_hf_loss():
    spec = small_spec(cells=[{"trainer": "torch", "micro_batch_size": 4, "bug": "hf_num_items_per_micro_batch"}])
    with pytest.raises(MatrixError, match="bug 'hf_num_items_per_micro_batch' exists only with loss hf, not 'mse'"):
        matrix_from_dict(spec)


def test_a_variant_with_another_transformers_class_starts_afresh_and_one_with_the_same_merges():
    spec = small_spec(
        axes={"trainer": ["torch"], "world_size": [1], "micro_batch_size": [4], "variant": ["base", "gpt2", "wider"]}
    )
    spec["problem"] |= {"model": LLAMA, "data": TOKENS, "loss": "hf"}
    spec["variants"] = {
        "gpt2": {"problem": {"model": GPT2}},
        "wider": {"problem": {"model": {"config": {"hidden_size": 32}}}},
    }
    problems = matrix_from_dict(spec).problems
    assert problems["gpt2"].model == HFModelSpec(**GPT2)  # none of Llama's config keys leak into GPT-2's
    assert problems["wider"].model.config == {**LLAMA["config"], "hidden_size": 32}
