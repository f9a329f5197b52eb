"""Fast evaluation of candidate schedules for ``loom.schedule.search``: float replay and memory.

The search compares hundreds of candidate orders, some with 50,000 actions (p=32, m=256, two
chunks per rank). ``loom.schedule.simulate`` is the reference (exact numbers, a timeline, memory
curves) but spends most of its time hashing ``Action`` objects; here every action is an integer
and every time a float, which is about ten times faster. The search ranks candidates with this
replay and re-simulates only the winner with ``simulate``, so the reported figures are always
the reference ones.

``Costs`` holds what the replay needs, already scaled for the candidate's placement (see
``loom.schedule.search.placement_costs``): per-stage durations of F, I, W and B as floats, and the
send time between two different ranks. The replay follows the same rules as ``simulate``: each
rank runs its list in order, an action starts when its rank is free and its dependencies (plus
the send time across ranks) have finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.cost import StageCosts

# Integer op codes: index into Costs.duration[stage].
F, I, W, B = 0, 1, 2, 3
OP_CODE = {Op.F: F, Op.I: I, Op.W: W, Op.B: B}
CODE_OP = (Op.F, Op.I, Op.W, Op.B)
EPS = 1e-9  # float slack for memory limits and makespan comparisons


@dataclass(frozen=True)
class Costs:
    """Float costs of one placement: ``duration[stage][op code]`` and the cross-rank send time."""

    duration: tuple[tuple[float, float, float, float], ...]
    send: float

    @classmethod
    def of(cls, costs: StageCosts, schedule_like: Schedule) -> Costs:
        """Float copy of ``costs`` (already placement-scaled) for ``schedule_like``'s stages."""
        duration = tuple(
            tuple(float(costs.op_costs(stage).of(op)) for op in CODE_OP)
            for stage in range(schedule_like.num_stages)
        )
        send = float(costs.latency)
        if costs.bandwidth is not None:
            send += float(costs.message_bytes) / float(costs.bandwidth)
        return cls(duration, send)  # type: ignore[arg-type]


Row = list[tuple[int, int, int]]  # one rank's actions as (stage, op code, microbatch)


def encode(schedule: Schedule) -> list[Row]:
    """The schedule's rows as integer triples."""
    return [[(a.stage, OP_CODE[a.op], a.microbatch) for a in row] for row in schedule.actions]


def decode(rows: Sequence[Row], like: Schedule, name: str) -> Schedule:
    """A ``Schedule`` with ``like``'s shape and placement and the given integer rows."""
    return Schedule(
        num_stages=like.num_stages,
        num_microbatches=like.num_microbatches,
        placement=like.placement,
        actions=tuple(tuple(Action(s, CODE_OP[o], k) for s, o, k in row) for row in rows),
        name=name,
    )


def replay(
    rows: Sequence[Row], placement: Sequence[int], microbatches: int, costs: Costs
) -> float | None:
    """Makespan of the in-order execution of ``rows``; None if it deadlocks.

    Same semantics as ``loom.schedule.simulate``: a backward (I or B) of stage s needs F of s and the
    input gradient of s+1, which is I(s+1) when that (stage, microbatch) was split, else B(s+1).
    """
    timed = _run(rows, placement, microbatches, costs)
    return None if timed is None else max(timed[1])


@dataclass(frozen=True)
class Score:
    """What the search ranks by: makespan, then the idle time inside the longest rank span
    (``SimResult.bubble_time_zb``: the Zero Bubble paper's bubble, before dividing by the span)."""

    makespan: float
    idle_zb: float

    def key(self) -> tuple[float, float]:
        """Sort key: makespan first, idle second, both rounded so float noise cannot reorder."""
        return (round(self.makespan / EPS) * EPS, round(self.idle_zb / EPS) * EPS)

    def better_than(self, other: Score) -> bool:
        return (self.makespan < other.makespan - EPS
                or (self.makespan < other.makespan + EPS and self.idle_zb < other.idle_zb - EPS))


