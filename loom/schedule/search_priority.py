"""A forward list scheduler driven by per-action priorities (forward-backward justification).

``search_reverse`` builds a schedule backwards in time, which shapes the drain well (every rank
ends on a run of W's) but leaves the warm-up to chance; the forward scheduler (``search_greedy``)
does the opposite. This one joins them, as the forward-backward improvement of project scheduling
does: it runs forward in time, never idles while an action is ready, and among the ready actions
of a rank starts the one with the smallest priority, which the search takes from the latest start
times of a backward schedule. Ready means: its dependencies have finished (plus the send time
across ranks), and for a forward that memory allows it. So the warm-up fills with forwards the
way a forward scheduler's does, and the drain follows the backward schedule's order.

Rules kept from ``search_greedy``: each stage runs its microbatches in order, the backward is
split into I and W, and the first forward of a microbatch on a rank (its admission) leaves room
for the other forwards of every admitted microbatch, so the schedule cannot deadlock on memory.
Deterministic: ties break by action.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Mapping, Sequence

from loom.schedule.compiled import loops_for
from loom.schedule.replay import EPS, F, I, W, Costs, Row
from loom.schedule.search_loop import Asap, Priorities, neighbours, ranks_of, run

Priority = Mapping[tuple[int, int, int], float]  # (stage, op code, microbatch) -> lower runs first


def priority_schedule(
    placement: Sequence[int],
    microbatches: int,
    costs: Costs,
    limit: float,
    priority: Priority,
    reserve: int | None = None,
    patience: float | Sequence[float] = 0.0,
    asap: Asap | None = None,
) -> tuple[list[Row], float] | None:
    """Integer rows (see ``replay.encode``) and peak units; None if it stalls.

    ``reserve``: an admission keeps room for the remaining forwards of this many of the oldest
    admitted microbatches on the rank (None: all of them, which cannot deadlock; fewer lets a
    rank run deeper ahead, and a setting that stalls returns None). ``patience``: a rank waits up
    to this long for a more urgent action whose inputs are on their way rather than start a less
    urgent one that would still be running when they arrive (one value, or one per rank).
    ``asap``: an ``Asap`` of this placement, microbatches and costs, which then holds the rows'
    replayed score. Runs compiled where ``loom.schedule.compiled`` allows: the same result."""
    num_stages, m = len(placement), microbatches
    ranks = ranks_of(placement, limit)
    if ranks is None:
        return None
    pp, stages_of, v, limit_c = ranks.pp, ranks.stages_of, ranks.v, ranks.limit_c
    duration, send = costs.duration, costs.send
    wait = [patience] * pp if isinstance(patience, (int, float)) else list(patience)
    fin_f = [-1.0] * (num_stages * m)
    fin_i = [-1.0] * (num_stages * m)
    next_f = [0] * num_stages
    next_i = [0] * num_stages
    free_at = [0.0] * pp
    live = [0] * pp
    owed = [0] * pp  # forwards still to run of admitted microbatches (their room is reserved)
    left: list[dict[int, int]] = [{} for _ in range(pp)]  # microbatch -> forwards left on rank
    deferred: list[list[tuple[float, int, int]]] = [[] for _ in range(pp)]  # (priority, s, k)
    rows: list[Row] = [[] for _ in range(pp)]
    total, peak = 3 * num_stages * m, 0.0

    # The priorities as flat tables by op code, index stage * m + microbatch (a dict lookup by
    # a fresh tuple per scanned action was a third of the time); per rank, the stages with their
    # neighbours above and below (``search_loop.neighbours``).
    prio_f, prio_i, prio_w = _tables(priority, num_stages, m)
    compiled = loops_for(costs.duration, costs.send)
    if compiled is not None and isinstance(prio_f, array):  # float priorities
        loops, durations = compiled
        made = loops.priority(list(placement), m, durations, send, EPS, list(limit_c), prio_f,
                              prio_i, prio_w, -1 if reserve is None else reserve, wait,
                              None if asap is None else asap.first,
                              None if asap is None else asap.end)
        return None if made is None else (made[0], made[1])
    scan = [[above + below[2:] for above, below in zip(*rank)]
            for rank in zip(neighbours(placement, m, stages_of, 1),
                            neighbours(placement, m, stages_of, -1))]
    inf = float("inf")

    def decide(r: int, t: float) -> tuple[tuple[int, int, int], float] | float:
        wake = inf
        now = t + EPS
        # The most urgent ready action and the most urgent one not ready yet, by key (priority,
        # stage, op, microbatch); the priorities are compared first, the tuples only on a tie.
        best, best_key, best_p = None, None, inf
        soon, soon_key, soon_p = inf, None, inf
        # Memory, the same for every stage of the rank: room for one more forward of an admitted
        # microbatch, and (decided when first needed) room to admit a new one.
        more = live[r] + 1 <= limit_c[r]
        admit = None
        for s, base, above, cross_up, below, cross_down in scan[r]:
            k = next_i[s]
            if k < m:
                ready = fin_f[base + k]
                if ready >= 0:
                    if above >= 0:
                        after = fin_i[above + k]
                        if after < 0:
                            ready = -1.0
                        else:
                            if cross_up:
                                after += send
                            if after > ready:
                                ready = after
                    if ready >= 0:
                        p = prio_i[base + k]
                        if ready <= now:
                            if best_key is None or p < best_p or (
                                    p == best_p and (p, s, I, k) < best_key):
                                best, best_key, best_p = (s, I, k), (p, s, I, k), p
                        else:
                            if ready < wake:
                                wake = ready
                            if soon_key is None or p < soon_p or (
                                    p == soon_p and (p, s, I, k) < soon_key):
                                soon, soon_key, soon_p = ready, (p, s, I, k), p
            k = next_f[s]
            if k >= m:
                continue
            if k in left[r]:
                if not more:
                    continue
            else:
                if admit is None:
                    if reserve is None:
                        admit = live[r] + owed[r] + v[r] <= limit_c[r]
                    else:
                        kept = sum(itertools.islice(left[r].values(), reserve))
                        admit = live[r] + kept + v[r] <= limit_c[r]
                if not admit:
                    continue
            if below < 0:
                ready = 0.0
            else:
                ready = fin_f[below + k]
                if ready < 0:
                    continue
                if cross_down:
                    ready += send
            p = prio_f[base + k]
            if ready <= now:
                if best_key is None or p < best_p or (p == best_p and (p, s, F, k) < best_key):
                    best, best_key, best_p = (s, F, k), (p, s, F, k), p
            else:
                if ready < wake:
                    wake = ready
                if soon_key is None or p < soon_p or (p == soon_p and (p, s, F, k) < soon_key):
                    soon, soon_key, soon_p = ready, (p, s, F, k), p
        if deferred[r]:
            prio, s, k = deferred[r][0]
            if best_key is None or (prio, s, W, k) < best_key:
                best, best_key = (s, W, k), (prio, s, W, k)
        if (best is not None and soon_key is not None and soon_key < best_key
                and soon - t <= wait[r] + EPS
                and soon < t + duration[best[0]][best[1]] - EPS):
            return soon
        return wake if best is None else (best, t)

    def commit(r: int, action: tuple[int, int, int], end: float) -> None:
        nonlocal peak
        s, o, k = action
        if o == F:
            fin_f[s * m + k] = end
            next_f[s] += 1
            live[r] += 1
            peak = max(peak, live[r] / v[r])
            if k not in left[r]:
                left[r][k] = v[r]
                owed[r] += v[r]
            left[r][k] -= 1
            owed[r] -= 1
            if not left[r][k]:
                del left[r][k]
        elif o == I:
            fin_i[s * m + k] = end
            next_i[s] += 1
            heapq.heappush(deferred[r], (prio_w[s * m + k], s, k))
        else:
            heapq.heappop(deferred[r])
            live[r] -= 1

    count = run(placement, costs, rows, free_at, decide, commit, asap=asap)
    if count < total:
        return None
    return rows, peak


def _tables(priority: Priority, num_stages: int, m: int) -> tuple[Sequence[float], ...]:
    """``priority`` as flat tables by op code (F, I, W), index stage * m + microbatch: a
    ``Priorities``' own tables when it has this shape, else read from the mapping (as float
    arrays when every value is a float, else lists of the values as they are)."""
    size = num_stages * m
    if isinstance(priority, Priorities) and priority.microbatches == m and all(
            len(table) == size for table in priority.tables):
        return priority.tables  # type: ignore[return-value]
    table: list[list[float | None]] = [[None] * size for _ in range(3)]
    for (s, o, k), value in priority.items():
        if 0 <= s < num_stages and 0 <= k < m and o < 3:
            table[o][s * m + k] = value
    if any(None in ops for ops in table):
        raise KeyError("priority: every F, I and W of the schedule needs a priority")
    if all(type(value) is float for ops in table for value in ops):
        return tuple(array("d", ops) for ops in table)  # type: ignore[arg-type]
    return tuple(table)  # type: ignore[arg-type]
