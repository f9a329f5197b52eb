"""Hanayo's wave: Liu et al., SC'23, "Hanayo: Harnessing Wave-like Pipeline Parallelism for
Enhanced Large Model Training Efficiency", arXiv 2308.15762.

Placement. The stages snake over the ranks: chunk 0 runs down ranks 0..p-1, chunk 1 back up
p-1..0 (``v_placement``), so a microbatch turns around on rank p-1 without a send and the first
and the last stage share rank 0. One copy of the model, every microbatch visits every stage: no
routes, unlike Chimera's two copies, which is the point the paper makes against Chimera.

Order: 1F1B over the wave, with full backwards (the paper's runtime has no split backward).
Rank r runs 2(p-r)-1 forwards of chunk 0 (the turn is 2(p-1-r) hops away, and one more keeps
the rank busy while the turned microbatch comes back); then r pairs (F chunk 1, F chunk 0) while
the turned microbatches pass by on their way up; then p-r pairs (F, B of chunk 1) as the first
backwards arrive; then the steady state (F, B of chunk 0, then F, B of chunk 1) until every
forward ran; then r pairs (B chunk 0, B chunk 1) and the last p-r backwards of chunk 0. This is
ZB-V's order (``loom.schedule.families.zbv``) with each I and its W fused into one B, which is
what a V with full backwards reduces to. At most 2p chunk forwards are in flight on any rank,
each of half a unit: a peak of p units, 1F1B's. The ramp's hops are half stages and the turn
costs no send, so at unit full-stage costs (F = I = W = 1) the idle time is 2/3 of 1F1B's,
(p-1)(F+B)·2/3, where interleaved 1F1B idles 1/2 of it at p + (p-1)/2 units; at m = 2p and
p = 4 the bubble is 0.200 of the makespan vs 1F1B's 0.273 and interleaved's 0.158.

Valid for any m >= 1: below 2p-1 the order is generated for 2p-1 microbatches and the extra ones
are dropped (as in ZB-V), which keeps it valid but leaves bubbles.

Waves. ``chunks`` is the number of one-way sweeps (stages per rank); the paper's waves come in
down-and-up pairs. Only ``chunks = 2`` (one down-and-up wave) is derived: for 4 and more chunks I
found no closed form of the per-rank warm-up, and list-scheduling policies (1F1B alternation or
backward-first, a per-rank budget of p units) gave bubbles that are not monotone in m and at
times worse than 1F1B's (p=4, m=8, 3 chunks: 0.301 vs 0.273), so more chunks are refused by name.
"""

from __future__ import annotations

from loom.schedule.ir import Op, Schedule, v_placement
from loom.schedule.families._common import RankWriter, check_sizes, make_schedule

# Stages per rank this generator can order (one down-and-up wave); see the module docstring.
DERIVED_CHUNKS = (2,)


def hanayo(pp_size: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Hanayo's wave (one down-and-up wave, full backwards); valid for m >= 1. Uses B."""
    check_sizes("hanayo", pp_size, microbatches)
    if chunks not in DERIVED_CHUNKS:
        raise ValueError(f"hanayo: chunks={chunks} is not derived; only chunks=2 (one wave down "
                         "and back up the ranks) has an order (see loom.schedule.families.hanayo)")
    p = pp_size
    generated = max(microbatches, 2 * p - 1)
    rows = []
    for rank in range(p):
        w = RankWriter((rank, 2 * p - 1 - rank))  # chunk 0 going down, chunk 1 coming back up
        for _ in range(2 * (p - rank) - 1):
            w.add(0, Op.F)
        for _ in range(rank):
            w.add(1, Op.F)
            w.add(0, Op.F)
        for _ in range(p - rank):
            w.add(1, Op.F)
            w.add(1, Op.B)
        while w.count[0, Op.F] < generated or w.count[1, Op.F] < w.count[0, Op.F]:
            if w.count[0, Op.F] < generated:
                w.add(0, Op.F)
            w.add(0, Op.B)
            w.add(1, Op.F)
            w.add(1, Op.B)
        for _ in range(rank):
            w.add(0, Op.B)
            w.add(1, Op.B)
        while w.count[0, Op.B] < w.count[0, Op.F]:
            w.add(0, Op.B)
        rows.append([a for a in w.actions if a.microbatch < microbatches])
    return make_schedule("hanayo", v_placement(p, chunks), microbatches, rows)
