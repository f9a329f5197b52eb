"""The one replay engine: every rank runs its list in order; times, and memory by order.

Actions are integer-coded ``(stage, op code, microbatch)`` triples (``encode`` / ``decode``), and
durations a table by stage and op code (``Costs``), so that one fast loop serves the validator
(``validate.execute``: unit steps), the simulator (``simulate``: exact costs, Fractions scaled to
ints by ``Costs.exact``) and the search, which ranks (``score``) hundreds of candidate orders of
up to 50,000 actions (p=32, m=256, two chunks per rank) with float costs.

Rules (``loom.schedule.validate.dependencies`` states them on ``Action`` objects): F(s,k) needs
F(s-1,k); I or B(s,k) needs F(s,k) and I(s+1,k) when that pair is split into I and W, else
B(s+1,k); W(s,k) needs I(s,k); first and last stages are those of the microbatch's route. An
action starts when its rank is free and its dependencies have finished, plus the send time from
another rank. Nothing is shared between ranks (each link is its own, sends overlap compute and do
not contend: the ZB paper's T_comm model), so start times follow from earlier finish times alone:
a rank resumes when the action it waits for finishes, which gives the times of a discrete-event
loop over a global clock without one.

Vocabulary parallelism (``Op.S`` / ``Op.T``, codes 4 and 5; ``loom.schedule.vocab_passes``): S of
shard r and microbatch k needs the last stage's F(k) (its output goes to every rank); T needs
every shard's S(k) (their softmax statistics), and the last stage's I or B of k needs every
shard's T(k) (their parts of its output gradient). A barrier over all shards is one more finish
time per microbatch, set when the last shard's pass of that microbatch finishes. Their durations
are the 5th and 6th entries of each stage's row of ``Costs.duration`` (the same on every row).

Memory by order (``live_levels``): a (stage, microbatch) is live on its rank from the start of
its F to the end of its last backward piece (W, or B when not split). S and T are not counted.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from numbers import Rational

from loom.schedule.compiled import loops_for
from loom.schedule.cost import Number, StageCosts
from loom.schedule.ir import Action, Op, Schedule

# Integer op codes: the second item of an action triple, and the index into a stage's durations.
F, I, W, B = 0, 1, 2, 3
S, T = 4, 5  # vocabulary parallelism's output-layer passes (their number is the shard)
CODE_OP = (Op.F, Op.I, Op.W, Op.B)  # a stage's compute ops: the rows of a stage's costs
VOCAB_OPS = (Op.S, Op.T)
ALL_OPS = CODE_OP + VOCAB_OPS  # by op code
OP_CODE = {op: code for code, op in enumerate(ALL_OPS)}
EPS = 1e-9  # float slack for the search's memory limits and makespan comparisons

Row = list[tuple[int, int, int]]  # one rank's actions as (stage, op code, microbatch)


def encode(schedule: Schedule) -> list[Row]:
    """The schedule's rows as integer triples."""
    return [encode_row(row) for row in schedule.actions]


def encode_row(row: Sequence[Action]) -> Row:
    return [(a.stage, OP_CODE[a.op], a.microbatch) for a in row]


def decode(rows: Sequence[Row], like: Schedule, name: str) -> Schedule:
    """A ``Schedule`` with ``like``'s shape, placement and routes and the given integer rows."""
    return Schedule(
        num_stages=like.num_stages,
        num_microbatches=like.num_microbatches,
        placement=like.placement,
        actions=tuple(tuple(Action(s, ALL_OPS[o], k) for s, o, k in row) for row in rows),
        name=name,
        num_routes=like.num_routes,
        routes=like.routes,
    )


