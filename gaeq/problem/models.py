"""Built-in models. Built from a seed so every rank and every cell starts from the same weights.

Dropout is the one place where a model consumes randomness per sample. With ``dropout_rng:
indexed`` each sample's mask is a pure function of (seed, global position, layer), so it is the
same whatever micro-batch or rank the sample lands in; the trainers publish the positions of the
current micro-batch with :func:`sample_keys`. ``dropout_rng: global`` is plain ``nn.Dropout``
(torch's global RNG): its masks depend on the split — one of the pitfalls the lab must catch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextvars import ContextVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gaeq.rows as rows
from gaeq.problem.spec import GPTSpec, MLPSpec

_SAMPLE_KEYS: ContextVar[Sequence[int] | None] = ContextVar("gaeq_sample_keys", default=None)


class sample_keys:  # noqa: N801  (a context manager, named as one is called)
    """Global positions of the micro-batch being forwarded (for split-invariant dropout): `with sample_keys(keys):`.
    A class, not a generator: it is entered around every forward pass."""

    __slots__ = ("keys", "token")

    def __init__(self, keys: Sequence[int]) -> None:
        self.keys = keys

    def __enter__(self) -> None:
        self.token = _SAMPLE_KEYS.set(self.keys)

    def __exit__(self, *exc: object) -> None:
        _SAMPLE_KEYS.reset(self.token)


def _keys_following(order: list[int]) -> contextlib.AbstractContextManager:
    """The current sample keys put in `order`, as rows reordered carry them (gaeq.rows.ROW_STATE)."""
    keys = _SAMPLE_KEYS.get()
    if keys is None or len(keys) != len(order):
        return contextlib.nullcontext()
    return sample_keys([keys[i] for i in order])


rows.ROW_STATE.append(_keys_following)


class IndexedDropout(nn.Module):
    """Dropout whose mask for a sample depends only on (seed, its global position, this layer)."""

    def __init__(self, p: float, *, seed: int, layer: int) -> None:
        super().__init__()
        self.p, self.seed, self.layer = p, seed, layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keys = _SAMPLE_KEYS.get()
        if keys is None or len(keys) != x.shape[0]:
            raise RuntimeError("IndexedDropout needs the micro-batch's sample positions: forward inside sample_keys()")
        masks = []
        for key in keys:
            state = np.random.SeedSequence([self.seed, 0xD50, self.layer, key]).generate_state(1)[0]
            masks.append(torch.rand(x.shape[1:], generator=torch.Generator().manual_seed(int(state))))
        keep = (torch.stack(masks) >= self.p).to(device=x.device, dtype=x.dtype)
        return x * keep / (1 - self.p)


def _dropout(p: float, rng: str, *, seed: int, layer: int) -> nn.Module:
    if p == 0:
        return nn.Identity()
    return IndexedDropout(p, seed=seed, layer=layer) if rng == "indexed" else nn.Dropout(p)


class MLP(nn.Module):
    """A tiny tanh MLP for the regression data; optional norm and dropout after each hidden layer."""

    def __init__(self, spec: MLPSpec, *, in_features: int, out_features: int, seed: int) -> None:
        super().__init__()
        widths = [in_features] + [spec.hidden] * spec.depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        norm = {"none": lambda n: nn.Identity(), "layer": nn.LayerNorm, "batch": nn.BatchNorm1d}[spec.norm]
        self.norms = nn.ModuleList(norm(spec.hidden) for _ in range(spec.depth))
        self.drops = nn.ModuleList(
            _dropout(spec.dropout, spec.dropout_rng, seed=seed, layer=i) for i in range(spec.depth)
        )
        self.head = nn.Linear(widths[-1], out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm, drop in zip(self.hidden, self.norms, self.drops):
            x = drop(torch.tanh(norm(layer(x))))
        return self.head(x)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection in Megatron's layout: each
    head's q, k and v rows sit together (``qkv.weight`` = [q₀ k₀ v₀ q₁ k₁ v₁ …]), so a column-wise
    tensor-parallel shard of ``qkv`` holds whole heads and the forward works on any number of them."""

    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.head_dim = spec.n_embd // spec.n_head
        self.qkv = nn.Linear(spec.n_embd, 3 * spec.n_embd)
        self.proj = nn.Linear(spec.n_embd, spec.n_embd)
        self.attend = causal_attention
        """(q, k, v) → attention output, each (batch, tokens, heads, head_dim): over the tokens given —
        or, with sequence parallelism, over the whole sequence of which they are this rank's slice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1: the heads this rank holds (all of them without tensor parallelism)
        q, k, v = self.qkv(x).view(b, t, -1, 3, self.head_dim).unbind(3)
        return self.proj(self.attend(q, k, v).reshape(b, t, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (batch, tokens, heads, head_dim) tensors, in the same layout."""
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)


def _mlp(n_embd: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_embd, hidden), nn.GELU(), nn.Linear(hidden, n_embd))


