"""Replay a pipeline schedule with real costs: timeline, makespan, bubbles and memory over time.

``simulate(schedule, costs)`` runs every rank's list in order, as the runtime does, through the
one replay engine (``loom.schedule.replay``, whose docstring gives the rules), exactly: ints and
Fractions are replayed as ints scaled by their common denominator, floats as they are. A stall (a
deadlock, or a dependency that is never scheduled) raises the validator's ``ScheduleError`` with
its rank-by-step grid.

Two bubble figures, both fractions of time:

* ``bubble_zb`` (Qi et al. 2024 §5.3): take the rank whose first-op-to-last-op span is longest;
  its idle time inside that span over the span. Iterations of a training loop overlap at the
  edges, so this is what an iteration costs in steady state.
* ``bubble_makespan``: makespan minus the busiest rank's work, over the makespan (one isolated
  iteration; for GPipe / 1F1B it is Megatron's (p-1)/(m+p-1) of the whole time).

``bubble_time_zb`` and ``bubble_time_makespan`` are the same idle times, not divided.

``headline(schedule, costs)`` gives only those figures (``Figures``: makespan, each rank's busy
time, span and peak memory, and the bubbles), exactly the numbers ``simulate`` gives, without the
timeline of one slot per action: the schedule search reports its winner with it (at p=32, m=256
and four chunks per rank the timeline and curves cost as much again as the replay).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from numbers import Rational
from operator import itemgetter
from typing import Any, NamedTuple

from loom.schedule.ir import Action, Schedule
from loom.schedule.validate import deadlock_error, dependencies
from loom.schedule.cost import Number, StageCosts
from loom.schedule.replay import B, F, Costs, Row, encode, from_ints, replay, to_ints


class Slot(NamedTuple):
    """One action on one rank's timeline (a named tuple: a simulation makes 50,000 of them)."""

    action: Action
    start: Number
    finish: Number

    @property
    def duration(self) -> Number:
        return self.finish - self.start


class _Bubbles:
    """The bubble figures, from ``makespan``, ``busy`` and ``span`` (see the module docstring);
    shared by ``Figures`` and ``SimResult``, which hold or derive those three."""

    makespan: Number
    busy: tuple[Number, ...]
    span: tuple[Number, ...]

    @property
    def bubble_time_zb(self) -> Number:
        """Idle time inside the longest rank span (the lowest such rank on a tie)."""
        if not self.span:
            return 0
        rank = max(range(len(self.span)), key=lambda r: (self.span[r], -r))
        return self.span[rank] - self.busy[rank]

    @property
    def bubble_zb(self) -> Number:
        longest = max(self.span, default=0)
        return self.bubble_time_zb / longest if longest else 0

    @property
    def bubble_time_makespan(self) -> Number:
        return self.makespan - max(self.busy, default=0)

    @property
    def bubble_makespan(self) -> Number:
        return self.bubble_time_makespan / self.makespan if self.makespan else 0


@dataclass(frozen=True)
class Figures(_Bubbles):
    """A simulation's headline numbers, of the types ``simulate`` gives them (ints, Fractions or
    floats, as the costs are): the makespan and, per rank, the time spent computing, the span
    from the first action's start to the last one's finish, and the peak of live memory."""

    makespan: Number
    busy: tuple[Number, ...]
    span: tuple[Number, ...]
    peak_memory: tuple[Number, ...]

    def summary(self) -> dict[str, Any]:
        """The figures as JSON-ready floats."""
        return {
            "makespan": float(self.makespan),
            "bubble_zb": float(self.bubble_zb),
            "bubble_makespan": float(self.bubble_makespan),
            "bubble_time_zb": float(self.bubble_time_zb),
            "bubble_time_makespan": float(self.bubble_time_makespan),
            "busy": [float(b) for b in self.busy],
            "peak_memory": [float(m) for m in self.peak_memory],
        }

    def report(self, of: Any, costs: str) -> dict[str, Any]:
        """``summary()`` under the name and shape of ``of`` (a ``Schedule`` or a ``SimResult``)
        and the ``costs`` description: what ``loom schedule simulate --json`` prints."""
        return {"name": of.name, "pp_size": of.pp_size, "num_stages": of.num_stages,
                "num_microbatches": of.num_microbatches, "costs": costs, **self.summary()}