@dataclass(frozen=True)
class Costs:
    """What the replay needs: ``duration[stage][op code]`` and the send time between two ranks."""

    duration: tuple[tuple[Number, ...], ...]  # [stage][op code]
    send: Number

    @classmethod
    def of(cls, costs: StageCosts, schedule_like: Schedule) -> Costs:
        """Float copy of ``costs`` for ``schedule_like``'s stages (the search's ranking)."""
        send = float(costs.latency)
        if costs.bandwidth is not None:
            send += float(costs.message_bytes) / float(costs.bandwidth)
        return cls(tuple(tuple(float(costs.op_costs(stage).of(op)) for op in CODE_OP)
                         for stage in range(schedule_like.num_stages)), send)

    @classmethod
    def exact(cls, costs: StageCosts, num_stages: int,
              vocab: tuple[Number, Number] | None = None) -> tuple[Costs, int | None]:
        """``costs`` as ints and their scale when they are all exact (``to_ints``), else as they
        are and None: a replay on them gives every time exactly, times the scale. ``vocab``:
        the durations of S and T (vocabulary passes), appended to every stage's row."""
        extra = list(vocab or ())
        flat, scale = to_ints([costs.message_time(), *extra,
                               *(costs.op_costs(stage).of(op) for stage in range(num_stages)
                                 for op in CODE_OP)])
        first = 1 + len(extra)
        tail = tuple(flat[1:first])
        return cls(tuple(tuple(flat[first + 4 * stage:first + 4 + 4 * stage]) + tail
                         for stage in range(num_stages)), flat[0]), scale


def with_vocab(costs: Costs, s_time: Number, t_time: Number) -> Costs:
    """``costs`` with the durations of the vocabulary passes S and T appended to every row."""
    return Costs(tuple(tuple(row[:4]) + (s_time, t_time) for row in costs.duration), costs.send)


def to_ints(values: list) -> tuple[list, int | None]:
    """``values`` (None among them kept) times their common denominator, and that scale, when
    all are ints or Fractions; as they are and None otherwise (a float among them), or when the
    scale is 1 (whole Fractions stay Fractions, so that ratios of results stay exact)."""
    exact = [value for value in values if value is not None]
    if not all(isinstance(value, Rational) for value in exact):
        return values, None
    scale = math.lcm(*(Fraction(value).denominator for value in exact))
    return ([None if value is None else int(value * scale) for value in values] if scale > 1
            else values), scale


def from_ints(rows: list[list[int]], scale: int | None, cache: dict | None = None
              ) -> list[list[Number]]:
    """The inverse of ``to_ints`` for rows of numbers computed from them: ``Fraction(x, scale)``
    (exact; ratios of them stay exact), or as they are for scale 1 or None. Each distinct value is
    converted once: most recur (a rank's start is often its last finish). ``cache``: value ->
    its Fraction at this ``scale``, kept across calls (``simulate``'s memory curve has the
    timeline's times), filled as values come."""
    if scale is None or scale == 1:
        return rows
    values = {value for row in rows for value in row}
    if cache is None:
        exact = {value: Fraction(value, scale) for value in values}
    else:
        exact = cache
        exact.update({value: Fraction(value, scale) for value in values.difference(exact)})
    return [[exact[value] for value in row] for row in rows]


@dataclass(frozen=True)
class Replayed:
    """Per rank, the start of each action that ran (a prefix of its list, in order) and the end
    of the last one; ``completed`` when every list ran to its end."""

    rows: Sequence[Row]
    costs: Costs
    start: list[list[Number]]
    end: list[Number]

    @property
    def completed(self) -> bool:
        return all(len(starts) == len(row) for starts, row in zip(self.start, self.rows))

    def finish(self, rank: int) -> list[Number]:
        """The finish of each action of ``rank`` that ran: its start plus its duration."""
        duration = self.costs.duration
        return [t + duration[s][o] for (s, o, _), t in zip(self.rows[rank], self.start[rank])]


