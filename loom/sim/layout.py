"""The planner's vocabulary for pricing a ``loom.layout.Layout``: the parallel wrappers it runs
its layers through (``wrappers``, the names the calibration measures), the schedule families'
peak microbatches in flight, and alpha-beta times of the collectives. The cost model
(``loom.sim.cost_model``) is the arithmetic over it.

Collectives (n ranks, M bytes, alpha latency, beta the link's effective bandwidth): ring
all-reduce 2(n-1)/n·M/beta + 2(n-1)·alpha, tree all-reduce 2·M/beta + 2·log2(n)·alpha (the cheaper
is used, as NCCL picks), all-gather / reduce-scatter / all-to-all (n-1)/n·M/beta + (n-1)·alpha,
point-to-point alpha + M/beta.
"""

from __future__ import annotations

import math

from loom.layout import Layout


def wrappers(lay: Layout) -> tuple[str, ...]:
    """The parallel wrappers a layout runs its layers through, by the names the calibration
    measures their framework work under (``Gpu.framework``): "base" always (Loom's trainer with
    data parallelism), then DTensor tensor parallelism, ZeRO-3's FSDP2 units, ZeRO-2's
    gradient hooks and buckets or ZeRO-1's buckets after the backward, ring and/or Ulysses
    attention, and the pipeline interpreter."""
    names = ["base"]
    if lay.tp > 1:
        names.append("tp")
    if lay.dp_shard > 1 and lay.zero_stage:
        names.append(f"zero{lay.zero_stage}")
    if lay.cp > 1:
        if lay.cp_mode in ("ring", "hybrid"):
            names.append("ring")
        if lay.cp_mode in ("ulysses", "hybrid"):
            names.append("ulysses")
    if lay.pp > 1:
        names.append("pp")
    return tuple(names)


# Peak microbatches in flight on the worst rank, in units of one rank's microbatch (a chunk of v
# weighs 1/v), for m >= p (dualpipev: m >= 2p); the validator's accounting. Checked against
# ``loom.schedule.validate.peak_memory`` in tests/unit/plan/test_cost_model.py.
PEAK_IN_FLIGHT = {
    "gpipe": lambda p, m, v: m,
    "looped_bfs": lambda p, m, v: m,
    "1f1b": lambda p, m, v: p,
    "zb_h1": lambda p, m, v: p,
    "zbv": lambda p, m, v: p,
    "hanayo": lambda p, m, v: p,
    # m a multiple of p (Megatron's rule; the planner's space keeps to it): at m = p every
    # microbatch is in flight at once
    "interleaved_1f1b": lambda p, m, v: p if m == p else p + (p - 1) / v,
    "zb_h2": lambda p, m, v: min(2 * p - 1, m),
    "v_half": lambda p, m, v: p // 2 + 1,
    "v_min": lambda p, m, v: (p - 1) // 3 + 2,
    "dualpipev": lambda p, m, v: p + 0.5,
}


def allreduce_time(nbytes: float, n: int, link) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    beta = link.effective_bandwidth
    ring = 2 * (n - 1) / n * nbytes / beta + 2 * (n - 1) * link.latency
    tree = 2 * nbytes / beta + 2 * math.ceil(math.log2(n)) * link.latency
    return min(ring, tree)


def gather_time(nbytes: float, n: int, link) -> float:
    """All-gather or reduce-scatter of ``nbytes`` (the full, gathered size)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.effective_bandwidth + (n - 1) * link.latency


all_to_all_time = gather_time  # the same alpha-beta form: (n-1)/n of the bytes cross, n-1 steps


def p2p_time(nbytes: float, link) -> float:
    return link.latency + nbytes / link.effective_bandwidth