def score(
    rows: Sequence[Row], placement: Sequence[int], microbatches: int, costs: Costs
) -> Score | None:
    """Makespan and Zero-Bubble idle time of ``rows`` (as ``simulate`` computes them); None on a
    deadlock. The idle time is the longest span's (lowest rank on a tie) minus that rank's work."""
    timed = _run(rows, placement, microbatches, costs)
    if timed is None:
        return None
    first, free_at = timed
    duration = costs.duration
    best_rank, best_span = -1, -1.0
    for rank, row in enumerate(rows):
        span = free_at[rank] - first[rank] if row else 0.0
        if span > best_span + EPS:
            best_rank, best_span = rank, span
    busy = sum(duration[s][o] for s, o, _ in rows[best_rank])
    return Score(max(free_at), max(best_span - busy, 0.0))


def _run(
    rows: Sequence[Row], placement: Sequence[int], microbatches: int, costs: Costs
) -> tuple[list[float], list[float]] | None:
    """Per rank: the start of its first action and the end of its last; None on a deadlock."""
    num_stages, m = len(placement), microbatches
    size = num_stages * m
    finish = [-1.0] * (4 * size)  # index op * size + stage * m + mb
    split = bytearray(size)
    for row in rows:
        for s, o, k in row:
            if o == I:
                split[s * m + k] = 1
    pointer = [0] * len(rows)
    free_at = [0.0] * len(rows)
    first = [0.0] * len(rows)
    duration, send = costs.duration, costs.send
    waiting: dict[int, list[int]] = {}
    runnable = list(range(len(rows)))
    while runnable:
        rank = runnable.pop()
        row = rows[rank]
        t_free = free_at[rank]
        index = pointer[rank]
        while index < len(row):
            s, o, k = row[index]
            start = t_free
            blocker = -1
            if o == F:
                if s > 0:
                    dep = (s - 1) * m + k
                    t = finish[dep]
                    if t < 0:
                        blocker = dep
                    else:
                        t += send if placement[s - 1] != placement[s] else 0.0
                        start = t if t > start else start
            elif o == W:
                dep = size + s * m + k
                t = finish[dep]
                if t < 0:
                    blocker = dep
                elif t > start:
                    start = t
            else:
                dep = s * m + k
                t = finish[dep]
                if t < 0:
                    blocker = dep
                else:
                    start = t if t > start else start
                    if s + 1 < num_stages:
                        nxt = (s + 1) * m + k
                        dep = (size if split[nxt] else 3 * size) + nxt
                        t = finish[dep]
                        if t < 0:
                            blocker = dep
                        else:
                            t += send if placement[s + 1] != placement[s] else 0.0
                            start = t if t > start else start
            if blocker >= 0:
                waiting.setdefault(blocker, []).append(rank)
                break
            if index == 0:
                first[rank] = start
            t_free = start + duration[s][o]
            key = o * size + s * m + k
            finish[key] = t_free
            index += 1
            woken = waiting.pop(key, None)
            if woken:
                runnable.extend(woken)
        pointer[rank] = index
        free_at[rank] = t_free
    if any(pointer[r] < len(row) for r, row in enumerate(rows)):
        return None
    return first, free_at


def peak_units(rows: Sequence[Row], placement: Sequence[int]) -> list[float]:
    """Peak live activation units per rank, as ``loom.schedule.validate.memory_profile``."""
    per_rank = [0] * (max(placement) + 1)
    for rank in placement:
        per_rank[rank] += 1
    peaks = []
    for rank, row in enumerate(rows):
        weight = 1.0 / per_rank[rank] if per_rank[rank] else 0.0
        last: dict[tuple[int, int], int] = {}
        for index, (s, o, k) in enumerate(row):
            if o == W or o == B:
                last[(s, k)] = index
        live = peak = 0.0
        for index, (s, o, k) in enumerate(row):
            if o == F:
                live += weight
                peak = live if live > peak else peak
            if last.get((s, k)) == index:
                live -= weight
        peaks.append(peak)
    return peaks


def fits(rows: Sequence[Row], placement: Sequence[int], limit: float) -> bool:
    return max(peak_units(rows, placement), default=0.0) <= limit + EPS
