"""A greedy list scheduler under a per-rank memory budget (v_half, v_min, bidirectional_v).

It simulates unit-time execution (F = I = W = 1, B = 2) and lets every free rank start the most
useful ready action: a backward (I or B) first, since it frees memory and unblocks the rank
before; then a forward, the deepest stage first (depth first, so microbatches finish early);
then a deferred W, which fills what would otherwise be a bubble.

Memory is reserved per microbatch: a rank admits microbatch k (runs its first forward on this
rank) only if ``budget`` units stay free for everything k will hold there, i.e. the weights of all
the rank's stages; each stage's share is released when its last backward piece ends. Admission
is in microbatch order on every rank, so the oldest unfinished microbatch is always admitted
everywhere and can finish: the result never deadlocks as long as budget >= 1.

With routes (``num_routes`` copies of the stages, microbatch m through copy ``routes[m]``, see
``loom.schedule.ir``) depth is the stage's position on its route, ties go to the older
microbatch, and a microbatch is admitted at its route's first stage on the rank. Strict
microbatch order would serialise opposite routes (the next down microbatch would wait at rank 0
until the previous up one has crossed the whole pipeline), so a rank may admit a newer
microbatch first, but only while one unit stays free for the oldest one it has not admitted:
that unit is always there when the oldest unfinished microbatch arrives, so the argument above
still holds. With one route, the oldest is always the next arrival, and this is plain order.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from loom.schedule.ir import Action, Op, Schedule

_DURATION = {Op.F: 1, Op.I: 1, Op.W: 1, Op.B: 2}


def greedy_schedule(
    name: str,
    placement: Sequence[int],
    microbatches: int,
    budget: float,
    split_backward: bool,
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
    stages_of = [list(shape.stages_of(r)) for r in range(pp_size)]
    weight = [shape.stage_weight(s) for s in range(num_stages)]
    # visitors[s]: the microbatches that go through stage s, in order
    visitors = [[mb for mb in range(microbatches) if s in shape.route_stages(mb)]
                for s in range(num_stages)]
    entry = {(r, s // depth): min(t for t in stages_of[r] if t // depth == s // depth)
             for r in range(pp_size) for s in stages_of[r]}  # (rank, route) -> first stage
    backward = Op.I if split_backward else Op.B
    finish: dict[tuple[int, Op, int], int] = {}  # (stage, op, mb) -> finish time
    next_forward = [0] * num_stages  # index into visitors[stage]
    next_backward = [0] * num_stages
    # waiting[r]: microbatches not yet admitted on rank r, oldest first
    waiting = [sorted({mb for s in stages_of[r] for mb in visitors[s]}) for r in range(pp_size)]
    reserved = [Fraction(0)] * pp_size
    deferred_w: list[list[tuple[int, int]]] = [[] for _ in range(pp_size)]
    busy_until = [0] * pp_size
    rows: list[list[Action]] = [[] for _ in range(pp_size)]
    limit = Fraction(budget).limit_denominator(1000)
    total = sum(len(v) for v in visitors) * (3 if split_backward else 2)
    done, time = 0, 0

    def finished(stage: int, op: Op, mb: int) -> bool:
        return finish.get((stage, op, mb), time + 1) <= time

    def order(action: Action) -> tuple[int, int]:  # deepest on its route first, then oldest
        return -(action.stage % depth), action.microbatch

    def candidates(rank: int):
        ready = []
        for stage in stages_of[rank]:
            if next_backward[stage] < len(visitors[stage]):
                mb = visitors[stage][next_backward[stage]]
                if finished(stage, Op.F, mb) and (
                    shape.is_last(stage) or finished(stage + 1, backward, mb)
                ):
                    ready.append(Action(stage, backward, mb))
        yield from sorted(ready, key=order)
        ready = []
        for stage in stages_of[rank]:
            if next_forward[stage] < len(visitors[stage]):
                mb = visitors[stage][next_forward[stage]]
                first_here = stage == entry[rank, stage // depth]
                fits = first_here and reserved[rank] + (1 if mb == waiting[rank][0] else 2) \
                    <= limit  # a newer microbatch leaves one unit for the oldest
                if (shape.is_first(stage) or finished(stage - 1, Op.F, mb)) and (
                    not first_here or fits
                ):
                    ready.append(Action(stage, Op.F, mb))
        yield from sorted(ready, key=order)
        if deferred_w[rank]:
            yield Action(deferred_w[rank][0][0], Op.W, deferred_w[rank][0][1])

    while done < total:
        if time > 4 * total + 4 * num_stages:  # cannot happen when budget >= 1; fail loudly
            raise RuntimeError(f"{name}: greedy scheduler made no progress by step {time}")
        for rank in range(pp_size):
            if busy_until[rank] > time:
                continue
            action = next(candidates(rank), None)
            if action is None:
                continue
            stage, op, mb = action.stage, action.op, action.microbatch
            rows[rank].append(action)
            finish[(stage, op, mb)] = busy_until[rank] = time + _DURATION[op]
            done += 1
            if op is Op.F:
                next_forward[stage] += 1
                if stage == entry[rank, stage // depth]:
                    waiting[rank].remove(mb)
                    reserved[rank] += 1
            elif op is Op.W or op is Op.B:
                if op is Op.W:
                    deferred_w[rank].pop(0)
                else:
                    next_backward[stage] += 1
                reserved[rank] -= weight[stage]
            else:
                next_backward[stage] += 1
                deferred_w[rank].append((stage, mb))
        time += 1
    return Schedule(num_stages, microbatches, tuple(placement), tuple(tuple(r) for r in rows),
                    name=name, num_routes=num_routes, routes=tuple(routes))
