"""The problem schema: WHAT is trained — data, model, loss, optimisation. Pure pydantic, no torch.

Every cell of a matrix variant trains the same problem; only the split differs. Built-in models
take their input/output sizes from the data (never written twice). Any of model, data and loss
may instead name a plugin, ``{import: "package.module:function", args: {...}}`` (docs/matrix.md: Plugins).
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from gaeq.problem.hf_spec import HF_DATA_KEYS, HFModelSpec
from gaeq.problem.script import ScriptSpec
from gaeq.problem.spec_base import Spec

__all__ = ["HF_DATA_KEYS", "HFModelSpec", "Spec"]  # re-exported: the problem schema in one import

PositiveInt = Annotated[int, Field(gt=0)]
# Upper bounds keep a typo (hidden: 1e9) from becoming an out-of-memory kill while the problem is
# checked: this lab trains small problems on CPUs. Bigger models come in as plugins.
Width = Annotated[int, Field(gt=0, le=4096)]
Depth = Annotated[int, Field(gt=0, le=32)]
Samples = Annotated[int, Field(gt=0, le=2**20)]
"""Batch sizes."""
Dtype = Literal["fp32", "bf16", "fp16", "ds_bf16", "ds_fp16"]
"""fp32; bf16 / fp16 = forward autocast on every trainer (fp32 weights and gradients; fp16 adds
torch's GradScaler on the torch side); ds_bf16 / ds_fp16 = DeepSpeed's own mixed precision (half
weights and gradients, fp32 master weights; fp16 with dynamic loss scaling) — DeepSpeed only."""


class PluginSpec(Spec):
    """A user function, imported from the matrix file's folder or the working directory."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    import_: str = Field(
        alias="import", pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$", description="package.module:function"
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the function.")


class DataPluginSpec(PluginSpec):
    num_samples: PositiveInt | None = Field(None, description="As for the built-in datasets.")


# --- data -----------------------------------------------------------------------------------

_NUM_SAMPLES = Field(
    None,
    description="Finite dataset size: global positions walk a seeded permutation per epoch. "
    "None: an endless stream, sample i at position i.",
)


class RegressionSpec(Spec):
    """Noisy targets of a fixed random two-layer tanh teacher. One loss element per sample."""

    kind: Literal["regression"] = "regression"
    in_features: Width = 16
    out_features: Width = 4
    noise: float = Field(0.1, ge=0, description="Std of the label noise; > 0 keeps the loss away from 0.")
    target_scale: float = Field(1.0, gt=0, description="Multiplies targets (and so gradient norms).")
    num_samples: PositiveInt | None = _NUM_SAMPLES


class CompletionsSpec(Spec):
    """Token data as policy-gradient post-training sees it (GRPO, DAPO): each sample a prompt and a
    completion generated from it, scored by a reward; only the completion's tokens are targets
    (the generated-length mask), each weighted by its sample's advantage — the reward normalised
    within the group of completions of one prompt. A sample's prompt, completion, reward and advantage
    are pure functions of (seed, index), so the same whatever the split."""

    prompt_len: int = Field(4, ge=1, description="Tokens of the prompt: context, never a target.")
    group_size: int = Field(
        4,
        ge=2,
        description="Completions per prompt (samples group_size·g … group_size·g + group_size − 1 share one), "
        "their advantages (r − mean) / (std + 1e-4) over the group (GRPO's).",
    )


class TokensSpec(Spec):
    """Variable-length sequences of a seeded Markov chain, right-padded; padding labels are ignored.

    Valid-token counts differ from sample to sample, so from micro-batch to micro-batch.
    """

    kind: Literal["tokens"] = "tokens"
    vocab_size: int = Field(16, gt=0, le=65536)
    seq_len: int = Field(24, ge=2, le=4096, description="Padded length (the model's block size).")
    min_len: int = Field(3, ge=2, description="Shortest sequence (tokens, before the shift by one).")
    masked_every: int | None = Field(
        None,
        ge=2,
        description="Every n-th sample (by index) has no valid label — a prompt masked out, a sequence over the "
        "length limit: nothing to learn from, and a micro-batch of such samples is empty. None: none.",
    )
    packed: bool = Field(
        False,
        description="Each sample a pack, as packed training feeds a model: documents (Markov walks of their own "
        "lengths, min_len to (seq_len + 1) // 2 tokens) laid end to end until the next does not fit, the rest "
        "padded; a target that would cross into the next document is ignored. Valid tokens differ from pack to pack.",
    )
    completions: CompletionsSpec | None = Field(
        None,
        description="Each sample a prompt and its completion, scored (loss policy_gradient): CompletionsSpec. "
        "None: every token after the first is a target.",
    )
    num_samples: PositiveInt | None = _NUM_SAMPLES

    @model_validator(mode="after")
    def _check(self) -> TokensSpec:
        if self.min_len > self.seq_len + 1:
            raise ValueError(f"min_len {self.min_len} exceeds seq_len + 1 = {self.seq_len + 1}")
        if self.completions is not None:
            if self.packed:
                raise ValueError("completions are one prompt and its completion a sample: not packed data")
            if self.min_len < self.completions.prompt_len + 1:
                raise ValueError(
                    f"min_len {self.min_len} leaves no completion after a prompt of {self.completions.prompt_len} "
                    f"tokens: min_len ≥ prompt_len + 1 = {self.completions.prompt_len + 1}"
                )
        return self


# --- models ---------------------------------------------------------------------------------

_DROPOUT_RNG = Field(
    "indexed",
    description="indexed: each sample's mask is a function of (seed, global position, layer) — the same "
    "whatever the split; global: torch's global RNG, so the masks depend on the split (a pitfall).",
)


class MLPSpec(Spec):
    kind: Literal["mlp"] = "mlp"
    hidden: Width = 64
    depth: Depth = Field(2, description="Hidden layers.")
    norm: Literal["none", "layer", "batch"] = Field(
        "none", description="After each hidden layer. batch: statistics over the micro-batch (a pitfall)."
    )
    dropout: float = Field(0.0, ge=0, lt=1)
    dropout_rng: Literal["indexed", "global"] = _DROPOUT_RNG


class MoESpec(Spec):
    """Every block's MLP a mixture of experts: a linear router, softmax over the experts, the top-k
    experts' outputs weighted by their renormalised probabilities — and the standard load-balancing
    auxiliary loss (Switch Transformer): coef × experts × Σᵢ fᵢ·Pᵢ per layer, fᵢ the share of routed
    tokens expert i took, Pᵢ its mean router probability."""

    experts: int = Field(4, ge=2, le=64)
    top_k: int = Field(2, ge=1)
    aux_loss_coef: float = Field(0.01, ge=0, description="The load-balancing loss's weight.")
    balance: Literal["micro_batch", "global", "global_buffered"] = Field(
        "micro_batch",
        description="Which tokens fᵢ and Pᵢ are taken over. micro_batch: each micro-batch's own (the usual way: "
        "NOT invariant to the split — it depends on which samples share a micro-batch); global: the whole "
        "global batch over every rank (arXiv 2501.11873, Qwen3-MoE) — fᵢ counted by a routing-only pass over "
        "the step's micro-batches before the first backward, so the split cannot matter; global_buffered: fᵢ "
        "from a running buffer of this rank's micro-batches so far in the step (the paper's cheap form).",
    )

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} exceeds experts {self.experts}")
        return self


