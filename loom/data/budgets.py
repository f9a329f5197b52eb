"""A step's budgets in tokens and how whole pieces fill microbatches: plain numbers, no torch.

The data-path modes the config accepts (``PACKINGS``, ``BALANCES``), the resolution of varlen's
two token budgets, and the two ways varlen lays a step's pieces into microbatches (``first_fit``
in sampling order; ``balance_tokens``, longest first to the lightest). ``loom.data.varlen``
builds its batches with them and ``loom.data.zeppelin`` reuses the deal; they live apart so the
config rules and the planner use them without importing torch.
"""

from __future__ import annotations

import heapq

import numpy as np

PACKINGS = ("concat", "pack", "varlen")  # pack: loom/data/packing.py; varlen: loom/data/varlen.py
BALANCES = ("none", "tokens", "zeppelin")  # zeppelin: the tokens deal + cp placement


def token_budgets(global_batch_tokens: int, tokens_per_microbatch: int, global_batch_size: int,
                  micro_batch_size: int, seq_len: int) -> tuple[int, int]:
    """``(train.global_batch_tokens, data.tokens_per_microbatch)`` with 0 resolved: the tokens of
    ``global_batch_size`` (resp. ``micro_batch_size``) sequences of ``seq_len``, so that varlen
    alone trains as many tokens per step and microbatch as concat would."""
    return (global_batch_tokens or global_batch_size * seq_len,
            tokens_per_microbatch or micro_batch_size * seq_len)


def first_fit(lengths: np.ndarray, num_bins: int, budget: int) -> tuple[int, np.ndarray]:
    """Lay pieces of ``lengths`` (in order) into ``num_bins`` bins of ``budget`` (module
    docstring), each into the first bin with room: ``(taken, bin of each taken piece)``; the
    step ends before the first piece no bin has room for. ``taken == len(lengths)`` means every
    piece fitted and the step may hold more."""
    bins = np.empty(len(lengths), dtype=np.int64)
    free = np.full(num_bins, budget, dtype=np.int64)
    for i, n in enumerate(lengths.tolist()):
        if n > budget:
            raise ValueError(f"a piece of {n} predictions exceeds the microbatch budget {budget}")
        room = np.flatnonzero(free >= n)
        if not len(room):
            return i, bins[:i]
        bins[i] = room[0]
        free[room[0]] -= n
    return len(lengths), bins


def balance_tokens(lengths: np.ndarray, num_bins: int, budget: int) -> np.ndarray | None:
    """``data.balance = tokens``: longest piece first, each to the bin with the fewest
    predictions (ties: the lowest bin). None when a bin would exceed ``budget``."""
    heap = [(0, b) for b in range(num_bins)]
    bins = np.empty(len(lengths), dtype=np.int64)
    for i in np.argsort(-lengths, kind="stable").tolist():
        load, b = heapq.heappop(heap)
        load += int(lengths[i])
        if load > budget:
            return None
        bins[i] = b
        heapq.heappush(heap, (load, b))
    return bins


__all__ = ["PACKINGS", "BALANCES", "token_budgets", "first_fit", "balance_tokens"]
