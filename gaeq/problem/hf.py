"""transformers models by name: a causal LM (or token-classification) class, randomly initialised
from its config.

Never a download: the class's config is built from the matrix's keyword arguments, the vocabulary
and positions from the token data, and the weights from the class's own initialisation under the
problem's seed. Everything else is the config's default, dropouts included — a model trains as its
config says, and a default dropout is something the lab must show, not hide.

``loss: hf`` is the model's own loss (transformers' ``ForCausalLMLoss``) given
``num_items_in_batch``: the loss sum of the micro-batch ÷ that count. Given the *global* batch's
valid-token count, every token weighs the same whatever the split — transformers' accumulation fix
(huggingface/transformers#34242). transformers is an optional extra: ``pip install 'gaeq[hf]'``.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from gaeq.problem.spec import HFModelSpec

INSTALL_HINT = "transformers models need the hf extra: pip install 'gaeq[hf]'"


class HFModelError(ValueError):
    """A transformers model that cannot be built. The message says why in one line."""


def transformers_module():
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise HFModelError(INSTALL_HINT) from None


@functools.cache
def causal_lm_classes() -> frozenset[str]:
    """Names of every causal-LM class transformers knows (its AutoModelForCausalLM mapping)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return _names(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@functools.cache
def token_classification_classes() -> frozenset[str]:
    """Names of every token-classification class transformers knows: with one label per token of the
    vocabulary, a next-token predictor whose head is ``GenericForTokenClassification``'s."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    return _names(MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES)


def _names(mapping) -> frozenset[str]:
    names: set[str] = set()
    for value in mapping.values():
        names.update((value,) if isinstance(value, str) else value)
    return frozenset(names)


def is_token_classifier(model: torch.nn.Module) -> bool:
    return type(model).__name__ in token_classification_classes()


def build_hf_model(spec: HFModelSpec, *, vocab_size: int, seq_len: int) -> torch.nn.Module:
    """The model, randomly initialised (call it under the problem's seed), in float32."""
    transformers = transformers_module()
    token_classifier = spec.hf in token_classification_classes()
    if spec.hf not in causal_lm_classes() and not token_classifier:
        raise HFModelError(
            f"model.hf {spec.hf!r} is not a transformers causal-LM or token-classification class (e.g. "
            f"LlamaForCausalLM, GPT2LMHeadModel, LlamaForTokenClassification; transformers {transformers.__version__})"
        )
    cls = getattr(transformers, spec.hf)
    labels = {"num_labels": vocab_size} if token_classifier else {}  # a label per token: the next one
    # gaeq shrinks the vocabulary to the data's, which makes transformers warn about the config's
    # special token ids (GPT-2's 50256): noise about knobs training never reads.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        config = cls.config_class(
            **spec.config, **labels, vocab_size=vocab_size, max_position_embeddings=seq_len, use_cache=False
        )
        model = cls(config).float()
    except Exception as exc:  # noqa: BLE001 - any failure here is the config's
        raise HFModelError(
            f"model.hf {spec.hf}: cannot build from model.config ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    if not getattr(config, "return_dict", True):
        raise HFModelError(f"model.hf {spec.hf}: return_dict must stay true (gaeq reads outputs by name)")
    if spec.accepts_loss_kwargs is not None:  # what the transformers Trainer reads instead of guessing
        model.accepts_loss_kwargs = spec.accepts_loss_kwargs
    return model


def dropouts(model: torch.nn.Module) -> dict[str, float]:
    """The model config's non-zero dropout knobs (``attention_dropout``, GPT-2's ``resid_pdrop``,
    …). torch's global RNG draws their masks, so the masks depend on the split. Knobs of heads a
    causal LM does not have (GPT-2's ``summary_*``, ``classifier_dropout``) are left out — but a token
    classifier's own head dropout (``GenericForTokenClassification``: 0.1 when the config has none)."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    found = {
        key: float(value)
        for key, value in sorted(config.to_dict().items())
        if ("dropout" in key or "pdrop" in key)
        and not key.startswith(("summary_", "classifier_"))
        and isinstance(value, float)
        and value > 0
    }
    head = getattr(model, "dropout", None)  # a token classifier's head: 0.1 unless the config says otherwise
    if is_token_classifier(model) and isinstance(head, torch.nn.Dropout) and head.p > 0:
        found["classifier_dropout"] = float(head.p)
    return found


def model_loss(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, num_items: int, aux_share: float = 1.0
) -> torch.Tensor:
    """The model's own loss over the micro-batch, as a transformers training loop computes it:
    the sum over its valid tokens ÷ ``num_items`` (``num_items_in_batch``). ``targets`` are already
    the next tokens (the data shifts them), so they go in as ``shift_labels``.

    A token classifier's forward drops ``num_items_in_batch`` (``GenericForTokenClassification`` calls
    its loss function without it: a mean over the micro-batch) — so its own loss function is called
    here with the count, as a correct loop would; the transformers Trainer calls the forward
    (transformers#45305). A mixture of experts' balance term is weighed by ``aux_share``, the micro-batch's
    share of the step (1: as the model adds it, whole)."""
    inner = getattr(model, "module", model)  # (DDP's)
    if is_token_classifier(inner):
        outputs = model(input_ids=inputs)
        return inner.loss_function(outputs.logits, targets, inner.config, num_items_in_batch=num_items)
    outputs = model(input_ids=inputs, labels=targets, shift_labels=targets, num_items_in_batch=num_items)
    aux = getattr(outputs, "aux_loss", None)
    if aux is None or aux_share == 1.0:
        return outputs.loss
    # A mixture of experts (output_router_logits) adds router_aux_loss_coef × its micro-batch's balance
    # loss whole; gaeq's loops weigh it as the main loss is weighed — its share of the step's micro-batches.
    return outputs.loss + inner.router_aux_loss_coef * aux * (aux_share - 1.0)


class RouterTokens:
    """The tokens each expert of each layer of a transformers mixture of experts took (the top
    ``num_experts_per_tok`` of its router's logits), counted by a forward hook on every router: the
    modules of the class transformers records ``router_logits`` from (``_can_record_outputs``). For
    ``ran``, in every loop — the Trainer's included. False where the model has no routers (any other model)."""

    def __init__(self, model: torch.nn.Module) -> None:
        recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        routers = [m for m in model.modules() if recorder is not None and isinstance(m, recorder.target_class)]
        self.index = getattr(recorder, "index", 0)
        self.top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", 1)
        self.counts: list[torch.Tensor | None] = [None] * len(routers)
        self.hooks = [router.register_forward_hook(self._count(i)) for i, router in enumerate(routers)]

    def _count(self, layer: int):
        def hook(module, args, output) -> None:
            logits = (output[self.index] if isinstance(output, tuple) else output).detach()
            chosen = logits.topk(self.top_k, dim=-1).indices.flatten().cpu()
            counts = torch.bincount(chosen, minlength=logits.shape[-1])
            self.counts[layer] = counts if self.counts[layer] is None else self.counts[layer] + counts

        return hook

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def tokens(self) -> list[list[int]]:
        return [[] if c is None else c.tolist() for c in self.counts]


def logits(outputs: Any) -> torch.Tensor:
    """A transformers output's logits; any other model's output as it is."""
    return outputs.logits if hasattr(outputs, "logits") and isinstance(outputs.logits, torch.Tensor) else outputs
