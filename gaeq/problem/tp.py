"""Tensor-parallel plans: which linear layers a model splits column-wise and which row-wise.

A plan maps module names to ``"colwise"`` or ``"rowwise"`` — transformers' ``base_model_tp_plan``
format, ``*`` standing for any layer index. A column-wise layer holds a slice of the output
features (its input is whole on every rank); the row-wise layer after it holds the matching slice
of the input features and sums the partial outputs over the tensor-parallel ranks (one all-reduce).
Everything else (embeddings, norms, the head) stays whole on every rank.

Where a plan comes from, first found:

- a transformers model's ``config.base_model_tp_plan`` (under its ``base_model_prefix``);
- the model's own ``tp_plan`` attribute — gaeq's GPT has one, and it is the hook for plugins;
- nowhere: the model cannot run with ``tensor_parallel > 1`` (bad input for built-ins, an error
  naming the model for plugins).
"""

from __future__ import annotations

import re

import torch

from gaeq.problem.spec import GPTSpec, HFModelSpec, MLPSpec, ProblemSpec

STYLES = ("colwise", "rowwise", "vocab")
"""``vocab``: a head split column-wise whose output — the logits — stays sharded by vocabulary, for a
cross-entropy computed on the shards (torch's loss_parallel)."""


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's plan, expanded to the names of its modules (``blocks.0.attn.qkv`` → ``colwise``)."""
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if base_plan:  # a transformers model (its own `tp_plan` property adds the head, which gaeq keeps whole)
        patterns, prefix = base_plan, f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    else:
        patterns, prefix = getattr(model, "tp_plan", None), ""
    if not patterns:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan: give the model a `tp_plan` attribute "
            "({'layers.*.fc_in': 'colwise', 'layers.*.fc_out': 'rowwise'}) to run it with tensor_parallel > 1"
        )
    names = [name for name, _ in model.named_modules()]
    plan: dict[str, str] = {}
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ValueError(
                f"{type(model).__name__}'s tensor-parallel plan has {pattern!r}: {style!r}; gaeq applies "
                f"{' and '.join(STYLES)}"
            )
        regex = re.compile(re.escape(prefix + pattern).replace(r"\*", r"\d+") + "$")
        matched = [n for n in names if regex.match(n)]
        if not matched:
            raise ValueError(
                f"{type(model).__name__}'s tensor-parallel plan names {pattern!r}, which matches no module"
            )
        plan |= dict.fromkeys(matched, style)
    return plan


def plan_problem(problem: ProblemSpec, tensor_parallel: int) -> str | None:
    """Why the problem's model cannot be split over `tensor_parallel` ranks, or None. Plugins are
    checked when they are built (their plan is an attribute of the built model)."""
    model = problem.model
    if isinstance(model, MLPSpec):
        return (
            "the MLP has no tensor-parallel plan "
            "(use a GPT, a transformers model with a base_model_tp_plan, or a plugin with tp_plan)"
        )
    if isinstance(model, GPTSpec):
        vocab = getattr(problem.data, "vocab_size", 0)
        if model.loss_parallel and vocab % tensor_parallel:
            return f"loss_parallel: vocab_size {vocab} is not divisible by tensor_parallel {tensor_parallel}"
        return _divides("n_head", model.n_head, tensor_parallel)
    if isinstance(model, HFModelSpec):
        import transformers

        config = getattr(transformers, model.hf).config_class(**model.config)
        if not getattr(config, "base_model_tp_plan", None):
            return f"{model.hf} has no base_model_tp_plan in transformers {transformers.__version__}"
        for key in ("num_attention_heads", "num_key_value_heads"):
            if (heads := getattr(config, key, None)) is not None and (why := _divides(key, heads, tensor_parallel)):
                return f"{model.hf}: {why}"
    return None


def _divides(what: str, n: int, tensor_parallel: int) -> str | None:
    if n % tensor_parallel:
        return f"{what} {n} is not divisible by tensor_parallel {tensor_parallel} (each rank holds whole heads)"
    return None
