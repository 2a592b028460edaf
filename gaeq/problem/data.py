"""Index-addressed data and the BatchPlan: which samples each (step, micro-step, rank) sees.

For a fixed global batch B, optimizer step ``s`` must see the same B samples whatever the split,
so samples are addressed by global position, never by "the next batch of a loader"::

    global batch of step s     = positions [s*B, (s+1)*B)
    micro-step k, rank r gets  = that batch[(k*world + r)*micro : (k*world + r + 1)*micro]
    grad_accum_steps           = B // (micro * world)          derived, never chosen

(With ``epoch_end: short_step`` a finite dataset's epoch ends with a step of its own, holding the
samples left in fewer micro-steps — :meth:`BatchPlan.step_positions`.)

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

from gaeq.problem.spec import RegressionSpec, TokensSpec
from gaeq.problem.split import indivisible_message, short_step_message


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    train_batch_size: int
    micro_batch_size: int
    data_parallel: int
    """Ranks that see different samples (the world ÷ tensor parallel): a step's batch is split over them."""
    num_samples: int | None = None
    """Finite dataset size (positions walk a per-epoch permutation), or None for an endless stream."""
    short_steps: bool = False
    """A finite dataset's epoch ends with a step of its own, holding the samples left (num_samples mod
    train_batch_size) in fewer micro-steps; False: a step's batch runs on into the next epoch."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "micro_batch_size", "data_parallel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.train_batch_size % (self.micro_batch_size * self.data_parallel):
            raise ValueError(
                indivisible_message(
                    train_batch_size=self.train_batch_size,
                    micro_batch_size=self.micro_batch_size,
                    world_size=self.data_parallel,
                )
            )
        if self.short_steps:
            if self.num_samples is None:
                raise ValueError("short last steps end a finite dataset's epoch: data.num_samples is needed")
            message = short_step_message(
                num_samples=self.num_samples,
                train_batch_size=self.train_batch_size,
                micro_batch_size=self.micro_batch_size,
                data_parallel=self.data_parallel,
            )
            if message:
                raise ValueError(message)

    @property
    def grad_accum_steps(self) -> int:
        """Micro-steps of a full step."""
        return self.train_batch_size // (self.micro_batch_size * self.data_parallel)

    def step_positions(self, step: int) -> range:
        """Global positions of `step`'s batch: train_batch_size of them, but an epoch's short last step."""
        if not self.short_steps:
            return range(step * self.train_batch_size, (step + 1) * self.train_batch_size)
        epoch, within = divmod(step, -(-self.num_samples // self.train_batch_size))
        start = epoch * self.num_samples + within * self.train_batch_size
        return range(start, min(start + self.train_batch_size, (epoch + 1) * self.num_samples))

    def micro_steps(self, step: int) -> int:
        """Micro-steps of `step`: GA, or fewer at an epoch's short last step (its last micro-batch
        may be short too, on one data-parallel rank)."""
        return -(-len(self.step_positions(step)) // (self.micro_batch_size * self.data_parallel))

    def first_short_step(self) -> int | None:
        """The first step with fewer micro-steps than GA — the first epoch's last, every epoch being
        laid out alike — or None (no short steps, or a last step short by less than a round of micro-batches)."""
        if not self.short_steps:
            return None
        last = -(-self.num_samples // self.train_batch_size) - 1
        return last if self.micro_steps(last) != self.grad_accum_steps else None

    def positions(self, *, step: int, micro_step: int, rank: int) -> range:
        """Global positions of the micro-batch that data-parallel `rank` processes at (`step`, `micro_step`)."""
        if not 0 <= micro_step < self.micro_steps(step):
            raise ValueError(f"micro_step {micro_step} outside [0, {self.micro_steps(step)})")
        if not 0 <= rank < self.data_parallel:
            raise ValueError(f"rank {rank} outside [0, {self.data_parallel})")
        batch = self.step_positions(step)
        start = batch.start + (micro_step * self.data_parallel + rank) * self.micro_batch_size
        return range(start, min(start + self.micro_batch_size, batch.stop))

    def sample_indices(self, *, step: int, micro_step: int, rank: int) -> list[int]:
        return self.samples_at(self.positions(step=step, micro_step=micro_step, rank=rank))

    def sample_at(self, position: int) -> int:
        if self.num_samples is None:
            return position
        epoch, offset = divmod(position, self.num_samples)
        return int(_epoch_permutation(self.seed, epoch, self.num_samples)[offset])

    def samples_at(self, positions: range) -> list[int]:
        """:meth:`sample_at` of a run of consecutive positions, one slice of a permutation per epoch
        it spans (what every micro-batch and every step's normaliser asks for)."""
        if self.num_samples is None:
            return list(positions)
        indices: list[int] = []
        position = positions.start
        while position < positions.stop:
            epoch, offset = divmod(position, self.num_samples)
            stop = min(positions.stop - position, self.num_samples - offset) + offset
            indices += _epoch_permutation(self.seed, epoch, self.num_samples)[offset:stop].tolist()
            position += stop - offset
        return indices


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


def hashed_uniform(seed: int, stream: int, index: np.ndarray, count: int) -> np.ndarray:
    """`count` uniforms in (0, 1) for every index, each a pure function of (seed, stream, index, j).

    A splitmix64 hash of the coordinates, vectorised over the whole batch: a micro-batch costs one
    numpy call, not one generator per sample.
    """
    j = np.arange(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (np.asarray(index, dtype=np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15)) ^ (
            j[None, :] * np.uint64(0xBF58476D1CE4E5B9)
        )
        z ^= np.uint64((seed * 0x94D049BB133111EB + stream * 0x2545F4914F6CDD1D) % 2**64)
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> np.uint64(shift))) * np.uint64(mult)
        z ^= z >> np.uint64(31)
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53


