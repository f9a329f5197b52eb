"""Alpha-beta times of the collectives the planner prices, on one link (``loom.plan.hardware.
Link``: ``latency`` alpha, ``effective_bandwidth`` beta; n ranks, M bytes): ring all-reduce
2(n-1)/n·M/beta + 2(n-1)·alpha or tree all-reduce 2·M/beta + 2·log2(n)·alpha, the cheaper (as
NCCL picks); all-gather / reduce-scatter and all-to-all (n-1)/n·M/beta + (n-1)·alpha (an
all-to-all spanning nodes: its intra- and inter-node shares on their own links at once);
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


def spanning_all_to_all_time(nbytes: float, n: int, stride: int, cluster: Any) -> float:
    """All-to-all of ``nbytes`` per rank among ``n`` ranks ``stride`` apart on ``cluster``
    (``Cluster.link_for``). An all-to-all is pairwise sends, 1/n of the bytes to each member
    (NCCL posts them all at once; no ring): where the group spans nodes, the share for the
    members in a rank's own node crosses the intra-node link while the rest crosses its NIC,
    concurrently, so the slower share sets the time. A ring collective is bound by its slowest
    hop instead, which is why ``gather_time`` prices all of its bytes on the inter-node link."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = cluster.link_for(n, stride)
    members = min(n, max(1, cluster.gpus_per_node // stride))  # of the group, in one node
    if members >= n:
        return all_to_all_time(nbytes, n, link)
    inside = (members - 1) / n * nbytes / cluster.intra.effective_bandwidth
    outside = (n - members) / n * nbytes / link.effective_bandwidth
    return max(inside, outside) + (n - 1) * link.latency


def p2p_time(nbytes: float, link: Any) -> float:
    return link.latency + nbytes / link.effective_bandwidth


__all__ = ["all_to_all_time", "allreduce_time", "gather_time", "p2p_time",
           "spanning_all_to_all_time"]