def replay(rows: Sequence[Row], placement: Sequence[int], microbatches: int, costs: Costs,
           stages_per_route: int = 0) -> Replayed:
    """Every rank runs its list in order, each action as soon as its rank is free and its
    dependencies have finished (the module docstring's rules). A rank whose next action waits for
    one that never runs (a deadlock, or a dependency that is not scheduled) stops there.
    ``stages_per_route``: of one route, when the schedule has several (0: all the stages). An
    action scheduled twice runs twice; its dependents wait for the first one replayed."""
    num_stages = len(placement)
    route = stages_per_route or num_stages
    stages, mbs, base, ops = _index_space(rows, num_stages, microbatches)
    vocab = S in ops or T in ops
    low = -(base // mbs)  # the lowest stage of the index space (below 0 when widened)
    size = stages * mbs
    # index (op * stages + stage) * mbs + mb; with S and T, then the barriers "every shard's S of
    # microbatch k" (at 6 * size + k) and "every shard's T of k" (at 6 * size + mbs + k)
    finish: list[Number | None] = [None] * ((6 * size + 2 * mbs) if vocab else 4 * size)
    # split[(stage, microbatch)]: its backward runs as I and W (else as one B). Without any B
    # every pair is split: one that has no I has no backward at all, and a rank waiting for it
    # waits forever either way (the same replay); likewise without any I none is.
    if B not in ops:
        split = b"\x01" * size
    elif I not in ops:
        split = bytes(size)
    else:
        split = bytearray(size)
        for n in [s * mbs + k + base for row in rows for s, o, k in row if o == I]:
            split[n] = 1
    duration, send = costs.duration, costs.send
    # Per stage, precomputed once (the loop below runs once per action): where its F's input
    # (the previous stage's F) and its backward's input (the next stage's I or B) are, by flat
    # index less the microbatch (-1: the first / last stage of its route, no input), whether
    # those messages cross ranks, and the index bases of its own actions by op code.
    span = range(low, low + stages)
    crosses = bool(send)

    def crossing(a: int, b: int) -> bool:  # (a broken schedule's stages outside: no send)
        return crosses and 0 <= min(a, b) and max(a, b) < num_stages and placement[a] != placement[b]

    f_input = [(s - 1) * mbs + base if s % route else -1 for s in span]
    # -1: the last stage of its route has no next stage; -2: ... and waits for every shard's T
    b_input = [(s + 1) * mbs + base if (s + 1) % route else (-2 if vocab else -1) for s in span]
    f_send = [f_input[n] >= 0 and crossing(s - 1, s) for n, s in enumerate(span)]
    b_send = [b_input[n] >= 0 and crossing(s + 1, s) for n, s in enumerate(span)]
    shards = len(rows)
    if vocab:  # the vocabulary passes' inputs: the last stage's F, then the barriers
        last_f = (num_stages - 1) * mbs + base
        barrier = 6 * size
        passes_done = [0] * (2 * mbs)  # shards whose S (then T) of microbatch k has finished
        passes_end: list[Number] = [0] * (2 * mbs)  # ... and the latest of their finishes
        many = crosses and shards > 1  # a barrier gathers messages from other ranks
    own = [s * mbs + base for s in span]
    if low:  # a broken schedule's stages below 0: index the tables by stage
        f_input, b_input, f_send, b_send, own = (dict(zip(span, table)) for table in
                                                 (f_input, b_input, f_send, b_send, own))
    starts: list[list[Number]] = [[] for _ in rows]
    free_at: list[Number] = [0] * len(rows)
    waiting: dict[int, list[int]] = {}  # index of an unfinished action -> ranks blocked on it
    runnable = deque(range(len(rows)))
    split_i, split_b = size, 3 * size
    while runnable:
        rank = runnable.popleft()
        row, started = rows[rank], starts[rank]
        index, count, t_free = len(started), len(row), free_at[rank]
        while index < count:
            s, o, k = row[index]
            start = t_free
            if o == F:
                dep = f_input[s]
                if dep >= 0:  # not the first stage of its route
                    dep += k
                    t = finish[dep]
                    if t is None:
                        break
                    if f_send[s]:
                        t += send
                    if t > start:
                        start = t
            elif o == W:
                dep = size + own[s] + k
                t = finish[dep]
                if t is None:
                    break
                if t > start:
                    start = t
            elif o > B:  # S: the last stage's output; T: every shard's S
                dep = last_f + k if o == S else barrier + k
                t = finish[dep]
                if t is None:
                    break
                if many if o == T else (crosses and placement[num_stages - 1] != rank):
                    t += send
                if t > start:
                    start = t
            else:
                dep = own[s] + k
                t = finish[dep]
                if t is None:
                    break
                if t > start:
                    start = t
                dep = b_input[s]
                if dep >= 0:  # not the last stage of its route
                    dep += k
                    dep += split_i if split[dep] else split_b
                    t = finish[dep]
                    if t is None:
                        break
                    if b_send[s]:
                        t += send
                    if t > start:
                        start = t
                elif dep == -2:  # the last stage: every shard's part of its output gradient
                    dep = barrier + mbs + k
                    t = finish[dep]
                    if t is None:
                        break
                    if many:
                        t += send
                    if t > start:
                        start = t
            t_free = start + duration[s][o]
            started.append(start)
            index += 1
            key = o * size + own[s] + k
            if finish[key] is None:
                finish[key] = t_free
                if key in waiting:
                    runnable.extend(waiting.pop(key))
                if o > B:  # the barrier of this pass and microbatch: done by its last shard
                    n = (o - S) * mbs + k
                    passes_done[n] += 1
                    if t_free > passes_end[n]:
                        passes_end[n] = t_free
                    if passes_done[n] == shards:
                        finish[barrier + n] = passes_end[n]
                        if barrier + n in waiting:
                            runnable.extend(waiting.pop(barrier + n))
        else:
            free_at[rank] = t_free
            continue
        waiting.setdefault(dep, []).append(rank)  # blocked on ``dep``: resumed when it finishes
        free_at[rank] = t_free
    return Replayed(rows, costs, starts, free_at)


def _index_space(rows: Sequence[Row], num_stages: int, microbatches: int
                 ) -> tuple[int, int, int, set[int]]:
    """``(stages, microbatches, base, op codes used)`` of an index ``(op * stages + stage) *
    microbatches + microbatch + base`` for every action of ``rows`` and its dependencies: the
    schedule's shape, widened for actions outside it (a broken schedule, whose grid the
    validator shows)."""
    inside, ops = True, set()
    for row in rows:  # by C-level passes over each row's columns
        if row:
            stage, op, microbatch = zip(*row)
            ops.update(op)
            if (min(stage) < 0 or max(stage) >= num_stages or min(microbatch) < 0
                    or max(microbatch) >= microbatches):
                inside = False
    if inside:
        return num_stages, microbatches, 0, ops
    out = [(s, k) for row in rows for s, _, k in row if not (0 <= s < num_stages
                                                              and 0 <= k < microbatches)]
    low_s, low_k = min(0, *(s for s, _ in out)) - 1, min(0, *(k for _, k in out))  # F(s-1)
    high_s = max(num_stages - 1, *(s for s, _ in out)) + 1  # and I(s+1) of the outermost
    mbs = max(microbatches, *(k + 1 for _, k in out)) - low_k
    return high_s - low_s + 1, mbs, -low_s * mbs - low_k, ops


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


def score(rows: Sequence[Row], placement: Sequence[int], microbatches: int, costs: Costs
          ) -> Score | None:
    """Makespan and Zero-Bubble idle time of ``rows`` (as ``simulate`` computes them); None on a
    deadlock. The idle time is the longest span's (lowest rank on a tie) minus that rank's work.
    Replays compiled where ``loom.schedule.compiled`` allows: the same figures."""
    compiled = loops_for(costs.duration, costs.send)
    if compiled is not None:
        loops, durations = compiled
        made = loops.replay(rows, placement, microbatches, durations, costs.send)
        if made is None:
            return None
        if made is not False:  # False: outside what the compiled replay covers
            return score_of(rows, made[0], made[1], costs)
    replayed = replay(rows, placement, microbatches, costs)
    if not replayed.completed:
        return None
    return score_of(rows, [starts[0] if starts else 0.0 for starts in replayed.start],
                    replayed.end, costs)


def score_of(rows: Sequence[Row], first: Sequence[float], ends: Sequence[float], costs: Costs
             ) -> Score:
    """``score`` from each rank's first start and last end (``search_loop.Asap`` keeps them)."""
    duration = costs.duration
    best_rank, best_span = -1, -1.0
    for rank, row in enumerate(rows):
        span = ends[rank] - first[rank] if row else 0.0
        if span > best_span + EPS:
            best_rank, best_span = rank, span
    busy = sum(duration[s][o] for s, o, _ in rows[best_rank])
    makespan = max((end for end, row in zip(ends, rows) if row), default=0.0)
    return Score(makespan, max(best_span - busy, 0.0))


def live_levels(row: Row, weight: Sequence[int]) -> list[int]:
    """Live activation memory on one rank while each action of ``row`` runs, in the integer units
    of ``weight[stage]`` (what one microbatch of that stage holds)."""
    last = {(s, k): n for n, (s, o, k) in enumerate(row) if o == W or o == B}
    live, levels = 0, []
    for n, (s, o, k) in enumerate(row):
        if o == F:
            live += weight[s]
        levels.append(live)
        if last.get((s, k)) == n:
            live -= weight[s]
    return levels


def peak_units(rows: Sequence[Row], placement: Sequence[int]) -> list[float]:
    """Peak live activation units per rank of a one-route placement: a stage on a rank with v
    stages weighs 1/v (``loom.schedule.validate.memory_profile``'s units)."""
    ones = [1] * len(placement)
    return [max(live_levels(row, ones), default=0) / max(placement.count(rank), 1)
            for rank, row in enumerate(rows)]
