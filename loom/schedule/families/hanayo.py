"""Hanayo's wave: Liu et al., SC'23, "Hanayo: Harnessing Wave-like Pipeline Parallelism for
Enhanced Large Model Training Efficiency", arXiv 2308.15762.

Placement. The stages snake over the ranks: chunk 0 runs down ranks 0..p-1, chunk 1 back up
p-1..0, chunk 2 down again, ... (``v_placement``), so a microbatch turns around on rank p-1 or
rank 0 without a send, and with an even number of chunks the first and the last stage share
rank 0. One copy of the model, every microbatch visits every stage: no routes, unlike Chimera's
two copies, which is the point the paper makes against Chimera. ``chunks`` is the number of
one-way sweeps (stages per rank); the paper's waves are down-and-up pairs, so it is even:
W = chunks / 2 waves. Full backwards throughout (the paper's runtime has no split backward).

One wave (``chunks = 2``, the V): 1F1B over the V. Rank r runs 2(p-r)-1 forwards of chunk 0
(the turn is 2(p-1-r) hops away, and one more keeps the rank busy while the turned microbatch
comes back); then r pairs (F chunk 1, F chunk 0) while the turned microbatches pass by on their
way up; then p-r pairs (F, B of chunk 1) as the first backwards arrive; then the steady state
(F, B of chunk 0, then F, B of chunk 1) until every forward ran; then r pairs (B chunk 0,
B chunk 1) and the last p-r backwards of chunk 0. That is exactly ZB-V's order
(``loom.schedule.families.zbv``) with each I made a full B and its W dropped, which is what a V
with full backwards reduces to, so it is generated that way. At most 2p chunk forwards are in
flight on any rank, each of half a unit: a peak of p units, 1F1B's. At unit full-stage costs
(F = I = W = 1) the idle time is 2/3 of 1F1B's, (p-1)(F+B)·2/3.

Several waves (``chunks = 2W``, W >= 2): the order is read off a timeline built in two steps.
(1) Forwards: one forward per rank per time slot; a rank runs the ready forward deepest in the
wave (ties: the oldest microbatch), and microbatch k enters stage 0 only once microbatch k-p has
started its last stage, so at most p microbatches are on their way down the wave at once (the
1F1B window). (2) Backwards: each microbatch's backward retraces its forward in reverse time,
starting right after its last forward: if its forward of stage s ran at slot t_s and of the last
stage at slot t_L, its backward of stage s runs at slot 2·t_L - t_s. Each rank runs its actions
in slot order, a forward at the start of its slot and a backward after it. That order is free
of deadlocks by construction, for every p, W and m >= 1: a forward's input ran at an earlier
slot, a backward's gradient comes from a later stage whose slot is earlier (t_{s+1} > t_s), and
a stage's backward follows its own forward (t_L >= t_s), so the slots order every dependency
and in-order execution always has an action whose inputs are done. Microbatches enter the
timeline at whatever pace the wave allows, so any m >= 1 is valid, no multiple of p needed
(between multiples of p it may trail the one-wave V by up to 1.5 units, p <= 8, never 1F1B).
Measured at F = I = W = 1 (``tests/unit/schedule/test_hanayo_waves.py``): the bubble shrinks
with every wave added (m = 2p, p = 4: 0.200 of the makespan at W = 1, 0.135 at W = 2, 0.094
at W = 3; 1F1B 0.273, interleaved 1F1B at 4 chunks 0.086), and the peak is
p + floor((p+1)/3)/chunks units once m >= 4p (min(m, p) at m <= p): just over 1F1B's p, below
interleaved's p + (p-1)/chunks. The extra floor((p+1)/3) chunk activations are measured (the
forwards that wait in the wave's turns hold their activations longer), not derived.

Odd chunk counts are refused: the wave then ends on rank p-1, away from the first stage, and
the same construction measured worse than 1F1B (p = 3, m = 10, 3 chunks: 38.7 vs 36).

Why not Megatron's interleaved order on the wave: forwards in groups of p per chunk leave rank
r idle 2d slots at every turn (d its distance to the turning rank, the round trip the group
does not cover), so at m = p it only ties 1F1B, and with warm-ups of (chunks-1)·p + 2d it
deadlocks from m = 2p on (p = 2..8, 4 and 6 chunks).
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from loom.schedule.families._common import check_sizes, make_schedule
from loom.schedule.families.zbv import zbv
from loom.schedule.ir import Action, Op, Schedule, v_placement


def hanayo(pp_size: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Hanayo's wave over ``chunks`` one-way sweeps (even: chunks / 2 waves), full backwards;
    valid for any m >= 1. Uses B."""
    check_sizes("hanayo", pp_size, microbatches)
    if chunks < 2 or chunks % 2:
        raise ValueError(f"hanayo: chunks={chunks} must be even and >= 2 (the wave's sweeps "
                         "come in down-and-up pairs; an odd count ends the wave away from rank "
                         "0 and measured worse than 1F1B, see loom.schedule.families.hanayo)")
    if chunks == 2:
        # ZB-V's order with each input gradient (I) made the full backward and its W dropped
        rows = [[Action(a.stage, Op.B, a.microbatch) if a.op is Op.I else a
                 for a in row if a.op is not Op.W] for row in zbv(pp_size, microbatches).actions]
        return make_schedule("hanayo", v_placement(pp_size, chunks), microbatches, rows)
    return _waves(pp_size, microbatches, chunks)


