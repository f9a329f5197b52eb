"""The pipelined part of a step in closed form, for the planner's screening
(``CostModel.evaluate``): each schedule family's bubble over its ranks' F / I / W, and a
searched schedule's rough estimate from its memory limit and its placement. The finalists are
simulated on the real schedule instead (``loom.plan.search.simulate_step``). Split from
``cost_model.py``, which prices the passes these formulas take. Torch-free, communicates
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from loom.layout import Layout

Ops = Sequence[tuple[float, float, float]]  # (F, I, W) seconds per global stage for one microbatch


def pipeline_estimate(lay: Layout, ops: Ops, busiest: float, send: float,
                      contention: float = 1.0) -> float:
    """The pipelined part of ``lay``'s step: ``busiest`` is the busiest rank's F+I+W per
    microbatch, ``send`` one stage-boundary hop, ``contention`` the slowdown of ranks sharing
    cores (at most the full one; the simulation refines it)."""
    if lay.schedule == "search":
        return search_estimate(lay, ops, busiest, send, contention)
    p, m, v = lay.pp, lay.microbatches, lay.chunks
    mid = ops[len(ops) // 2]
    f, i, w = mid[0] * v, mid[1] * v, mid[2] * v  # one rank's share of a microbatch
    name = lay.schedule
    if name in ("gpipe", "1f1b", "looped_bfs"):
        bubble = (p - 1) * (f + i + w)
    elif name == "interleaved_1f1b":
        bubble = (p - 1) * (f + i + w) / v
    elif name == "zb_h1":
        bubble = (p - 1) * max(f + i - w, 0)
    elif name in ("zb_h2", "zbv", "dualpipev"):
        bubble = (p - 1) * max(f + i - 2 * w, 0)
    elif name == "hanayo":  # 1F1B over the V, full backwards: the ramp's hops are half stages
        # and the turn on rank p-1 costs no send; measured (p-1)(f+i+w)·2/3 at F:B = 1:2; W = v/2
        # waves: 5/(6W) of it, measured at m = 2p, p = 4 and 8 (at m = 4p 0.36 and 0.24 for W = 2,
        # 3: an upper bound there)
        bubble = (p - 1) * (f + i + w) * (2 / 3 if v <= 2 else 5 / (3 * v))
    elif name == "v_half":
        bubble = (p - 1) * (f + i + w) / 2
    else:  # v_min
        bubble = (p - 1) * (f + i + w) * 2 / 3
    hops = 2 * (p - 1) * (max(v, 2) if lay.v_shaped else v)
    return (busiest * m + bubble) * contention + hops * send


def search_estimate(lay: Layout, ops: Ops, busiest: float, send: float,
                    contention: float = 1.0) -> float:
    """A searched schedule's estimate, from two limits on it. Its memory: a rank holding L
    units starts a microbatch only as one returns, so at most L per round trip R (a microbatch's
    F down every stage, its I back up, rank 0's W and the hops), m·R/L in all. Its placement:
    no faster than the family that reaches the placement's zero-bubble level with unbounded
    memory (ZB-H2 looped, ZB-V in a V). The two are blended as (a^8 + b^8)^(1/8). Against the
    search's makespans (``python bench/search_levels.py``: uniform F, I, W = 1, 1.2, 0.8,
    p = 4 and 8, m = 4p, L = 1..2p) it is within 19% except a single unit on the V (+45% at
    p = 4); rough, so the planner simulates the best searched layouts whatever it says."""
    p, m, v = lay.pp, lay.microbatches, lay.chunks
    limit = lay.schedule_memory_limit or float(p)
    mid = ops[len(ops) // 2]
    f, i, w = mid[0] * v, mid[1] * v, mid[2] * v  # one rank's share of a microbatch
    hops = 2 * (p - 1) * (2 if lay.v_shaped else 1)
    round_trip = p * (f + i) + w
    bound = m * round_trip / limit * contention + hops * send
    best = "zbv" if lay.v_shaped else "zb_h2"
    unbounded = pipeline_estimate(replace(lay, schedule=best), ops, busiest, send, contention)
    return (bound ** 8 + unbounded ** 8) ** 0.125


__all__ = ["Ops", "pipeline_estimate", "search_estimate"]
