"""Building blocks shared by the schedule generators (not part of the public API)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from itertools import repeat

from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.replay import OP_CODE, Row

# A unit of work for the generators: (stage, microbatch).
Work = tuple[int, int]


def check_sizes(family: str, pp_size: int, microbatches: int, min_microbatches: int = 1) -> None:
    """Reject impossible sizes with the family's own rule in the message."""
    if pp_size < 1:
        raise ValueError(f"{family}: pp_size must be >= 1, got {pp_size}")
    if microbatches < min_microbatches:
        raise ValueError(
            f"{family}: needs microbatches >= {min_microbatches} for pp_size={pp_size}, "
            f"got {microbatches} (nearest valid: {min_microbatches})"
        )


def make_schedule(
    name: str, placement: Sequence[int], microbatches: int, rows: Sequence[Sequence[Action]]
) -> Schedule:
    return Schedule(
        num_stages=len(placement),
        num_microbatches=microbatches,
        placement=tuple(placement),
        actions=tuple(tuple(row) for row in rows),
        name=name,
    )


def one_forward_one_backward(
    forwards: Sequence[Work],
    backwards: Sequence[Work],
    warmup: int,
    split_backward: bool = False,
    weight_delay: int = 0,
    codes: bool = False,
) -> list[Action] | Row:
    """One rank's 1F1B-shaped list: ``warmup`` forwards, then F,B pairs, then the last B's.

    With ``split_backward`` each backward is an I, and its W is emitted once ``weight_delay``
    later I's have been emitted (the zero-bubble trick: deferred W's fill bubbles); the
    remaining W's close the list. ``codes``: the same list as ``loom.schedule.replay.encode``'s
    integer triples (what the search prices), built without the ``Action`` objects.
    """
    # codes: the replay's integer triples (stage, op code, microbatch), no Action objects
    make = _triple if codes else Action
    code = OP_CODE.__getitem__ if codes else (lambda op: op)
    forward_op, weight_op = code(Op.F), code(Op.W)
    backward_op = code(Op.I if split_backward else Op.B)
    actions = [make(stage, forward_op, mb) for stage, mb in forwards[:warmup]]
    append = actions.append
    next_forward, total = warmup, len(forwards)
    deferred: deque[Work] = deque()
    for stage, mb in backwards:
        if next_forward < total:
            ahead, ahead_mb = forwards[next_forward]
            append(make(ahead, forward_op, ahead_mb))
            next_forward += 1
        append(make(stage, backward_op, mb))
        if split_backward:
            deferred.append((stage, mb))
            if len(deferred) > weight_delay:
                done, done_mb = deferred.popleft()
                append(make(done, weight_op, done_mb))
    actions.extend([make(stage, weight_op, mb) for stage, mb in deferred])
    return actions


def _triple(*fields: int) -> tuple[int, ...]:
    return fields


def microbatch_groups(microbatches: int, group_size: int) -> list[range]:
    """Split ``0..m-1`` into consecutive groups of at least ``group_size`` (when m allows).

    There are ``max(1, m // group_size)`` groups; the remainder ``m % group_size`` is spread one
    microbatch each over the first groups, so sizes differ by at most one and the larger groups
    come first. When ``m`` is a multiple of the group count this is exactly torch's
    ``microbatches_per_round`` rounds.
    """
    rounds = max(1, microbatches // group_size)
    base, extra = divmod(microbatches, rounds)
    groups, start = [], 0
    for index in range(rounds):
        size = base + (1 if index < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


class RankWriter:
    """Appends one rank's actions for its local chunks, numbering microbatches per (chunk, op)."""

    def __init__(self, stages: tuple[int, int]):
        self.stages = stages
        self.actions: list[Action] = []
        self.count: Counter[tuple[int, Op]] = Counter()

    def add(self, chunk: int, op: Op) -> None:
        self.actions.append(Action(self.stages[chunk], op, self.count[chunk, op]))
        self.count[chunk, op] += 1

    def repeat(self, times: int, body: tuple[tuple[int, Op], ...], keep: int) -> None:
        """``times`` rounds of ``add`` over ``body``, where only microbatches below ``keep``
        are kept: the rounds past the last that numbers one are counted, not made. The counts
        end as the full loop leaves them, so what follows numbers its actions alike; a family
        generated for more microbatches than it keeps (ZB-V below 2p - 1) then costs what it
        keeps, not p^2 actions."""
        useful = max((keep - self.count[key] for key in body), default=0)
        made = min(times, max(useful, 0))
        for _ in range(made):
            for chunk, op in body:
                if self.count[chunk, op] < keep:
                    self.add(chunk, op)
                else:
                    self.count[chunk, op] += 1
        for key in body:
            self.count[key] += times - made


def looped_work(rank: int, pp_size: int, chunks: int, groups: list[range]
                ) -> tuple[list[Work], list[Work]]:
    """Rank ``rank``'s forwards and backwards in a looped placement of ``chunks`` stages per rank
    (stage ``c * p + rank``), group by group of microbatches: forwards through the chunks in
    order, backwards in reverse, as interleaved 1F1B and the interleaved zero bubble run them."""
    forwards: list[Work] = []
    backwards: list[Work] = []
    for group in groups:
        for chunk in range(chunks):
            forwards.extend(zip(repeat(chunk * pp_size + rank), group))  # (stage, mb) pairs
            backwards.extend(zip(repeat((chunks - 1 - chunk) * pp_size + rank), group))
    return forwards, backwards