class MoE(nn.Module):
    """A mixture of experts in place of a block's MLP (gaeq/problem/moe.py computes its balance loss).

    Every forward leaves what the load-balancing loss needs in :attr:`stats`: how many of the
    forward's tokens each expert took (its top-k choices, counted: no gradient), the sum of each
    expert's router probability over them (with gradient) and the token count; :attr:`routed` adds
    up the counts over the cell (``ran``: router tokens per expert)."""

    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        moe = spec.moe
        self.top_k = moe.top_k
        self.router = nn.Linear(spec.n_embd, moe.experts, bias=False)
        # experts of the dense MLP's width ÷ top_k: a token's compute the dense block's
        self.experts = nn.ModuleList(_mlp(spec.n_embd, 4 * spec.n_embd // moe.top_k) for _ in range(moe.experts))
        self.stats: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.routed = torch.zeros(moe.experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(dim=-1)  # (b, t, experts)
        top, chosen = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(dim=-1, keepdim=True))
        # dense: every expert on every token, weighted by its gate (0 where not chosen) — exact, tiny
        out = sum(gates[..., e : e + 1] * expert(x) for e, expert in enumerate(self.experts))
        counts = torch.bincount(chosen.flatten().cpu(), minlength=len(self.experts))
        self.stats = (counts, probs.flatten(0, -2).sum(dim=0), probs.shape[0] * probs.shape[1])
        if torch.is_grad_enabled():
            self.routed += counts
        return out


class Block(nn.Module):
    def __init__(self, spec: GPTSpec, *, seed: int, index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(spec.n_embd)
        self.attn = CausalSelfAttention(spec)
        self.ln_2 = nn.LayerNorm(spec.n_embd)
        self.mlp = _mlp(spec.n_embd, 4 * spec.n_embd) if spec.moe is None else MoE(spec)
        self.drop_attn = _dropout(spec.dropout, spec.dropout_rng, seed=seed, layer=2 * index + 1)
        self.drop_mlp = _dropout(spec.dropout, spec.dropout_rng, seed=seed, layer=2 * index + 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_attn(self.attn(self.ln_1(x)))
        return x + self.drop_mlp(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """nanoGPT-shaped: token + position embeddings, pre-LN blocks, final LN, linear head.

    The head is not tied to the token embedding: shared parameters would add a ZeRO-3 corner case
    that has nothing to do with gradient accumulation.
    """

    tp_plan = {  # Megatron's split (gaeq/problem/tp.py): one all-reduce per attention and per MLP
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }

    def __init__(self, spec: GPTSpec, *, vocab_size: int, block_size: int, seed: int) -> None:
        super().__init__()
        if spec.loss_parallel:  # the head split by vocabulary, its logits left sharded (loss_parallel)
            self.tp_plan = self.tp_plan | {"head": "vocab"}
        self.wte = nn.Embedding(vocab_size, spec.n_embd)
        self.wpe = nn.Embedding(block_size, spec.n_embd)
        self.drop = _dropout(spec.dropout, spec.dropout_rng, seed=seed, layer=0)
        self.blocks = nn.ModuleList(Block(spec, seed=seed, index=i) for i in range(spec.n_layer))
        self.ln_f = nn.LayerNorm(spec.n_embd)
        self.head = nn.Linear(spec.n_embd, vocab_size, bias=False)
        self.position_offset = 0
        """Where the tokens it is given start in their sequence (a sequence-parallel rank's slice)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        start = self.position_offset
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Embeddings(nn.Module):
    """A GPT's token and position embeddings as a layer of their own: a pipeline's first layer."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))


class Head(nn.Module):
    """A GPT's final norm and head as a layer of their own: a pipeline's last layer."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


def gpt_layers(gpt: GPT) -> list[nn.Module]:
    """The GPT as the layer list a pipeline cuts (the very modules of `gpt`: the same weights)."""
    return [Embeddings(gpt), *gpt.blocks, Head(gpt)]


def gpt_stage(gpt: GPT, *, index: int, count: int) -> nn.Sequential:
    """Stage `index` of `count` (gaeq/problem/stages.py): the embeddings with the first, its blocks,
    the head with the last."""
    from gaeq.problem.stages import blocks_of

    layers, blocks = gpt_layers(gpt), blocks_of(len(gpt.blocks), count)[index]
    start = 0 if index == 0 else 1 + blocks.start
    stop = len(layers) if index == count - 1 else 1 + blocks.stop
    return nn.Sequential(*layers[start:stop])


def gpt_boundaries(gpt: GPT, inputs: torch.Tensor, *, count: int) -> list[torch.Tensor]:
    """What crosses each cut of `count` stages, as empty tensors of its shape and dtype: the token
    ids into the first stage, the hidden states between stages (they carry a gradient back), the
    logits out of the last — a pipeline stage told them needs no forward to infer them."""
    rows, seq = inputs.shape
    hidden = torch.empty(rows, seq, gpt.wte.embedding_dim, device=inputs.device, requires_grad=True)
    logits = torch.empty(rows, seq, gpt.head.out_features, device=inputs.device, requires_grad=True)
    return [torch.empty_like(inputs), *(hidden for _ in range(count - 1)), logits]
