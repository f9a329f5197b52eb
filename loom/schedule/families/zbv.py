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
    m = microbatches
    F0, I0, W0, F1, I1, W1 = ((0, Op.F), (0, Op.I), (0, Op.W), (1, Op.F), (1, Op.I), (1, Op.W))
    rows = []
    for rank in range(p):
        w = RankWriter((rank, 2 * p - 1 - rank))
        w.repeat(2 * (p - rank) - 1, (F0,), m)
        w.repeat(rank, (F1, F0), m)
        w.repeat(p - rank, (F1, I1, W1), m)
        # the steady state: while forwards of chunk 0 are left (F0 in each round), then until
        # chunk 1's forwards catch up (each round one F1)
        full = max(generated - w.count[F0], 0)
        w.repeat(full, (F0, I0, W0, F1, I1, W1), m)
        w.repeat(max(w.count[F0] - w.count[F1], 0), (I0, W0, F1, I1, W1), m)
        w.repeat(rank, (I0, I1), m)
        w.repeat(p - rank, (I0, W0), m)
        for chunk in (1, 0):
            w.repeat(max(w.count[chunk, Op.I] - w.count[chunk, Op.W], 0), ((chunk, Op.W),), m)
        rows.append([a for a in w.actions if a.microbatch < microbatches])
    return make_schedule("zbv", v_placement(p, 2), microbatches, rows)
