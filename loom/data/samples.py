"""What every training sample set shares: samples are ``seq_len + 1``-token windows, drawn by
global index (``BatchSampler``).

A sample set defines ``window(i)`` (the int64 tokens of sample i) and ``seq_len``; this base
turns windows into the model's inputs and targets (the window shifted by one), one at a time or
as a batch. ``loader.PackedSequences`` (one token file) and ``mix.MixedSequences`` (several as
one index space) both build on it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class WindowedSamples:
    """Inputs and targets from ``window(i)``; subclasses set ``seq_len`` and define ``window``."""

    seq_len: int
    packing = "concat"  # data.packing: windows run across documents

    def window(self, i: int) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.window(int(i))
        return torch.from_numpy(w[:-1].copy()), torch.from_numpy(w[1:].copy())

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [len(indices), seq_len] (int64) of the given samples, in order."""
        if len(indices) == 0:
            empty = torch.empty(0, self.seq_len, dtype=torch.int64)
            return empty, empty.clone()
        windows = torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def rank_slice(indices: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """The dp_rank-th of dp_size contiguous, equal slices (rank slices concatenate to the whole)."""
    local = len(indices) // dp_size
    return indices[dp_rank * local : (dp_rank + 1) * local]


class BatchSampler:
    """What the samplers (``loader.GlobalBatchSampler``, ``mix.MixSampler``) share: a step
    consumes ``global_batch_size`` consecutive global indices, which ``indices`` maps to samples."""

    def __init__(self, global_batch_size: int, seed: int) -> None:
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.global_batch_size = global_batch_size
        self.seed = seed

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset sample indices of global indices start .. start + count - 1."""
        raise NotImplementedError

    def step_indices(self, consumed_samples: int) -> np.ndarray:
        """The global batch starting at global index ``consumed_samples``."""
        return self.indices(consumed_samples, self.global_batch_size)

    def rank_indices(self, consumed_samples: int, dp_rank: int, dp_size: int) -> np.ndarray:
        return rank_slice(self.step_indices(consumed_samples), dp_rank, dp_size)


__all__ = ["BatchSampler", "WindowedSamples", "rank_slice"]