@dataclass(frozen=True)
class SimResult(_Bubbles):
    """What ``simulate`` measured. Everything else is derived from ``timeline`` and ``memory``.

    ``timeline[rank]`` lists the rank's slots in run order. ``memory[rank]`` is a step function:
    ``(time, level)`` points, the level holding from that time until the next point. The first
    point is at time 0; one point per instant, after all of that instant's changes (frees at an
    instant apply before allocations, so a peak is never overstated).
    """

    name: str
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    timeline: tuple[tuple[Slot, ...], ...]
    memory: tuple[tuple[tuple[Number, Number], ...], ...]
    costs: str = ""  # ``StageCosts.describe()`` of the costs used

    @property
    def pp_size(self) -> int:
        return len(self.timeline)

    @cached_property
    def makespan(self) -> Number:
        return max((row[-1].finish for row in self.timeline if row), default=0)

    @cached_property
    def busy(self) -> tuple[Number, ...]:
        """Time each rank spends computing."""
        return tuple(_busy(row) for row in self.timeline)

    @cached_property
    def span(self) -> tuple[Number, ...]:
        """Per rank: from its first action's start to its last action's finish."""
        return tuple(row[-1].finish - row[0].start if row else 0 for row in self.timeline)

    @cached_property
    def peak_memory(self) -> tuple[Number, ...]:
        return tuple(max(level for _, level in points) for points in self.memory)

    @cached_property
    def figures(self) -> Figures:
        """The headline numbers (``memory=False``: none, there are no memory curves)."""
        return Figures(self.makespan, self.busy, self.span, self.peak_memory)

    @cached_property
    def _slots(self) -> dict[Action, Slot]:
        return {slot.action: slot for row in self.timeline for slot in row}

    def slot(self, action: Action) -> Slot:
        """Start and finish of ``action`` (KeyError if it was not scheduled)."""
        return self._slots[action]

    def memory_at(self, rank: int, time: Number) -> Number:
        """Live activation units on ``rank`` at ``time`` (the step function's value)."""
        level = 0
        for when, value in self.memory[rank]:
            if when > time:
                break
            level = value
        return level

    # -- plain data -----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The headline figures as JSON-ready floats (what ``loom schedule simulate`` prints)."""
        return self.figures.report(self, self.costs)

    def to_dict(self) -> dict[str, Any]:
        """``summary()`` plus the placement, the timeline and the memory curves."""
        return {
            **self.summary(),
            "placement": list(self.placement),
            "timeline": [
                [[str(s.action), float(s.start), float(s.finish)] for s in row]
                for row in self.timeline
            ],
            "memory": [[[float(t), float(level)] for t, level in points] for points in self.memory],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SimResult:
        """Rebuild from ``to_dict()`` output; derived figures are recomputed, not read."""
        return cls(
            name=str(data["name"]),
            num_stages=int(data["num_stages"]),
            num_microbatches=int(data["num_microbatches"]),
            placement=tuple(data["placement"]),
            timeline=tuple(
                tuple(Slot(Action.parse(token), start, finish) for token, start, finish in row)
                for row in data["timeline"]
            ),
            memory=tuple(tuple((t, level) for t, level in points) for points in data["memory"]),
            costs=str(data.get("costs", "")),
        )

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> SimResult:
        return cls.from_dict(json.loads(text))


def simulate(schedule: Schedule, costs: StageCosts | None = None, *,
             memory: bool = True, vocab_costs: tuple[Number, Number] = (1, 1)) -> SimResult:
    """Replay ``schedule`` in order on every rank with ``costs`` (default F = I = W = 1).

    Assumes a schedule that ``validate`` accepts (complete, well placed); a stall raises
    ``ScheduleError`` (rule ``deadlock``). ``vocab_costs``: the durations of one shard's S and
    T passes (vocabulary parallelism, ``loom.schedule.vocab_passes``), when the schedule has
    them; their barriers wait for the slowest shard plus the message time. They hold no
    activation units in the memory curve (each keeps its shard's logits, ``[tokens, V/p]``,
    from S to T: a cost of its own, which the units of a stage's activations do not measure).
    """
    costs = costs or StageCosts.uniform(1, 1, 1)
    rows, starts, finishes, scale = _replayed(schedule, costs, vocab_costs)
    exact_times: dict = {}  # each time's Fraction, for the timeline and the memory curve
    time = from_ints(starts + finishes, scale, exact_times)
    timeline = tuple(tuple(map(Slot._make, zip(row, time[rank], time[len(rows) + rank])))
                     for rank, row in enumerate(schedule.actions))
    curves: tuple[tuple[tuple[Number, Number], ...], ...] = ((),) * schedule.pp_size
    peaks = None
    if memory:
        deltas, unit = _memory_deltas(schedule, costs)
        points = [_memory_curve(*args, deltas) for args in zip(rows, starts, finishes)]
        times = from_ints([[t for t, _ in curve] for curve in points], scale, exact_times)
        raw = [[level for _, level in curve] for curve in points]
        levels = from_ints(raw, unit)
        curves = tuple(tuple(zip(*pair)) for pair in zip(times, levels))
        if unit is not None and unit > 1:  # the peaks from the scaled ints: one Fraction a rank
            peaks = tuple(Fraction(max(row), unit) for row in raw)
    result = SimResult(
        name=schedule.name,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        placement=schedule.placement,
        timeline=timeline,
        memory=curves,
        costs=costs.describe(),
    )
    # Figures the summary asks for at once, from the ints while they are at hand (the same
    # numbers, of the same types, that ``busy`` and ``peak_memory`` compute from the Fractions,
    # without adding up one Fraction per action): stored where their cached properties keep
    # them.
    if scale is not None and scale > 1:
        result.__dict__["busy"] = _exact_busy(starts, finishes, scale)
    if peaks is not None:
        result.__dict__["peak_memory"] = peaks
    return result


def headline(schedule: Schedule, costs: StageCosts | None = None, *,
             vocab_costs: tuple[Number, Number] = (1, 1), rows: list[Row] | None = None
             ) -> Figures:
    """``simulate(schedule, costs, vocab_costs=...).figures``, the same numbers of the same
    types, from the replay's times without the timeline and the memory curves' points.
    ``rows``: ``encode(schedule)`` when the caller holds it."""
    costs = costs or StageCosts.uniform(1, 1, 1)
    rows, starts, finishes, scale = _replayed(schedule, costs, vocab_costs, rows)
    exact = scale is not None and scale > 1

    def value(number: Number) -> Number:  # an int time or level of the replay, as simulate's
        return Fraction(number, scale) if exact else number

    busy = _exact_busy(starts, finishes, scale) if exact else tuple(
        sum((end - begin for begin, end in zip(start, finish)), 0)
        for start, finish in zip(starts, finishes))
    span = tuple(value(finish[-1] - start[0]) if start else 0
                 for start, finish in zip(starts, finishes))
    deltas, unit = _memory_deltas(schedule, costs)
    peaks = []
    for args in zip(rows, starts, finishes):
        top = max(level for _, level in _memory_curve(*args, deltas))
        peaks.append(Fraction(top, unit) if unit is not None and unit > 1 else top)
    last = max((finish[-1] for finish in finishes if finish), default=None)
    return Figures(0 if last is None else value(last), busy, span, tuple(peaks))


def _exact_busy(starts: list[list[int]], finishes: list[list[int]], scale: int
                ) -> tuple[Number, ...]:
    """Each rank's busy time from the scaled ints, one Fraction a rank (0 for an idle rank):
    ``SimResult.busy`` of the Fractions, without adding up one Fraction per action."""
    return tuple(Fraction(sum(finish) - sum(start), scale) if start else 0
                 for start, finish in zip(starts, finishes))


def _replayed(schedule: Schedule, costs: StageCosts, vocab_costs: tuple[Number, Number],
              rows: list[Row] | None = None
              ) -> tuple[list[Row], list[list[Number]], list[list[Number]], int | None]:
    """``simulate``'s replay: the integer rows, each action's start and finish, and the scale
    of those times (``Costs.exact``); raises on offloads, costs that do not fit, a stall."""
    if schedule.has_transfers:  # PipeOffload's O/R need copy streams and a host link
        raise ValueError(f"{schedule.name}: holds offload/reload actions; simulate it with "
                         "loom.schedule.offload.simulate_offload")
    costs.check(schedule)
    rows = encode(schedule) if rows is None else rows
    timing, scale = Costs.exact(costs, schedule.num_stages,
                                vocab_costs if schedule.has_vocab_passes else None)
    replayed = replay(rows, schedule.placement, schedule.num_microbatches, timing,
                      schedule.stages_per_route)
    if not replayed.completed:
        raise deadlock_error(schedule)
    return rows, replayed.start, [replayed.finish(rank) for rank in range(len(rows))], scale


def makespan(schedule: Schedule, costs: StageCosts, rows: list[Row] | None = None) -> float:
    """``simulate(schedule, costs, memory=False).makespan`` as a float, from the replay alone:
    the timeline (a ``Slot`` per action, ~10^5 on a deep pipeline) is not built, and the same
    time comes out (the ranks' last finish). ``rows``: ``encode(schedule)`` when the caller
    holds it. For schedules without host transfers or vocabulary passes (``ValueError``)."""
    if schedule.has_transfers or schedule.has_vocab_passes:
        raise ValueError(f"{schedule.name}: makespan() takes compute-only schedules; use simulate")
    costs.check(schedule)
    rows = encode(schedule) if rows is None else rows
    timing, scale = Costs.exact(costs, schedule.num_stages)
    replayed = replay(rows, schedule.placement, schedule.num_microbatches, timing,
                      schedule.stages_per_route)
    if not replayed.completed:
        raise deadlock_error(schedule)
    last = max((end for end, row in zip(replayed.end, rows) if row), default=0)
    return float(Fraction(last, scale) if scale is not None and scale > 1 else last)


def replay_shared(schedule: Schedule, work: dict[Action, float], latency: float,
                  cores: float) -> float:
    """Makespan of ``schedule`` when its ranks share ``cores`` equally (each rank at most one):
    ``simulate``'s rules (in-order ranks, dependencies plus ``latency`` across ranks), with every
    running action progressing at min(1, cores / running) of its ``work``.

    Not ``replay``: an action's speed depends on how many others run at that moment, so this one
    needs a global clock (processor sharing), where ``replay`` derives every time from finish
    times alone. The planner prices a CPU calibration profile's ranks with it, and the pipeline
    benchmark checks it against measured steps."""
    done: dict[Action, float] = {}
    pointer = [0] * schedule.pp_size
    remaining: dict[int, float] = {}  # rank -> work left of its running action
    now = 0.0
    deps = {a: dependencies(schedule, a) for row in schedule.actions for a in row}
    while len(done) < len(work):
        ready_at = {}
        for rank, row in enumerate(schedule.actions):
            if rank in remaining or pointer[rank] >= len(row):
                continue
            action = row[pointer[rank]]
            if all(d in done for d in deps[action]):
                ready_at[rank] = max([now] + [done[d] + (latency if schedule.rank_of(d.stage)
                                                         != rank else 0.0)
                                              for d in deps[action]])
        for rank, when in ready_at.items():
            if when <= now:
                remaining[rank] = work[schedule.actions[rank][pointer[rank]]]
        if not remaining and not ready_at:
            raise RuntimeError(f"{schedule.name}: replay stalled")  # validate() rules this out
        rate = min(1.0, cores / len(remaining)) if remaining else 0.0
        horizon = min([r / rate for r in remaining.values()] if remaining else [float("inf")])
        later = [t for t in ready_at.values() if t > now]
        step = min([horizon, *(t - now for t in later)])
        now += step
        for rank in list(remaining):
            remaining[rank] -= step * rate
            if remaining[rank] <= 1e-12:
                del remaining[rank]
                done[schedule.actions[rank][pointer[rank]]] = now
                pointer[rank] += 1
    return now


def _busy(row: tuple[Slot, ...]) -> Number:
    """The sum of the slots' durations: Fractions added up by denominator (the same number, much
    faster than one by one), ints and floats one by one, in order (floats round as always)."""
    kinds = set(map(type, [x for slot in row for x in (slot.start, slot.finish)]))
    if kinds <= {int} or not all(issubclass(kind, Rational) for kind in kinds):
        return sum((slot.duration for slot in row), 0)
    numerators: dict[int, int] = defaultdict(int)  # denominator -> sum of numerators
    for slot in row:
        numerators[slot.finish.denominator] += slot.finish.numerator
        numerators[slot.start.denominator] -= slot.start.numerator
    return sum((Fraction(n, d) for d, n in numerators.items()), Fraction(0))


def _memory_deltas(schedule: Schedule, costs: StageCosts) -> tuple[list[list], int | None]:
    """Per stage, the change of live memory at the start of F and at the ends of I, W and B
    (None: none), as ``to_ints`` gives them. A (stage, microbatch) is allocated when its F
    starts and freed when its backward ends: all of it at the end of B, or
    ``1 - weight_grad_fraction`` of it at the end of I and the rest at the end of W (Zero Bubble's
    M_B and M_W)."""
    kept = costs.weight_grad_fraction
    flat, unit = to_ints([delta for w in (costs.activation_weight(schedule, stage)
                                          for stage in range(schedule.num_stages))
                          for delta in (w, -w * (1 - kept) if kept != 1 else None,
                                        -w * kept if kept != 0 else None, -w)])
    return [flat[n:n + 4] for n in range(0, len(flat), 4)], unit


def _memory_curve(row: Row, starts: list[Number], ends: list[Number], deltas: list[list]
                  ) -> list[tuple[Number, Number]]:
    """The step function of live activations on one rank (``_memory_deltas``' changes)."""
    events: list[tuple[Number, int, Number]] = []  # (time, 0 = free / 1 = allocate, delta)
    for (stage, op, _), start, end in zip(row, starts, ends):
        if op > B:  # a vocabulary pass: no stage activations
            continue
        if op == F:
            events.append((start, 1, deltas[stage][op]))
        elif deltas[stage][op] is not None:
            events.append((end, 0, deltas[stage][op]))
    return step_function(events)


def step_function(events: list[tuple[Number, int, Number]]) -> list[tuple[Number, Number]]:
    """``(time, level)`` points of a memory curve from ``(time, 0 = free / 1 = allocate, delta)``
    events: one point per instant, after all of its events (frees first, so a peak is never
    overstated)."""
    events.sort(key=itemgetter(0, 1))  # by time, frees first; stable: floats add up as before
    points: list[tuple[Number, Number]] = [(0, 0)]
    level: Number = 0
    for time, _, delta in events:
        level += delta
        if points[-1][0] == time:
            points[-1] = (time, level)  # same instant: keep the level after all its events
        else:
            points.append((time, level))
    return points
