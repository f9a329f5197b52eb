"""What every training sample set shares: samples are ``seq_len + 1``-token windows.

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


__all__ = ["WindowedSamples"]