def _waves(pp_size: int, microbatches: int, chunks: int) -> Schedule:
    """Several waves: each rank's actions in the order of the timeline of the module docstring."""
    placement = v_placement(pp_size, chunks)
    last = len(placement) - 1
    slot = _forward_slots(placement, pp_size, microbatches)
    keyed: list[list[tuple[int, int, int, Op]]] = [[] for _ in range(pp_size)]
    for (stage, mb), t in slot.items():
        turn = slot[last, mb]
        rank = keyed[placement[stage]]
        # a slot holds a forward, then a backward: 3t for the forward, 3t' + 1 for the backward
        rank.append((3 * t, stage, mb, Op.F))
        rank.append((3 * (2 * turn - t) + 1, stage, mb, Op.B))
    rows = [[Action(stage, op, mb) for _, stage, mb, op in sorted(row)] for row in keyed]
    return make_schedule("hanayo", placement, microbatches, rows)


def _forward_slots(placement: tuple[int, ...], pp_size: int, microbatches: int
                   ) -> dict[tuple[int, int], int]:
    """(stage, microbatch) -> slot of its forward: one forward per rank per slot, the ready one
    deepest in the wave first (then the oldest microbatch); a forward is ready the slot after
    its input's; microbatch k enters the slot after microbatch k - p started the last stage."""
    last = len(placement) - 1
    ready: list[list[tuple[int, int]]] = [[] for _ in range(pp_size)]  # heaps of (-stage, mb)
    # the ranks whose heap is not empty: a slot visits only those (each rank's pick depends on
    # its own heap alone), so a deep pipeline with few microbatches costs its forwards, not
    # slots x ranks (10,000 ranks of 4 chunks and 2 microbatches had taken 11 s)
    busy: set[int] = set()
    arriving: dict[int, list[tuple[int, int]]] = defaultdict(list)  # slot -> (stage, mb)
    for mb in range(min(pp_size, microbatches)):
        heapq.heappush(ready[placement[0]], (0, mb))
        busy.add(placement[0])
    slot: dict[tuple[int, int], int] = {}
    t, left = 0, len(placement) * microbatches
    while left:
        for stage, mb in arriving.pop(t, ()):
            heapq.heappush(ready[placement[stage]], (-stage, mb))
            busy.add(placement[stage])
        for rank in list(busy):
            heap = ready[rank]
            stage, mb = heapq.heappop(heap)
            if not heap:
                busy.discard(rank)
            stage = -stage
            slot[stage, mb] = t
            left -= 1
            if stage < last:
                arriving[t + 1].append((stage + 1, mb))
            elif mb + pp_size < microbatches:
                arriving[t + 1].append((0, mb + pp_size))
        t = t + 1 if busy or not arriving else min(arriving)
    return slot
