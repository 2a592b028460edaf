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

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from gaeq.matrix import DataSpec, ModelSpec, indivisible_message


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


class RegressionData:
    """Noisy targets of a fixed random two-layer teacher: y = tanh(x W1) W2 + noise.

    Sample ``i`` depends only on (seed, i), so any process can build any micro-batch on its own.
    """

    def __init__(self, *, data: DataSpec, model: ModelSpec, seed: int) -> None:
        self.seed = seed
        self.noise = data.noise
        self.in_features = model.in_features
        teacher = np.random.default_rng([seed, 0x7EAC])
        self._w1 = teacher.standard_normal((model.in_features, model.hidden)) / np.sqrt(model.in_features)
        self._w2 = teacher.standard_normal((model.hidden, model.out_features)) / np.sqrt(model.hidden)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0xDA7A, index])
        x = rng.standard_normal(self.in_features)
        y = np.tanh(x @ self._w1) @ self._w2 + self.noise * rng.standard_normal(self._w2.shape[1])
        return x, y

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self.sample(i) for i in indices))
        return (
            torch.from_numpy(np.stack(xs)).to(torch.float32),
            torch.from_numpy(np.stack(ys)).to(torch.float32),
        )
