"""A list scheduler that builds the schedule backwards in time (drain first), for the search.

The forward list scheduler (``search_greedy``) fills the warm-up well but decides the drain last,
when it has run out of deferred W's: the Zero Bubble figure (idle inside the longest rank span)
then shows up at the end of rank 0 and in the tails of the other ranks. An ideal schedule is a
parallelogram: rank r busy from its first forward (about r hops after rank 0's) to r hops after
rank 0's end, which means rank r ends with a long run of W's, as deep as its memory allows.

Reversing time turns that drain into a warm-up, which a greedy scheduler handles well. In reverse
time every (stage, microbatch) runs W first (no dependency: a source), then I (after its own W and
after the I of the stage *below*, the input-gradient chain reversed), then F (after its own I and
after the F of the stage *above*). Memory is the same interval read backwards: a chunk is live from
its W to its F. This module list-schedules that reversed problem with the same rules as the forward
one, mirrored:

1. a ready F (it frees memory and drains the reversed pipeline),
2. a ready I,
3. the W an arrived I is waiting for,
4. a W ahead of need, to fill what would otherwise be idle time, while memory allows: first for a
   microbatch already admitted on this rank, then admitting the next one (reverse microbatch
   order). Admission keeps room for the other W's of every admitted microbatch, so the oldest one
   can always proceed and the schedule cannot deadlock.

``stagger`` delays the start of rank r by (p-1-r) hops of the reversed chain: forwards, ranks
start one hop apart, so in an ideal schedule they also end one hop apart, rank 0 first. Without
the delay the reversed rank 0 starts with everyone and rank 0 idles for p-1 hops in its forward
span; with it the last rank fills those hops (and its own round trip) with W's.

Reversing each rank's list gives a forward order; ``loom.schedule.replay`` replays it as soon as
possible (times can only move earlier) and the search keeps it when it ranks best. Deterministic.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from loom.schedule.compiled import loops_for
from loom.schedule.replay import EPS, F, I, W, Costs, Row
from loom.schedule.search_loop import Priorities, neighbours, ranks_of, run


@dataclass(frozen=True)
class ReverseKnobs:
    """One setting of the reverse scheduler (the search sweeps these)."""

    i_first: bool = False  # a ready I before a ready F
    stagger: float = 0.0  # rank r starts (p-1-r) x stagger x one hop later (see the docstring)

    def label(self) -> str:
        parts = ["reverse"]
        if self.i_first:
            parts.append("i_first")
        if self.stagger:
            parts.append(f"stagger={self.stagger:g}")
        return ",".join(parts)


def reverse_schedule(
    placement: Sequence[int],
    microbatches: int,
    costs: Costs,
    limit: float,
    knobs: ReverseKnobs,
) -> tuple[list[Row], float, Priorities] | None:
    """Forward integer rows (``loom.schedule.replay.encode``'s), their peak units and every
    action's latest forward start in this schedule (the priorities ``priority_schedule``
    follows); None on a stall. Runs compiled where ``loom.schedule.compiled`` allows: the same
    result."""
    num_stages, m = len(placement), microbatches
    ranks = ranks_of(placement, limit)
    if ranks is None:
        return None
    pp, stages_of, v, limit_c = ranks.pp, ranks.stages_of, ranks.v, ranks.limit_c
    duration, send = costs.duration, costs.send
    size = num_stages * m
    fin_w = [-1.0] * size  # reverse finish times, index stage * m + microbatch
    fin_i = [-1.0] * size
    fin_f = [-1.0] * size
    # Reverse microbatch order: microbatch m-1 drains last in forward time, so it starts here.
    next_i = [0] * num_stages  # count of reverse-ordered microbatches whose I ran on this stage
    next_f = [0] * num_stages
    live = [0] * pp
    admitted: list[list[int]] = [[] for _ in range(pp)]  # reverse-ordered microbatches, W pending
    w_left: list[dict[int, list[int]]] = [{} for _ in range(pp)]  # mb -> its stages without W yet
    next_admit = [0] * pp
    pending_w = [0] * pp  # W's still owed by admitted microbatches (their memory is reserved)
    free_at = [0.0] * pp
    rows: list[Row] = [[] for _ in range(pp)]
    ends: list[list[float]] = [[] for _ in range(pp)]
    up = [sorted(stages) for stages in stages_of]  # I's chain upwards: lower stage first
    # One hop of the reversed input-gradient chain: an I and a send. Reversed, the ranks should
    # start staggered like forward ones do (the last rank first), or rank 0 ends with everyone.
    hop = sum(d[I] for d in duration) / num_stages + send
    release = [(pp - 1 - r) * knobs.stagger * hop for r in range(pp)]
    compiled = loops_for(costs.duration, costs.send)
    if compiled is not None:
        loops, durations = compiled
        made = loops.reverse(list(placement), m, durations, send, EPS, list(limit_c), release,
                             knobs.i_first)
        if made is None:
            return None
        rows, peak, *tables = made
        return rows, peak, Priorities(m, [array("d", table) for table in tables])
    total = 3 * size
    peak = 0

    def run_w(r: int, s: int, k: int) -> None:
        nonlocal peak
        live[r] += 1
        peak = max(peak, live[r] * 1.0 / v[r])
        stages = w_left[r][k]
        stages.remove(s)
        pending_w[r] -= 1
        if not stages:
            del w_left[r][k]
            admitted[r].remove(k)

    def admit(r: int) -> int | None:
        """Admit the next microbatch on rank r if its W's fit beside the reserved ones."""
        if next_admit[r] >= m:
            return None
        if live[r] + pending_w[r] + v[r] > limit_c[r]:
            return None
        k = m - 1 - next_admit[r]
        next_admit[r] += 1
        admitted[r].append(k)
        w_left[r][k] = list(up[r])
        pending_w[r] += v[r]
        return k

    # F's chain downwards (higher stage first) after the stage above; I's chain upwards after
    # the stage below (``search_loop.neighbours``).
    f_scan = neighbours(placement, m, [stages[::-1] for stages in up], 1)
    i_scan = neighbours(placement, m, up, -1)
    i_first = knobs.i_first
    inf = float("inf")

    def decide(r: int, t: float) -> tuple[tuple[int, int, int], float] | float:
        # The first ready F (in scan order) or the first ready I, whichever goes first, is
        # returned as soon as it is found (``wake`` only matters when nothing is ready).
        wake = inf
        now = t + EPS
        ready_f = None
        for s, base, above, cross in f_scan[r]:
            j = next_f[s]
            if j >= m:
                continue
            k = m - 1 - j
            at = fin_i[base + k]
            if at < 0:
                continue
            if above >= 0:
                above_at = fin_f[above + k]
                if above_at < 0:
                    continue
                if cross:
                    above_at += send
                if above_at > at:
                    at = above_at
            if at <= now:
                ready_f = (s, F, k)
                if not i_first:
                    return ready_f, t
                break
            if at < wake:
                wake = at
        waiting_w = None
        for s, base, below, cross in i_scan[r]:
            j = next_i[s]
            if j >= m:
                continue
            k = m - 1 - j
            if below >= 0:
                at = fin_i[below + k]
                if at < 0:
                    continue
                if cross:
                    at += send
            else:
                at = 0.0
            w_at = fin_w[base + k]
            if w_at < 0:
                if at <= now:
                    if waiting_w is None:
                        waiting_w = (s, k)
                elif at < wake:
                    wake = at
                continue
            if w_at > at:
                at = w_at
            if at <= now:
                return (s, I, k), t  # i_first, or no F is ready
            if at < wake:
                wake = at
        if ready_f is not None:
            return ready_f, t
        if waiting_w is not None:
            s, k = waiting_w
            if k in w_left[r] or (k == m - 1 - next_admit[r] and admit(r) == k):
                return (s, W, k), t
        for k in admitted[r]:  # reserved already: costs no extra room
            return (w_left[r][k][0], W, k), t
        k = admit(r)
        if k is not None:
            return (w_left[r][k][0], W, k), t
        return wake

    def commit(r: int, action: tuple[int, int, int], end: float) -> None:
        s, o, k = action
        ends[r].append(end)
        if o == W:
            run_w(r, s, k)
            fin_w[s * m + k] = end
        elif o == I:
            fin_i[s * m + k] = end
            next_i[s] += 1
        else:
            fin_f[s * m + k] = end
            next_f[s] += 1
            live[r] -= 1

    count = run(placement, costs, rows, free_at, decide, commit, release, backwards=True)
    if count < total:
        return None
    end = max(free_at)
    # forward-time start of every action in this (right-justified) schedule: its latest start
    tables: list[list[float]] = [[0.0] * size for _ in range(3)]
    for r, row in enumerate(rows):
        for (s, o, k), t_end in zip(row, ends[r]):
            tables[o][s * m + k] = end - t_end
    return [row[::-1] for row in rows], peak, Priorities(m, tables)
