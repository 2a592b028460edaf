"""A transformers model in the problem schema (`model: {hf: LlamaForCausalLM, config: {...}}`), and how the
transformers Trainer treats its loss. Pure pydantic, no torch, no transformers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from gaeq.problem.spec_base import Spec

HF_DATA_KEYS = ("vocab_size", "max_position_embeddings", "n_positions", "n_ctx")
"""transformers config keys gaeq sets from the token data (GPT-2 spells positions n_positions/n_ctx)."""


class HFModelSpec(Spec):
    """A transformers causal LM by class name (``LlamaForCausalLM``, ``GPT2LMHeadModel``, … any class
    of transformers' causal-LM auto mapping) — or a token-classification class (``LlamaForTokenClassification``:
    one label per vocabulary token, the next one) — randomly initialised from ``config``, never a download.
    Needs ``pip install 'gaeq[hf]'``."""

    kind: Literal["hf"] = "hf"
    hf: str = Field(pattern=r"^[A-Za-z_]\w*$", description="The transformers class, e.g. LlamaForCausalLM.")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the class's config (LlamaConfig, ...). Everything else is the "
        "config's default — dropouts included, kept as given (a default dropout > 0 makes masks depend on "
        "the split: such cells diverge, and the report says why). Vocabulary and positions come from the data.",
    )
    accepts_loss_kwargs: bool | None = Field(
        None,
        description="Set the model's accepts_loss_kwargs: what the transformers Trainer reads, instead of guessing "
        "from forward's **kwargs, to decide whether the model divides by num_items_in_batch itself (then the "
        "Trainer does not ÷ GA). None: the class's own.",
    )
    sp_loss: Literal["trainer", "global_tokens"] = Field(
        "trainer",
        description="The loss each rank backpropagates under the Trainer's DeepSpeed sequence parallelism "
        "(hf_deepspeed cells with sequence_parallel > 1). trainer: transformers' own deepspeed_sp_compute_loss, as "
        "users run it. global_tokens: the corrected normaliser, in a Trainer subclass's compute_loss — this rank's "
        "token-loss sum ÷ the global batch's tokens × the data-parallel ranks (DeepSpeed sums the gradients over the "
        "sequence ranks and averages them over the data ranks), already scaled for GA (loss_is_scaled_for_ga).",
    )

    @model_validator(mode="after")
    def _check(self) -> HFModelSpec:
        given = sorted(set(self.config) & set(HF_DATA_KEYS))
        if given:
            raise ValueError(
                f"model.config.{given[0]}: the vocabulary and positions come from the token data "
                "(data.vocab_size, data.seq_len) — never written twice; remove it"
            )
        return self