def hashed_normal(seed: int, stream: int, index: np.ndarray, count: int) -> np.ndarray:
    """Standard normals by Box–Muller over :func:`hashed_uniform` pairs."""
    u = hashed_uniform(seed, stream, index, 2 * count)
    return np.sqrt(-2.0 * np.log(u[:, :count])) * np.cos(2.0 * np.pi * u[:, count:])


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

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = np.asarray(indices, dtype=np.uint64)
        x = hashed_normal(self.seed, 1, index, self.in_features)
        noise = hashed_normal(self.seed, 2, index, self.out_features)
        y = self.spec.target_scale * np.tanh(x @ self._w1) @ self._w2 + self.spec.noise * noise
        return torch.from_numpy(x).to(torch.float32), torch.from_numpy(y).to(torch.float32)

    def loss_elements(self, index: int) -> int:
        return 1

    def total_loss_elements(self, indices: Sequence[int]) -> int:
        return len(indices)


IGNORE_INDEX = -100
"""Label of padding positions: no loss, no gradient (torch's cross-entropy default)."""


class TokenData:
    """Variable-length sequences from a seeded Markov chain over `vocab_size` tokens.

    Sample ``i`` has ``L_i`` tokens (min_len ≤ L_i ≤ seq_len + 1); inputs are tokens[:-1], labels
    tokens[1:], both right-padded to ``seq_len`` (labels with IGNORE_INDEX). Causal attention means
    padding never influences a valid position, so ``L_i - 1`` tokens count toward the loss.
    Packed (TokensSpec.packed), a row holds several documents end to end and each document's last
    token predicts nothing: a pack of k documents and L_i tokens has ``L_i - k`` targets.
    """

    def __init__(self, spec: TokensSpec, *, seed: int) -> None:
        self.seed = seed
        self.vocab_size = spec.vocab_size
        self.seq_len = spec.seq_len
        self.min_len = spec.min_len
        self.masked_every = spec.masked_every
        self.packed = spec.packed
        logits = 2.5 * np.random.default_rng([seed, 0x70CE]).standard_normal((spec.vocab_size, spec.vocab_size))
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        self._cumulative = np.cumsum(probs / probs.sum(axis=1, keepdims=True), axis=1)

    def lengths(self, indices: Sequence[int]) -> np.ndarray:
        """Tokens of each sample's row (before the shift by one): a sequence's length, or a pack's
        documents laid end to end."""
        if self.packed:
            return self.documents(indices).sum(axis=1)
        u = hashed_uniform(self.seed, 3, np.asarray(indices, dtype=np.uint64), 1)[:, 0]
        return self.min_len + np.floor(u * (self.seq_len + 2 - self.min_len)).astype(np.int64)

    def documents(self, indices: Sequence[int]) -> np.ndarray:
        """Packed data: the lengths of each pack's documents, one row per index, zero past its last
        document (the first that would not fit in seq_len + 1 tokens ends the pack)."""
        longest = max(self.min_len, (self.seq_len + 1) // 2)
        most = (self.seq_len + 1) // self.min_len
        u = hashed_uniform(self.seed, 5, np.asarray(indices, dtype=np.uint64), most)
        lengths = self.min_len + np.floor(u * (longest + 1 - self.min_len)).astype(np.int64)
        fits = np.cumsum(lengths, axis=1) <= self.seq_len + 1
        return lengths * np.cumprod(fits, axis=1)

    def length(self, index: int) -> int:
        return int(self.lengths([index])[0])

    def masked(self, indices: Sequence[int]) -> np.ndarray:
        """Which samples have no valid label (TokensSpec.masked_every)."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.masked_every is None:
            return np.zeros(len(indices), dtype=bool)
        return indices % self.masked_every == self.masked_every - 1

    def loss_elements(self, index: int) -> int:
        return self.total_loss_elements([index])

    def total_loss_elements(self, indices: Sequence[int]) -> int:
        # a sequence of n tokens has n - 1 targets; a pack, one fewer per document
        targets = self.lengths(indices) - ((self.documents(indices) > 0).sum(axis=1) if self.packed else 1)
        return int((targets * ~self.masked(indices)).sum())

    def tokens(self, indices: Sequence[int], *, stream: int = 4) -> np.ndarray:
        """Full-length Markov walks, one row per index (row i is then cut at its length)."""
        u = hashed_uniform(self.seed, stream, np.asarray(indices, dtype=np.uint64), self.seq_len + 1)
        out = np.empty(u.shape, dtype=np.int64)
        out[:, 0] = np.minimum((u[:, 0] * self.vocab_size).astype(np.int64), self.vocab_size - 1)
        for t in range(1, u.shape[1]):
            cumulative = self._cumulative[out[:, t - 1]]  # (rows, vocab)
            out[:, t] = np.minimum((cumulative < u[:, t : t + 1]).sum(axis=1), self.vocab_size - 1)
        return out

    def rows(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's tokens (seq_len + 1 per row, valid up to its length) and whether each token
        starts a document (a pack's documents are walks of their own; a sequence is one document)."""
        if not self.packed:
            starts = np.zeros((len(indices), self.seq_len + 1), dtype=bool)
            starts[:, 0] = True
            return self.tokens(indices), starts
        documents = self.documents(indices)
        most = documents.shape[1]
        keys = np.asarray(indices, dtype=np.int64)[:, None] * most + np.arange(most)  # one walk per document
        walks = self.tokens(keys.ravel(), stream=6).reshape(len(indices), most, -1)
        rows = np.zeros((len(indices), self.seq_len + 1), dtype=np.int64)
        starts = np.zeros(rows.shape, dtype=bool)
        for row, lengths in enumerate(documents):
            at = 0
            for document, n in enumerate(lengths[lengths > 0]):
                rows[row, at : at + n] = walks[row, document, :n]
                starts[row, at] = True
                at += n
        return rows, starts

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = self.lengths(indices)
        walks, starts = self.rows(indices)
        inputs = np.zeros((len(indices), self.seq_len), dtype=np.int64)
        labels = np.full((len(indices), self.seq_len), IGNORE_INDEX, dtype=np.int64)
        for row, (n, masked) in enumerate(zip(lengths, self.masked(indices))):
            inputs[row, : n - 1] = walks[row, : n - 1]
            if not masked:
                labels[row, : n - 1] = np.where(starts[row, 1:n], IGNORE_INDEX, walks[row, 1:n])  # not across documents
        return torch.from_numpy(inputs), torch.from_numpy(labels)
