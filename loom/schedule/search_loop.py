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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from loom.schedule.replay import EPS, F, I, Costs, Row, Score, score_of

Action = tuple[int, int, int]  # (stage, op code, microbatch)
# A limit in chunks beyond any count a schedule reaches: where ``limit x v`` is not finite (an
# infinite limit, or 1e308 units times v chunks), no limit binds, and this stands for it.
UNBOUNDED_CHUNKS = 2 ** 62
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
    limit_c = tuple(int(min(limit * v[r] + EPS, UNBOUNDED_CHUNKS)) for r in range(pp))
    if min(limit_c[r] - v[r] for r in range(pp)) < 0:
        return None
    return Ranks(pp, stages_of, v, limit_c)


def neighbours(placement: Sequence[int], m: int, orders: Sequence[Sequence[int]], step: int
               ) -> list[list[tuple[int, int, int, bool]]]:
    """Per rank, for each stage ``s`` of its scan order: ``s``, its flat index base ``s * m``, the
    base of stage ``s + step`` (-1: no such stage) and whether a message between the two crosses
    ranks. The policies precompute these scans: their ``Decide`` runs once per started action."""
    n = len(placement)
    return [[(s, s * m, (s + step) * m if 0 <= s + step < n else -1,
              0 <= s + step < n and placement[s + step] != placement[s]) for s in order]
            for order in orders]


class Priorities(Mapping):
    """Every action's priority as three flat tables by op code (F, I, W), index stage *
    microbatches + microbatch: what ``search_reverse`` returns (its latest start times) and
    ``search_priority`` reads, without a dict of a tuple per action (123,000 at p = 32, m = 256
    and five chunks). Also a read-only mapping from (stage, op code, microbatch). The tables are
    float arrays from the compiled scheduler, lists from the Python one."""

    def __init__(self, microbatches: int, tables: Sequence[Sequence[float]]):
        self.microbatches = microbatches
        self.tables = tuple(tables)

    def __getitem__(self, key: tuple[int, int, int]) -> float:
        s, o, k = key
        if not (0 <= o < 3 and 0 <= k < self.microbatches) or s < 0:
            raise KeyError(key)
        try:
            return self.tables[o][s * self.microbatches + k]
        except IndexError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        m = self.microbatches
        for o, table in enumerate(self.tables):
            for n in range(len(table)):
                yield n // m, o, n % m

    def __len__(self) -> int:
        return sum(map(len, self.tables))


class Asap:
    """What ``loom.schedule.replay.score`` would say of the rows a forward scheduler builds,
    computed while ``run`` builds them (``run(..., asap=...)``), so that the search need not
    replay a candidate it has just made (a twentieth of a second at p=32, m=256 and four chunks
    per rank, half a second at p=64, m=512).

    The replay starts each action of a rank's list as soon as the previous one has ended and its
    inputs are there (``replay``'s rules, for one route and a split backward: F(s,k) needs
    F(s-1,k), I(s,k) needs F(s,k) and I(s+1,k), W(s,k) needs I(s,k); plus the send time from
    another rank). A forward scheduler starts an action only after its inputs have started, so
    each action's replayed time follows from times already known when it is appended. These
    are the replay's own operations on the same numbers, so the result is the same to the bit."""

    def __init__(self, placement: Sequence[int], microbatches: int, costs: Costs):
        size = len(placement) * microbatches
        self.microbatches, self.costs = microbatches, costs
        self.f = [0.0] * size  # replayed finish of F(s, k), index s * m + k
        self.i = [0.0] * size  # ... of I(s, k)
        pp = max(placement) + 1
        self.first = [0.0] * pp  # replayed start of each rank's first action
        self.end = [0.0] * pp  # ... and end of its last

    def score(self, rows: Sequence[Row]) -> Score:
        """``replay.score(rows, ...)``, from the times kept while ``run`` built the rows."""
        return score_of(rows, self.first, self.end, self.costs)


def run(placement: Sequence[int], costs: Costs, rows: list[Row], free_at: list[float],
        decide: Decide, commit: Commit, release: Sequence[float] | None = None,
        backwards: bool = False, asap: Asap | None = None) -> int:
    """Advance the clock until no rank can start anything; returns how many actions started.

    Each started action is appended to its rank's row and sets ``free_at``; ``commit(rank,
    action, end)`` does the scheduler's own bookkeeping. An F wakes the rank of the next stage
    and an I the rank of the previous one, after the send time (``backwards``: the other way
    round, as in time-reversed scheduling). ``release[r]``: rank r starts nothing before it.
    ``asap`` (forward schedulers with a split backward): replay the rows as they grow."""
    duration, send = costs.duration, costs.send
    if asap is not None:
        m, asap_f, asap_i, asap_first, asap_end = (asap.microbatches, asap.f, asap.i, asap.first,
                                                   asap.end)
        last = len(placement) - 1
        # whether F(s-1) -> F(s) and I(s+1) -> I(s) cross ranks (and so take the send time)
        f_cross = [bool(send) and s > 0 and placement[s - 1] != placement[s]
                   for s in range(len(placement))]
        i_cross = [bool(send) and s < last and placement[s + 1] != placement[s]
                   for s in range(len(placement))]
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
        if asap is not None:  # the replay's start: the rank's last end, then each input's
            n = s * m + action[2]
            opening = len(rows[r]) == 1
            at = 0.0 if opening else asap_end[r]
            if o == F:
                if s:
                    dep = asap_f[n - m]
                    if f_cross[s]:
                        dep += send
                    if dep > at:
                        at = dep
            elif o == I:
                dep = asap_f[n]
                if dep > at:
                    at = dep
                if s < last:
                    dep = asap_i[n + m]
                    if i_cross[s]:
                        dep += send
                    if dep > at:
                        at = dep
            else:
                dep = asap_i[n]
                if dep > at:
                    at = dep
            if opening:
                asap_first[r] = at
            at += duration[s][o]
            asap_end[r] = at
            if o == F:
                asap_f[n] = at
            elif o == I:
                asap_i[n] = at
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
