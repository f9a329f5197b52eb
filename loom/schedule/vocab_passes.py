"""Vocabulary parallelism's passes in a pipeline schedule (Yeung et al. 2024, arXiv 2411.05288).

With vocabulary parallelism the output layer (and its loss) is split over the vocabulary onto all
p pipeline ranks instead of sitting on the last one. Each microbatch's output layer then runs as
two passes on every rank (``Op.S``, ``Op.T`` of ``loom.schedule.ir``), with two barriers over
the ranks (``loom.schedule.validate.dependencies``)::

    last stage F(m) --X--> S(r, m) on every r --stats--> T(r, m) on every r --dX--> last I/B(m)

S computes the shard's logits and their softmax statistics (row max, sum of exponentials, the
target's logit); T combines every shard's statistics into the loss, computes the shard's weight
gradient and its part of dX, which the last stage sums before its backward. (The runtime's side
is ``loom.parallel.vocab_pipeline``; the input embedding's shards run at the edges of the step,
outside the schedule, as its lookup and gradient scatter are cheap and need no barrier inside.)

Placing the passes (the paper's §5, "a generalizable method"): time the schedule without them,
then put S(m) on every rank where the last stage's F(m) has finished, and T(m) where the last
stage's backward of m starts (before the action running then), so each barrier waits across
the compute between them instead of stalling it. Simulated (``bench/vocab_pipeline.py
--simulate``), 1F1B with one extra warm-up forward comes within 4.3% of the ideal (the work
spread evenly, plain 1F1B's bubble) at p = 4 and 8. The paper's 1F1B variant delays every backward by one more warm-up forward per
barrier it hides (``vocab_1f1b``: ``delay`` extra warm-ups, peak activations p + delay on the
first rank, the paper's p + 1 / p + 2). Any one-route schedule takes the same insertion: on a V
placement (``zbv``) the last stage sits on rank 0 beside the first, which is the paper's V
variant (V-Half) of balanced memory.

Written here, not taken from the paper's code (a Megatron fork with per-schedule hand-placed
passes): in Loom schedules are data, so one insertion over the replayed times serves every
family, and the validator, simulator and runtime read the result like any other schedule.
"""

from __future__ import annotations

import bisect

from loom.schedule.families._common import check_sizes, make_schedule, one_forward_one_backward
from loom.schedule.ir import Action, Op, Schedule, looped_placement
from loom.schedule.replay import Costs, encode, replay

# S and T of one microbatch are due at the same moment on several ranks: S before T, then by
# microbatch (any order is correct: each pass's messages are matched by tag, not by order).
_ORDER = {Op.S: 0, Op.T: 1}


def insert_vocab_passes(schedule: Schedule, costs: Costs | None = None) -> Schedule:
    """``schedule`` with S and T of every microbatch on every rank, placed by the times of a
    replay of ``schedule`` with ``costs`` (default F = I = W = 1, B = 2: a backward twice a
    forward, so the placement matches the usual profile; with one step per action a B would
    look as short as an F and T would land after a real B, late): S(m) before the first action
    that starts once the last stage's F(m) has finished (X is there), T(m) before the action
    still running when the last stage's backward of m is due (and after S(m)), so every
    shard's part of dX is ready by then: right before that backward on the last rank. The
    insertion points respect the replayed times' order of every dependency, so a deadlock-free
    schedule stays deadlock-free (the validator checks it anyway)."""
    if schedule.num_routes > 1:
        raise ValueError(f"{schedule.name}: vocabulary passes need one route (the output layer"
                         f" follows the last stage); it has {schedule.num_routes}")
    if schedule.has_vocab_passes or schedule.has_transfers:
        raise ValueError(f"{schedule.name}: already holds vocabulary passes or host transfers;"
                         " insert the vocabulary passes into the stages' schedule")
    rows = encode(schedule)
    costs = costs or Costs(((1, 1, 1, 2),) * schedule.num_stages, 0)  # B = I + W = 2 F
    replayed = replay(rows, schedule.placement, schedule.num_microbatches, costs)
    if not replayed.completed:
        raise ValueError(f"{schedule.name}: deadlocks before any vocabulary pass is added")
    last = schedule.num_stages - 1
    s_due, t_due = {}, {}
    for rank, row in enumerate(schedule.actions):
        ends = replayed.finish(rank)
        for action, start, end in zip(row, replayed.start[rank], ends):
            if action.stage != last:
                continue
            if action.op is Op.F:
                s_due[action.microbatch] = end
            elif action.op in (Op.I, Op.B):
                t_due[action.microbatch] = start
    out = []
    for rank, row in enumerate(schedule.actions):
        starts, ends = replayed.start[rank], replayed.finish(rank)
        inserted: list[list[Action]] = [[] for _ in range(len(row) + 1)]
        s_at: dict[int, int] = {}
        due = [(s_due[mb], _ORDER[Op.S], mb, Op.S) for mb in range(schedule.num_microbatches)]
        due += [(t_due[mb], _ORDER[Op.T], mb, Op.T) for mb in range(schedule.num_microbatches)]
        for time, _, mb, op in sorted(due):
            # S after what runs when X arrives; T before what runs when the last stage needs dX
            at = bisect.bisect_left(starts, time) if op is Op.S else \
                bisect.bisect_right(ends, time)
            inserted[max(at, s_at[mb]) if op is Op.T else at].append(Action(rank, op, mb))
            if op is Op.S:
                s_at[mb] = at
        merged: list[Action] = []
        for index, action in enumerate(row):
            merged.extend(inserted[index])
            merged.append(action)
        merged.extend(inserted[len(row)])
        out.append(tuple(merged))
    return Schedule(schedule.num_stages, schedule.num_microbatches, schedule.placement,
                    tuple(out), name=f"{schedule.name}+vocab")


def vocab_1f1b(pp_size: int, microbatches: int, delay: int = 1) -> Schedule:
    """The paper's 1F1B with vocabulary parallelism: 1F1B whose rank r runs
    min(p - 1 - r + ``delay``, m) warm-up forwards (peak activations p + delay on rank 0), with
    S and T inserted by ``insert_vocab_passes``. ``delay`` 1 lets the barrier after S overlap
    the last stage's next forward (the paper's Algorithm 2 block, p + 1); 2 overlaps both
    barriers (its Algorithm 1 block, p + 2); 0 is plain 1F1B, whose barriers stall."""
    check_sizes("1f1b", pp_size, microbatches)
    if delay < 0:
        raise ValueError(f"delay must be >= 0 extra warm-up forwards, got {delay}")
    rows = []
    for rank in range(pp_size):
        work = [(rank, mb) for mb in range(microbatches)]
        rows.append(one_forward_one_backward(work, work,
                                             min(pp_size - 1 - rank + delay, microbatches)))
    base = make_schedule(f"1f1b_delay{delay}", looped_placement(pp_size), microbatches, rows)
    return insert_vocab_passes(base)


def vocab_schedule(schedule: Schedule, delay: int = 1) -> Schedule:
    """The vocabulary-parallel form of a training schedule: the paper's ``vocab_1f1b`` for
    1F1B, the insertion into the schedule as it is for any other one-route family (V
    placements included)."""
    if schedule.name == "1f1b" and schedule.chunks_per_rank == 1 and schedule.pp_size > 1:
        return vocab_1f1b(schedule.pp_size, schedule.num_microbatches, delay)
    return insert_vocab_passes(schedule)


__all__ = ["insert_vocab_passes", "vocab_1f1b", "vocab_schedule"]
