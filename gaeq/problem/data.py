"""Index-addressed data and the BatchPlan: which samples each (step, micro-step, rank) sees.

For a fixed global batch B, optimizer step ``s`` must see the same B samples whatever the split,
so samples are addressed by global position, never by "the next batch of a loader"::

    global batch of step s     = positions [s*B, (s+1)*B)
    micro-step k, rank r gets  = that batch[(k*world + r)*micro : (k*world + r + 1)*micro]
    grad_accum_steps           = B // (micro * world)          derived, never chosen

A position maps to a sample index (itself for an endless stream, or a seeded permutation per
epoch for a finite dataset), and a sample is a pure function of (seed, index).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np
import torch

from gaeq.matrix import indivisible_message
from gaeq.problem.spec import RegressionSpec, TokensSpec


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    train_batch_size: int
    micro_batch_size: int
    world_size: int
    num_samples: int | None = None
    """Finite dataset size (positions walk a per-epoch permutation), or None for an endless stream."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "micro_batch_size", "world_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.train_batch_size % (self.micro_batch_size * self.world_size):
            raise ValueError(
                indivisible_message(
                    train_batch_size=self.train_batch_size,
                    micro_batch_size=self.micro_batch_size,
                    world_size=self.world_size,
                )
            )

    @property
    def grad_accum_steps(self) -> int:
        return self.train_batch_size // (self.micro_batch_size * self.world_size)

    def positions(self, *, step: int, micro_step: int, rank: int) -> range:
        """Global positions of the micro-batch that `rank` processes at (`step`, `micro_step`)."""
        if not 0 <= micro_step < self.grad_accum_steps:
            raise ValueError(f"micro_step {micro_step} outside [0, {self.grad_accum_steps})")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        start = step * self.train_batch_size + (micro_step * self.world_size + rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def sample_indices(self, *, step: int, micro_step: int, rank: int) -> list[int]:
        return [self.sample_at(p) for p in self.positions(step=step, micro_step=micro_step, rank=rank)]

    def sample_at(self, position: int) -> int:
        if self.num_samples is None:
            return position
        epoch, offset = divmod(position, self.num_samples)
        return int(_epoch_permutation(self.seed, epoch, self.num_samples)[offset])


@lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, 0x5EED, epoch]).permutation(n)


class Dataset(Protocol):
    """What a data source (built-in or plugin) offers: samples by global index.

    ``loss_elements`` is how many elements of sample `index` the loss averages over (1 for a
    per-sample loss, the valid-token count for a token loss). It must be cheap: the trainers sum
    it over a whole global batch to know the normaliser up front. Optional for plugins (default 1).
    """

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def loss_elements(self, index: int) -> int: ...


class RegressionData:
    """Noisy targets of a fixed random two-layer teacher: y = scale * tanh(x W1) W2 + noise.

    Sample ``i`` depends only on (seed, i), so any process can build any micro-batch on its own.
    """

    def __init__(self, spec: RegressionSpec, *, seed: int) -> None:
        self.seed = seed
        self.spec = spec
        self.in_features = spec.in_features
        self.out_features = spec.out_features
        hidden = 4 * spec.in_features
        teacher = np.random.default_rng([seed, 0x7EAC])
        self._w1 = teacher.standard_normal((spec.in_features, hidden)) / np.sqrt(spec.in_features)
        self._w2 = teacher.standard_normal((hidden, spec.out_features)) / np.sqrt(hidden)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0xDA7A, index])
        x = rng.standard_normal(self.in_features)
        y = self.spec.target_scale * np.tanh(x @ self._w1) @ self._w2
        return x, y + self.spec.noise * rng.standard_normal(self.out_features)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self.sample(i) for i in indices))
        return (
            torch.from_numpy(np.stack(xs)).to(torch.float32),
            torch.from_numpy(np.stack(ys)).to(torch.float32),
        )

    def loss_elements(self, index: int) -> int:
        return 1


IGNORE_INDEX = -100
"""Label of padding positions: no loss, no gradient (torch's cross-entropy default)."""


class TokenData:
    """Variable-length sequences from a seeded Markov chain over `vocab_size` tokens.

    Sample ``i`` has ``L_i`` tokens (min_len ≤ L_i ≤ seq_len + 1); inputs are tokens[:-1], labels
    tokens[1:], both right-padded to ``seq_len`` (labels with IGNORE_INDEX). Causal attention means
    padding never influences a valid position, so ``L_i - 1`` tokens count toward the loss.
    """

    def __init__(self, spec: TokensSpec, *, seed: int) -> None:
        self.seed = seed
        self.vocab_size = spec.vocab_size
        self.seq_len = spec.seq_len
        self.min_len = spec.min_len
        logits = 2.5 * np.random.default_rng([seed, 0x70CE]).standard_normal((spec.vocab_size, spec.vocab_size))
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        self._cumulative = np.cumsum(probs / probs.sum(axis=1, keepdims=True), axis=1)

    def length(self, index: int) -> int:
        return int(np.random.default_rng([self.seed, 0x1E9, index]).integers(self.min_len, self.seq_len + 2))

    def loss_elements(self, index: int) -> int:
        return self.length(index) - 1

    def tokens(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0xDA7A, index])
        out = np.empty(self.length(index), dtype=np.int64)
        out[0] = rng.integers(self.vocab_size)
        for t, u in enumerate(rng.random(len(out) - 1), start=1):
            out[t] = min(int(np.searchsorted(self._cumulative[out[t - 1]], u)), self.vocab_size - 1)
        return out

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = np.zeros((len(indices), self.seq_len), dtype=np.int64)
        labels = np.full((len(indices), self.seq_len), IGNORE_INDEX, dtype=np.int64)
        for row, index in enumerate(indices):
            seq = self.tokens(index)
            inputs[row, : len(seq) - 1] = seq[:-1]
            labels[row, : len(seq) - 1] = seq[1:]
        return torch.from_numpy(inputs), torch.from_numpy(labels)
