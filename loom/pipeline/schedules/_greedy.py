"""A greedy list scheduler under a per-rank memory budget (used by v_half, v_min, hanayo).

It simulates unit-time execution (F = I = W = 1, B = 2) and lets every free rank start the most
useful ready action: a backward (I or B) first, since it frees memory and unblocks the rank
before; then a forward, the deepest stage first (depth first, so microbatches finish early);
then a deferred W, which fills what would otherwise be a bubble.

Memory is reserved per microbatch: a rank admits microbatch k (runs its first forward on this
rank) only if ``budget`` units stay free for everything k will hold there, i.e. the weights of all
the rank's stages; each stage's share is released when its last backward piece ends. Admission
is in microbatch order on every rank, so the oldest unfinished microbatch is always admitted
everywhere and can finish: the result never deadlocks as long as budget >= 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from loom.pipeline.ir import Action, Op, Schedule
from loom.pipeline.schedules._common import make_schedule

_DURATION = {Op.F: 1, Op.I: 1, Op.W: 1, Op.B: 2}


def greedy_schedule(
    name: str,
    placement: Sequence[int],
    microbatches: int,
    budget: float,
    split_backward: bool,
) -> Schedule:
    if budget < 1:
        raise ValueError(f"{name}: a memory budget below 1 unit cannot hold one microbatch")
    num_stages, pp_size = len(placement), max(placement) + 1
    stages_of = [[s for s in range(num_stages) if placement[s] == r] for r in range(pp_size)]
    weight = [Fraction(1, len(stages_of[placement[s]])) for s in range(num_stages)]
    backward = Op.I if split_backward else Op.B
    finish: dict[tuple[int, Op, int], int] = {}  # (stage, op, mb) -> finish time
    next_forward = [0] * num_stages
    next_backward = [0] * num_stages
    admitted = [0] * pp_size  # microbatches admitted on each rank
    reserved = [Fraction(0)] * pp_size
    deferred_w: list[list[tuple[int, int]]] = [[] for _ in range(pp_size)]
    busy_until = [0] * pp_size
    rows: list[list[Action]] = [[] for _ in range(pp_size)]
    limit = Fraction(budget).limit_denominator(1000)
    total = num_stages * microbatches * (3 if split_backward else 2)
    done, time = 0, 0

    def finished(stage: int, op: Op, mb: int) -> bool:
        return finish.get((stage, op, mb), time + 1) <= time

    def candidates(rank: int):
        for stage in sorted(stages_of[rank], reverse=True):  # backwards: deepest stage first
            mb = next_backward[stage]
            if mb < microbatches and finished(stage, Op.F, mb) and (
                stage == num_stages - 1 or finished(stage + 1, backward, mb)
            ):
                yield Action(stage, backward, mb)
        for stage in sorted(stages_of[rank], reverse=True):
            mb = next_forward[stage]
            first_here = stage == stages_of[rank][0]
            fits = mb < admitted[rank] or reserved[rank] + 1 <= limit
            if mb < microbatches and (stage == 0 or finished(stage - 1, Op.F, mb)) and (
                not first_here or fits
            ):
                yield Action(stage, Op.F, mb)
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
                if stage == stages_of[rank][0]:
                    admitted[rank] += 1
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
    return make_schedule(name, placement, microbatches, rows)
