"""The families' greedy list-scheduling policy under a per-rank memory budget (v_half, v_min,
bidirectional_v), run on the search's event loop (``loom.schedule.search_loop.run``).

Unit costs (F = I = W = 1, no send time), the backward always split into I and W. Every free rank
starts the most useful ready action: an I first, since it unblocks the rank before and leads to a
W that frees memory; then a forward, the deepest stage first (depth first, so microbatches finish
early); then a deferred W, which fills what would otherwise be a bubble.

Memory is reserved per microbatch: a rank admits microbatch k (runs its first forward on this
rank) only if ``budget`` units stay free for everything k will hold there, i.e. the weights of all
the rank's stages; each stage's share is released when its W ends. Admission is in microbatch
order on every rank, so the oldest unfinished microbatch is always admitted everywhere and can
finish: the result never deadlocks as long as budget >= 1.

With routes (``num_routes`` copies of the stages, microbatch m through copy ``routes[m]``, see
``loom.schedule.ir``) depth is the stage's position on its route, ties go to the older
microbatch, and a microbatch is admitted at its route's first stage on the rank. Strict
microbatch order would serialise opposite routes (the next down microbatch would wait at rank 0
until the previous up one has crossed the whole pipeline), so a rank may admit a newer
microbatch first, but only while one unit stays free for the oldest one it has not admitted:
that unit is always there when the oldest unfinished microbatch arrives, so the argument above
still holds. With one route, the oldest is always the next arrival, and this is plain order.

Why a policy of its own: routes. With one route it makes exactly the choices of the search's
``search_greedy.list_schedule`` at its default ``Knobs()`` on these unit costs (v_half and v_min
equal it, tests/unit/schedule/test_pipeline_schedules.py checks), but ``search_greedy`` knows
one route only: it admits and orders forwards by stage index, not by position on a route.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from fractions import Fraction

from loom.schedule.ir import Action, Schedule
from loom.schedule.replay import CODE_OP, EPS, F, I, W, Costs, Row
from loom.schedule.search_loop import run


def greedy_schedule(
    name: str,
    placement: Sequence[int],
    microbatches: int,
    budget: float,
    num_routes: int = 1,
    routes: Sequence[int] = (),
) -> Schedule:
    if budget < 1:
        raise ValueError(f"{name}: a memory budget below 1 unit cannot hold one microbatch")
    # The schedule's own route arithmetic (stages per route, first/last, stage weights).
    shape = Schedule(len(placement), microbatches, placement,
                     [[] for _ in range(max(placement) + 1)], num_routes=num_routes,
                     routes=tuple(routes))
    num_stages, pp_size, depth = len(placement), shape.pp_size, shape.stages_per_route
    m = microbatches
    stages_of = [shape.stages_of(r) for r in range(pp_size)]
    first = [shape.is_first(s) for s in range(num_stages)]
    last = [shape.is_last(s) for s in range(num_stages)]
    # visitors[s]: the microbatches that go through stage s, in order
    visitors = [[mb for mb in range(m) if s in shape.route_stages(mb)] for s in range(num_stages)]
    # entry[s]: s is its route's first stage on its rank (a microbatch is admitted there)
    entry = [s == min(t for t in stages_of[placement[s]] if t // depth == s // depth)
             for s in range(num_stages)]
    fin_f = [-1.0] * (num_stages * m)  # finish times, index stage * m + microbatch
    fin_i = [-1.0] * (num_stages * m)
    next_f = [0] * num_stages  # index into visitors[stage]
    next_i = [0] * num_stages
    # waiting[r]: microbatches not yet admitted on rank r, oldest first
    waiting = [sorted({mb for s in stages_of[r] for mb in visitors[s]}) for r in range(pp_size)]
    # Memory in whole units of 1/scale[r] (the stage weights' common denominator on rank r), so
    # that the admission test compares ints; cap[r] is the budget's floor in those units.
    weights = shape.stage_weights
    scale = [math.lcm(*(weights[s].denominator for s in stages)) for stages in stages_of]
    weight = [int(weights[s] * scale[placement[s]]) for s in range(num_stages)]
    budget_units = Fraction(budget).limit_denominator(1000)
    cap = [math.floor(budget_units * scale[r]) for r in range(pp_size)]
    reserved = [0] * pp_size
    deferred_w: list[deque[tuple[int, int]]] = [deque() for _ in range(pp_size)]

    def order(action: tuple[int, int, int]) -> tuple[int, int]:  # deepest on its route, oldest
        return -(action[0] % depth), action[2]

    def decide(r: int, t: float) -> tuple[tuple[int, int, int], float] | float:
        now = t + EPS  # an input that arrives by then counts as there
        backward, forward = [], []
        for s in stages_of[r]:
            if next_i[s] < len(visitors[s]):
                k = visitors[s][next_i[s]]
                if 0 <= fin_f[s * m + k] <= now and (
                        last[s] or 0 <= fin_i[(s + 1) * m + k] <= now):
                    backward.append((s, I, k))
            if next_f[s] < len(visitors[s]):
                k = visitors[s][next_f[s]]
                if entry[s] and reserved[r] + scale[r] * (
                        1 if k == waiting[r][0] else 2) > cap[r]:
                    continue  # no room to admit k (a newer microbatch leaves one unit free)
                if first[s] or 0 <= fin_f[(s - 1) * m + k] <= now:
                    forward.append((s, F, k))
        for ready in (backward, forward):
            if ready:
                return min(ready, key=order), t
        if deferred_w[r]:
            s, k = deferred_w[r][0]
            return (s, W, k), t
        return float("inf")  # look again when an action ends here or a message arrives

    def commit(r: int, action: tuple[int, int, int], end: float) -> None:
        s, o, k = action
        if o == F:
            fin_f[s * m + k] = end
            next_f[s] += 1
            if entry[s]:
                waiting[r].remove(k)
                reserved[r] += scale[r]
        elif o == I:
            fin_i[s * m + k] = end
            next_i[s] += 1
            deferred_w[r].append((s, k))
        else:
            deferred_w[r].popleft()
            reserved[r] -= weight[s]

    rows: list[Row] = [[] for _ in range(pp_size)]
    unit = Costs(((1.0,) * 4,) * num_stages, 0.0)  # F, I, W (B is never scheduled)
    started = run(placement, unit, rows, [0.0] * pp_size, decide, commit)
    if started < 3 * sum(len(v) for v in visitors):  # cannot happen when budget >= 1
        raise RuntimeError(f"{name}: greedy scheduler stalled after {started} actions")
    return Schedule(num_stages, m, tuple(placement),
                    tuple(tuple(Action(s, CODE_OP[o], k) for s, o, k in row) for row in rows),
                    name=name, num_routes=num_routes, routes=tuple(routes))
