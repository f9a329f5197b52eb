"""ZB-V: Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241 §6.

Two stages per rank in a V (rank r owns stage r and stage 2p-1-r), so the first and the last
stage both live on rank 0 and a microbatch's forward turns around on rank p-1. With the backward
split into I and W and T_F = T_I = T_W the schedule has no bubble and a peak of p units on every
rank (each stage weighs half a unit), the same as 1F1B.

Rank r: 2(p-r)-1 forwards of chunk 0; r pairs (F chunk 1, F chunk 0); p-r triples
(F, I, W of chunk 1); then the steady state (F, I, W of chunk 0, then of chunk 1) until every
forward ran; then r pairs (I chunk 0, I chunk 1) and p-r pairs (I, W of chunk 0); the deferred
W's close the list. Valid for any m >= 1: below 2p-1 the schedule is generated for 2p-1
microbatches and the extra ones are dropped (as torch's ScheduleZBVZeroBubble does), which keeps
the order valid but leaves bubbles.
"""

from __future__ import annotations

from loom.schedule.ir import Op, Schedule, v_placement
from loom.schedule.families._common import RankWriter, check_sizes, make_schedule


def zbv(pp_size: int, microbatches: int) -> Schedule:
    """ZB-V with two stages per rank (V placement); valid for m >= 1. Uses I and W."""
    check_sizes("zbv", pp_size, microbatches)
    p = pp_size
    generated = max(microbatches, 2 * p - 1)
    rows = []
    for rank in range(p):
        w = RankWriter((rank, 2 * p - 1 - rank))
        for _ in range(2 * (p - rank) - 1):
            w.add(0, Op.F)
        for _ in range(rank):
            w.add(1, Op.F)
            w.add(0, Op.F)
        for _ in range(p - rank):
            for op in (Op.F, Op.I, Op.W):
                w.add(1, op)
        while w.count[0, Op.F] < generated or w.count[1, Op.F] < w.count[0, Op.F]:
            if w.count[0, Op.F] < generated:
                w.add(0, Op.F)
            w.add(0, Op.I)
            w.add(0, Op.W)
            for op in (Op.F, Op.I, Op.W):
                w.add(1, op)
        for _ in range(rank):
            w.add(0, Op.I)
            w.add(1, Op.I)
        for _ in range(p - rank):
            w.add(0, Op.I)
            w.add(0, Op.W)
        for chunk in (1, 0):
            while w.count[chunk, Op.W] < w.count[chunk, Op.I]:
                w.add(chunk, Op.W)
        rows.append([a for a in w.actions if a.microbatch < microbatches])
    return make_schedule("zbv", v_placement(p, 2), microbatches, rows)
