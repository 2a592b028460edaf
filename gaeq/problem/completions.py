"""Token data as policy-gradient post-training sees it (``data.completions``, the schema's
CompletionsSpec): each sample a prompt, shared by its group, and a completion of its own, scored by a
reward; its targets are the completion's tokens, each carrying its sample's advantage.

A batch's targets hold both, ``(rows, seq_len, 2)`` float64 (integers below 2**53 are exact there):
channel LABEL the next token, or IGNORE_INDEX on the prompt and the padding (the generated-length
mask); channel ADVANTAGE the sample's advantage at every position — what the policy-gradient loss
(gaeq/problem/loss.py) reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gaeq.problem.data import IGNORE_INDEX, TokenData
from gaeq.problem.spec import TokensSpec

LABEL, ADVANTAGE = 0, 1
"""The two channels of a batch's targets."""
STD_EPS = 1e-4
"""GRPO's advantage: (r − mean) / (std + STD_EPS) over a group (TRL's default epsilon)."""


class CompletionData(TokenData):
    """Sample ``i`` belongs to group ``i // group_size``: its first ``prompt_len`` tokens are the group's
    prompt, the rest of its Markov walk (up to its length) its completion. The reward of a completion is
    the share of its tokens in the lower half of the vocabulary — a reward model's stand-in, a function
    of the completion alone; the advantage is that reward normalised over the group (unbiased std, as
    torch's ``std`` in GRPO trainers) — so a sample's advantage depends on its group, never on the split."""

    def __init__(self, spec: TokensSpec, *, seed: int) -> None:
        super().__init__(spec, seed=seed)
        self.prompt_len = spec.completions.prompt_len
        self.group_size = spec.completions.group_size

    def total_loss_elements(self, indices: Sequence[int]) -> int:
        # a completion's targets are its own tokens: a sample of L tokens has L − prompt_len
        return int(((self.lengths(indices) - self.prompt_len) * ~self.masked(indices)).sum())

    def rows(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        walks, starts = super().rows(indices)
        groups = np.asarray(indices, dtype=np.int64) // self.group_size
        walks[:, : self.prompt_len] = self.tokens(groups, stream=8)[:, : self.prompt_len]  # the group's prompt
        return walks, starts

    def rewards(self, indices: Sequence[int]) -> np.ndarray:
        walks, _ = self.rows(indices)
        t = np.arange(walks.shape[1])
        completion = (t >= self.prompt_len) & (t < self.lengths(indices)[:, None])
        return ((walks < self.vocab_size // 2) & completion).sum(axis=1) / completion.sum(axis=1)

    def advantages(self, indices: Sequence[int]) -> np.ndarray:
        """Each sample's reward normalised over its group (every member scored, wherever it is trained)."""
        groups = np.asarray(indices, dtype=np.int64) // self.group_size
        unique = np.unique(groups)
        members = (unique[:, None] * self.group_size + np.arange(self.group_size)).ravel()
        r = self.rewards(members).reshape(len(unique), self.group_size)
        a = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, ddof=1, keepdims=True) + STD_EPS)
        of = dict(zip(members.tolist(), a.ravel().tolist()))
        return np.array([of[int(i)] for i in indices], dtype=np.float64)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, labels = super().batch(indices)
        labels[:, : self.prompt_len - 1] = IGNORE_INDEX  # positions that predict the prompt: no target
        advantages = torch.from_numpy(self.advantages(indices))[:, None].expand(labels.shape)
        return inputs, torch.stack([labels.double(), advantages], dim=-1)