class GPTSpec(Spec):
    """nanoGPT-like: token + position embeddings, pre-LN blocks (causal attention, MLP), an untied head."""

    kind: Literal["gpt"] = "gpt"
    n_layer: Depth = 2
    n_head: Depth = 2
    n_embd: Width = 32
    dropout: float = Field(0.0, ge=0, lt=1)
    dropout_rng: Literal["indexed", "global"] = _DROPOUT_RNG
    moe: MoESpec | None = Field(None, description="Each block's MLP a mixture of experts (None: a dense MLP).")
    loss_parallel: bool = Field(False, description="tensor_parallel > 1: the head split by vocabulary, the loss on "
                                "the shards through torch's loss_parallel (torchtitan's default)")  # fmt: skip

    @model_validator(mode="after")
    def _check(self) -> GPTSpec:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        return self


# --- optimisation -----------------------------------------------------------------------------


class OptimizerSpec(Spec):
    name: Literal["adamw", "sgd", "muon", "torch_muon"] = Field(
        "adamw",
        description="muon: DeepSpeed's Muon (MuonWithAuxAdam) on every trainer — each matrix's momentum "
        "orthogonalised by Newton–Schulz, the rest (by DeepSpeed's rule) by torch's AdamW; torch_muon: "
        "torch.optim.Muon over the same matrices (its Newton–Schulz in bf16) and torch's AdamW, torch loops only.",
    )
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (after warmup); Muon: its matrices'.")
    weight_decay: float = Field(0.0, ge=0, description="Muon: both halves'.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW, and Muon's AdamW half.")
    eps: float = Field(1e-8, gt=0, description="AdamW (and Muon's half). Makes Adam *almost* scale-invariant.")
    momentum: float = Field(0.0, ge=0, description="SGD, and Muon's momentum (DeepSpeed's default 0.95).")
    adam_lr: float | None = Field(None, gt=0, description="Muon only: its AdamW half's peak lr (None: lr).")


