"""A parametric, memory-budgeted list scheduler with real costs (the search's main generator).

In the spirit of the Zero Bubble paper's automatic scheduler (Qi et al. 2024, arXiv 2401.10241
§4, ZB-1p / ZB-2p): the backward is always split into I and W; whenever a rank is free it starts
the most useful ready action,

1. the input-gradient pass I of the oldest ready microbatch (it is on the critical path; a rank
   may wait up to ``patience`` for one that is about to arrive rather than start something else),
2. a W, if more than ``w_backlog`` of them are waiting (bounds how long W's are delayed),
3. a forward, if the memory limit (and the rank's warm-up cap) allows it,
4. a deferred W: it fills what would otherwise be a bubble, and frees memory.

Times come from the given per-stage costs and send latency (the families' greedy policy,
``families._greedy``, uses unit costs), so the order adapts to unequal F, I, W and to latency.

Memory, in counts of one chunk (one unit = ``v`` counts on a rank with v stages): a forward never
takes a rank over the limit. The first forward of a microbatch on a rank (its *admission*) must
also leave room for the remaining forwards of the ``reserve`` oldest admitted microbatches on
that rank. With ``reserve = None`` (all of them) the schedule cannot deadlock: the oldest
unfinished microbatch always has its memory reserved everywhere. Smaller reserves let a V
placement run ZB-V's deeper warm-up but may deadlock; the scheduler then returns None and the
search drops that setting. Deterministic: ties break by time, then rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from loom.schedule.compiled import loops_for
from loom.schedule.replay import EPS, F, I, W, Costs, Row
from loom.schedule.search_loop import neighbours, ranks_of, run


@dataclass(frozen=True)
class Knobs:
    """One setting of the list scheduler (the search sweeps these)."""

    reserve: int | None = None  # admission keeps room for this many pending microbatches; None: all
    caps: tuple[float, ...] | None = None  # per-rank cap on live units at admission (warm-up depth)
    patience: float = 0.0  # wait this long for an I rather than start an F or a W
    w_backlog: int | None = None  # run a W before any F once more than this many are deferred
    depth_first: bool = True  # forwards: later chunks (older microbatches) before admitting new
    forward_first: bool = False  # a ready forward (memory permitting) before a ready I
    w_fill: float = 0.0  # start a W only in a gap of at least w_fill x its duration (ZB's rule)

    def label(self) -> str:
        parts = [f"reserve={'all' if self.reserve is None else self.reserve}"]
        if self.caps is not None:
            parts.append(f"caps={_short(self.caps)}")
        if self.patience:
            parts.append(f"patience={self.patience:g}")
        if self.w_backlog is not None:
            parts.append(f"w_backlog={self.w_backlog}")
        if not self.depth_first:
            parts.append("breadth_first")
        if self.forward_first:
            parts.append("forward_first")
        if self.w_fill:
            parts.append(f"w_fill={self.w_fill:g}")
        return ",".join(parts)


def _short(caps: Sequence[float]) -> str:
    return f"{caps[0]:g}..{caps[-1]:g}" if len(set(caps)) > 1 else f"{caps[0]:g}"


def list_schedule(
    placement: Sequence[int],
    microbatches: int,
    costs: Costs,
    limit: float,
    knobs: Knobs,
) -> tuple[list[Row], float, float] | None:
    """Integer rows (``replay.encode``'s), makespan and peak units; None on a deadlock. Runs
    compiled where ``loom.schedule.compiled`` allows: the same result."""
    num_stages, m = len(placement), microbatches
    ranks = ranks_of(placement, limit)
    if ranks is None:
        return None
    pp, stages_of, v, limit_c = ranks.pp, ranks.stages_of, ranks.v, ranks.limit_c
    caps_c = ranks.caps(knobs.caps)
    admit_cap = [min(limit_c[r], caps_c[r]) for r in range(pp)]
    compiled = loops_for(costs.duration, costs.send)
    if compiled is not None:
        loops, durations = compiled
        return loops.greedy(list(placement), m, durations, costs.send, EPS, list(limit_c),
                            admit_cap, -1 if knobs.reserve is None else knobs.reserve,
                            knobs.patience, -1 if knobs.w_backlog is None else knobs.w_backlog,
                            knobs.depth_first, knobs.forward_first, knobs.w_fill)
    fin_f = [-1.0] * (num_stages * m)
    fin_i = [-1.0] * (num_stages * m)
    next_f = [0] * num_stages
    next_i = [0] * num_stages
    free_at = [0.0] * pp
    live = [0] * pp
    pending: list[dict[int, int]] = [{} for _ in range(pp)]  # mb -> forwards left (ordered)
    pending_total = [0] * pp
    deferred: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    deferred_head = [0] * pp
    rows: list[Row] = [[] for _ in range(pp)]
    duration, send = costs.duration, costs.send
    backward_order = [sorted(stages, reverse=True) for stages in stages_of]
    forward_order = backward_order if knobs.depth_first else stages_of
    total = 3 * num_stages * m
    peak = 0.0

    reserve = knobs.reserve
    patience, w_backlog, w_fill = knobs.patience, knobs.w_backlog, knobs.w_fill
    forward_first = knobs.forward_first
    # An I of stage s needs I(s+1), an F needs F(s-1) (``search_loop.neighbours``).
    i_scan = neighbours(placement, m, backward_order, 1)
    f_scan = neighbours(placement, m, forward_order, -1)
    first_stage = [stages[0] for stages in stages_of]
    inf = float("inf")

    def reserve_after(r: int) -> int:
        """Counts kept free for the pending forwards once one more microbatch is admitted."""
        if reserve is None:
            return pending_total[r] + v[r] - 1
        if not reserve:
            return 0
        oldest = list(itertools.islice(pending[r].values(), reserve))
        return sum((oldest + [v[r] - 1])[:reserve])

    def decide(r: int, t: float) -> tuple[tuple[int, int, int], float] | float:
        """The action rank r starts (and when), or the time to look again (inf: on an event)."""
        wake = inf
        best_s, best_k, best_ready = -1, 0, 0.0
        for s, base, above, cross in i_scan[r]:
            k = next_i[s]
            if k >= m:
                continue
            ready = fin_f[base + k]
            if ready < 0:
                continue
            if above >= 0:
                after = fin_i[above + k]
                if after < 0:
                    continue
                if cross:
                    after += send
                if after > ready:
                    ready = after
            if best_s < 0 or ready < best_ready - EPS:
                best_s, best_k, best_ready = s, k, ready
        head = deferred_head[r]
        backlog = len(deferred[r]) - head
        if backlog and w_backlog is not None and backlog > w_backlog:
            s, k = deferred[r][head]
            return (s, W, k), t
        # An I due within the patience wins over any forward unless forwards go first: then
        # there is no need to look at the forwards at all.
        if not forward_first and best_s >= 0 and best_ready <= t + patience + EPS:
            return (best_s, I, best_k), (best_ready if best_ready > t else t)
        forward = None
        now = t + EPS
        # Memory: a forward that is not an admission needs one free count; an admission needs
        # its reserve too, under a cap no higher than the limit. Both the same for every stage
        # of the rank, so checked once: no room at all means no forward to start or wait for.
        level = live[r]
        first = first_stage[r]
        admit: bool | None = None  # decided when the first stage has a forward to admit
        for s, _, below, cross in f_scan[r] if level < limit_c[r] else ():
            k = next_f[s]
            if k >= m:
                continue
            if below < 0:
                ready = 0.0
            else:
                ready = fin_f[below + k]
                if ready < 0:
                    continue
                if cross:
                    ready += send
            if s == first:
                if admit is None:
                    admit = level + 1 + reserve_after(r) <= admit_cap[r]
                if not admit:
                    continue
            if ready <= now:
                forward = (s, F, k)
                break
            if ready < wake:
                wake = ready
        if forward is not None and forward_first:
            return forward, t
        if best_s >= 0:
            if best_ready <= t + patience + EPS:
                return (best_s, I, best_k), (best_ready if best_ready > t else t)
            if best_ready < wake:
                wake = best_ready
        if forward is not None:
            return forward, t
        if backlog:
            s, k = deferred[r][head]
            if wake - t >= w_fill * duration[s][W] - EPS:
                return (s, W, k), t
        return wake

    def commit(r: int, action: tuple[int, int, int], end: float) -> None:
        nonlocal peak
        s, o, k = action
        if o == F:
            fin_f[s * m + k] = end
            next_f[s] += 1
            live[r] += 1
            level = live[r] / v[r]
            if level > peak:
                peak = level
            if s == first_stage[r]:
                if v[r] > 1:
                    pending[r][k] = v[r] - 1
                    pending_total[r] += v[r] - 1
            else:
                pending_total[r] -= 1
                left = pending[r][k] - 1
                if left:
                    pending[r][k] = left
                else:
                    del pending[r][k]
        elif o == I:
            fin_i[s * m + k] = end
            next_i[s] += 1
            deferred[r].append((s, k))
        else:
            deferred_head[r] += 1
            live[r] -= 1

    done = run(placement, costs, rows, free_at, decide, commit)
    if done < total:
        return None
    return rows, max(free_at), peak
