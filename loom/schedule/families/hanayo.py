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
forward ran; then r pairs (B chunk 0, B chunk 1) and the last p-r backwards of chunk 0. That is
exactly ZB-V's order (``loom.schedule.families.zbv``) with each I made a full B and its W
dropped, which is what a V with full backwards reduces to, so it is generated that way. At most 2p chunk forwards are in flight on any rank,
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

from loom.schedule.families._common import check_sizes, make_schedule
from loom.schedule.families.zbv import zbv
from loom.schedule.ir import Action, Op, Schedule, v_placement

# Stages per rank this generator can order (one down-and-up wave); see the module docstring.
DERIVED_CHUNKS = (2,)


def hanayo(pp_size: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Hanayo's wave (one down-and-up wave, full backwards); valid for m >= 1. Uses B."""
    check_sizes("hanayo", pp_size, microbatches)
    if chunks not in DERIVED_CHUNKS:
        raise ValueError(f"hanayo: chunks={chunks} is not derived; only chunks=2 (one wave down "
                         "and back up the ranks) has an order (see loom.schedule.families.hanayo)")
    # ZB-V's order with each input gradient (I) made the full backward and its W dropped
    rows = [[Action(a.stage, Op.B, a.microbatch) if a.op is Op.I else a
             for a in row if a.op is not Op.W] for row in zbv(pp_size, microbatches).actions]
    return make_schedule("hanayo", v_placement(pp_size, chunks), microbatches, rows)