class ScheduleSpec(Spec):
    name: Literal["constant", "warmup_cosine"] = "warmup_cosine"
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps (never micro-steps).")
    warmup_convention: Literal["gaeq", "transformers"] = Field(
        "gaeq",
        description="Where the linear warmup starts. gaeq: step s of the warmup runs at lr·(s+1)/warmup_steps "
        "(the peak at its last step); transformers: lr·s/warmup_steps — lr 0 at step 0, as transformers' "
        "get_linear/get_cosine_schedule_with_warmup (and the Trainer's warmup_steps) do. Every trainer of the "
        "matrix follows it, so Trainer cells with warmup share the baseline.",
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine floor as a fraction of the peak lr.")


def _kind(default: str):
    """Discriminator: `import` → plugin, `hf` → a transformers model, else `kind` (absent: the
    default built-in)."""

    def kind(value: Any) -> str:
        if isinstance(value, dict):
            if "import" in value or "import_" in value:
                return "plugin"
            return "hf" if "hf" in value else value.get("kind", default)
        return "plugin" if isinstance(value, PluginSpec) else getattr(value, "kind", default)

    return kind


ModelSpec = Annotated[
    Union[
        Annotated[MLPSpec, Tag("mlp")],
        Annotated[GPTSpec, Tag("gpt")],
        Annotated[HFModelSpec, Tag("hf")],
        Annotated[PluginSpec, Tag("plugin")],
    ],
    Discriminator(_kind("mlp")),
]
DataSpec = Annotated[
    Union[
        Annotated[RegressionSpec, Tag("regression")],
        Annotated[TokensSpec, Tag("tokens")],
        Annotated[DataPluginSpec, Tag("plugin")],
    ],
    Discriminator(_kind("regression")),
]
LossSpec = Union[Literal["mse", "cross_entropy", "hf", "policy_gradient"], PluginSpec]


class ProblemSpec(Spec):
    model: ModelSpec = MLPSpec()
    data: DataSpec = RegressionSpec()
    loss: LossSpec = Field(
        "mse",
        description="mse (per sample) or cross_entropy (per valid token), normalised over the global batch; hf: "
        "a transformers model's own loss, given the global batch's valid-token count as num_items_in_batch; "
        "policy_gradient: −advantage × log-probability of each completion token (data.completions), normalised "
        "over the global batch's completion tokens (DAPO's token-level mean).",
    )
    optimizer: OptimizerSpec = OptimizerSpec()
    schedule: ScheduleSpec = ScheduleSpec()
    gradient_clipping: float = Field(
        0.0, ge=0, description="Max global grad norm at the boundary; 0 disables. Set explicitly on every trainer."
    )
    deepspeed_config: dict[str, Any] | None = Field(
        None,
        description="Your own DeepSpeed config (in the matrix file: a path relative to it, JSON or YAML, or a "
        "mapping). DeepSpeed cells run it as it is, bar the split (docs/your-setup.md); the "
        "optimisation (optimizer, scheduler, gradient_clipping) then comes from it alone, mirrored on the torch side.",
    )
    script: ScriptSpec | None = Field(
        None,
        description="A script matrix's problem: the user's own training script, run unchanged under every split; "
        "written at the matrix's top level, with steps, train_batch_size and seed beside it.",
    )
    steps: int = Field(50, gt=0, le=1_000_000, description="Optimizer steps (not micro-steps).")
    seed: int = Field(0, ge=0, description="Seeds the model init and every sample (sample = f(seed, index)).")
    dtype: Dtype = Field("fp32", description="Compute dtype when the axes do not list dtypes.")
    train_batch_size: Samples = Field(description="Global batch B: samples per optimizer step, fixed for all cells.")
    epoch_end: Literal["run_on", "short_step"] = Field(
        "run_on",
        description="How a finite dataset's epoch (data.num_samples) ends. run_on: a step's batch runs on into the "
        "next epoch, so every step holds train_batch_size samples; short_step: as a DataLoader's epoch ends, with "
        "a step of its own holding the num_samples mod train_batch_size samples left, in fewer micro-steps — "
        "each of them still a share of that step's own samples (the trainers that run it: the registry's short_steps).",
    )

    @model_validator(mode="after")
    def _check(self) -> ProblemSpec:
        if self.schedule.warmup_steps > self.steps:
            raise ValueError(f"schedule.warmup_steps {self.schedule.warmup_steps} exceeds steps {self.steps}")
        pairs = {
            "mlp": ("regression", ("mse",)),
            "gpt": ("tokens", ("cross_entropy", "policy_gradient")),
            "hf": ("tokens", ("cross_entropy", "hf", "policy_gradient")),
        }
        scored = getattr(self.data, "completions", None) is not None
        if scored != (self.loss == "policy_gradient"):
            raise ValueError(
                "loss policy_gradient weighs completions by their advantages: it needs data.completions, and "
                f"data.completions needs it (loss {self.loss!r}, completions {'set' if scored else 'not set'})"
            )
        kind = getattr(self.model, "kind", None)
        if self.loss == "hf" and kind in ("mlp", "gpt"):  # a model plugin may return a transformers model
            raise ValueError(
                f"loss hf is a transformers model's own loss: model {kind} has none (model: "
                f"{{hf: <class>, config: {{...}}}})"
            )
        if kind in pairs:
            data_kind = getattr(self.data, "kind", None)
            want_data, want_loss = pairs[kind]
            if data_kind != want_data:
                raise ValueError(f"model {kind} trains on data kind {want_data}, got {data_kind or 'a plugin'}")
            if self.loss not in want_loss:
                raise ValueError(f"model {kind} needs loss {' or '.join(want_loss)}, got {self.loss!r}")
        return self

    @model_validator(mode="after")
    def _check_epoch_end(self) -> ProblemSpec:
        if self.epoch_end == "run_on":
            return self
        if self.num_samples is None:
            raise ValueError("epoch_end short_step ends a finite dataset's epoch: set data.num_samples")
        if self.num_samples <= self.train_batch_size:
            raise ValueError(
                f"epoch_end short_step: data.num_samples {self.num_samples} must exceed train_batch_size "
                f"{self.train_batch_size} (an epoch of one step never holds a full global batch)"
            )
        return self

    @model_validator(mode="after")
    def _check_deepspeed_config(self) -> ProblemSpec:
        if self.deepspeed_config is None:
            return self
        both = {"optimizer": "optimizer", "schedule": "scheduler", "gradient_clipping": "gradient_clipping"}
        for mine, theirs in both.items():
            if mine in self.model_fields_set:
                raise ValueError(
                    f"problem.{mine} and deepspeed_config.{theirs} both define the optimisation: with a "
                    f"deepspeed_config it comes from the file alone — remove problem.{mine}"
                )
        self.mirror  # noqa: B018 — parsed here: a ConfigError (a ValueError) names a key the torch side cannot mirror
        return self

    @cached_property
    def mirror(self):
        """The optimisation of :attr:`deepspeed_config` (:class:`gaeq.problem.dsconfig.Mirror`), or None.
        Parsed once per problem (the expander asks for it per cell, the trainers per object they build)."""
        from gaeq.problem.dsconfig import mirror

        return None if self.deepspeed_config is None else mirror(self.deepspeed_config)

    @property
    def num_samples(self) -> int | None:
        return self.data.num_samples
