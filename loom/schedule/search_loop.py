"""The one list-scheduling core: the event loop (and the per-rank chunk layout) of every policy.

The search's ``search_greedy`` (forward, by knobs), ``search_reverse`` (backward in time) and
``search_priority`` (forward, by priorities; with patience, the search's patient pass) and the
families' greedy policy (``families._greedy``: v_half, v_min, bidirectional_v) all advance one
clock over the ranks: a rank that is free asks its policy what to start (an action and its start
time) or when to look again, and a started action wakes its own rank when it ends and the rank it
sends to when the message arrives. They differ only in their ``Decide`` / ``Commit`` pair.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loom.schedule.replay import EPS, F, I, Costs, Row

Action = tuple[int, int, int]  # (stage, op code, microbatch)
Decide = Callable[[int, float], "tuple[Action, float] | float"]
Commit = Callable[[int, Action, float], None]


@dataclass(frozen=True)
class Ranks:
    """The stages of each rank, its chunk count v, and the memory limit in chunks (v per unit)."""

    pp: int
    stages_of: tuple[tuple[int, ...], ...]
    v: tuple[int, ...]
    limit_c: tuple[int, ...]

    def caps(self, caps: Sequence[float] | None) -> list[int]:
        """Per-rank caps in units as chunk counts, within [v, limit]; None: the limit."""
        if caps is None:
            return list(self.limit_c)
        return [max(v, min(lim, int(cap * v + EPS))) for cap, v, lim in
                zip(caps, self.v, self.limit_c)]


def ranks_of(placement: Sequence[int], limit: float) -> Ranks | None:
    """The layout of ``placement`` under ``limit`` units; None if one microbatch cannot fit."""
    pp = max(placement) + 1
    stages_of = tuple(tuple(s for s in range(len(placement)) if placement[s] == r)
                      for r in range(pp))
    v = tuple(len(stages) for stages in stages_of)
    limit_c = tuple(int(limit * v[r] + EPS) for r in range(pp))
    if min(limit_c[r] - v[r] for r in range(pp)) < 0:
        return None
    return Ranks(pp, stages_of, v, limit_c)


def run(placement: Sequence[int], costs: Costs, rows: list[Row], free_at: list[float],
        decide: Decide, commit: Commit, release: Sequence[float] | None = None,
        backwards: bool = False) -> int:
    """Advance the clock until no rank can start anything; returns how many actions started.

    Each started action is appended to its rank's row and sets ``free_at``; ``commit(rank,
    action, end)`` does the scheduler's own bookkeeping. An F wakes the rank of the next stage
    and an I the rank of the previous one, after the send time (``backwards``: the other way
    round, as in time-reversed scheduling). ``release[r]``: rank r starts nothing before it."""
    duration, send = costs.duration, costs.send
    ready = release or [0.0] * len(free_at)
    heap = [(ready[r], r) for r in range(len(free_at))]
    # the rank an F (I) of each stage sends to, -1 for none (reversed when ``backwards``)
    n = len(placement)
    up = [placement[s + 1] if s + 1 < n else -1 for s in range(n)]
    down = [placement[s - 1] if s > 0 else -1 for s in range(n)]
    after_f, after_i = (down, up) if backwards else (up, down)
    pop, push, inf = heapq.heappop, heapq.heappush, float("inf")
    started = 0
    while heap:
        t, r = pop(heap)
        free = free_at[r]
        if free > t + EPS:
            continue
        if free > t:
            t = free
        if ready[r] > t:
            t = ready[r]
        choice = decide(r, t)
        if choice.__class__ is not tuple:
            if choice != inf:
                push(heap, (choice, r))
            continue
        action, start = choice
        s, o, _ = action
        end = start + duration[s][o]
        rows[r].append(action)
        free_at[r] = end
        started += 1
        commit(r, action, end)
        push(heap, (end, r))
        if o == F:
            to = after_f[s]
        elif o == I:
            to = after_i[s]
        else:
            continue
        if to >= 0 and to != r and free_at[to] <= end + send + EPS:
            push(heap, (end + send, to))  # else busy then: its end wakes it
    return started
