"""Alpha-beta times of the collectives the planner prices, on one link (``loom.plan.hardware.
Link``: ``latency`` alpha, ``effective_bandwidth`` beta; n ranks, M bytes): ring all-reduce
2(n-1)/n·M/beta + 2(n-1)·alpha or tree all-reduce 2·M/beta + 2·log2(n)·alpha, the cheaper (as
NCCL picks); all-gather / reduce-scatter and all-to-all (n-1)/n·M/beta + (n-1)·alpha;
point-to-point alpha + M/beta. Its own module so that the cost model's parts
(``cost_model``, ``vocab_cost``) share them without importing each other."""

from __future__ import annotations

import math
from typing import Any


def allreduce_time(nbytes: float, n: int, link: Any) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    beta = link.effective_bandwidth
    ring = 2 * (n - 1) / n * nbytes / beta + 2 * (n - 1) * link.latency
    tree = 2 * nbytes / beta + 2 * math.ceil(math.log2(n)) * link.latency
    return min(ring, tree)


def gather_time(nbytes: float, n: int, link: Any) -> float:
    """All-gather or reduce-scatter of ``nbytes`` (the full, gathered size)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.effective_bandwidth + (n - 1) * link.latency


all_to_all_time = gather_time  # the same alpha-beta form: (n-1)/n of the bytes cross, n-1 steps


def p2p_time(nbytes: float, link: Any) -> float:
    return link.latency + nbytes / link.effective_bandwidth


__all__ = ["all_to_all_time", "allreduce_time", "gather_time", "p2p_time"]
