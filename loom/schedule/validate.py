"""Rules every schedule must obey, the in-order execution that checks them, and memory accounting.

``validate(schedule)`` raises ``ScheduleError`` with a rank-by-step grid and a one-line reason
naming the broken rule. The pieces are public because the simulator, the search and the runtime
reuse them:

* ``dependencies(schedule, action)``: what must finish before ``action`` may start.
* ``replay(schedule, duration, send_time)``: the one replay engine (every rank in order, each
  action as soon as its rank is free and its dependencies have finished), used by ``execute``
  and by ``loom.schedule.simulate``;
* ``execute(schedule, durations)``: ``replay`` in whole steps (one each by default), as a
  rank-by-step grid.
* ``memory_profile`` / ``peak_memory``: live activations per rank, in units of one full rank's
  activations for one microbatch. A (stage, microbatch) is live from the start of its F to the
  end of its last backward piece (W, or B when not split); a stage on a rank that owns v stages
  (of its route) weighs 1/v.

With routes (``Schedule.num_routes`` > 1) "the next stage" and "the last stage" are those of the
microbatch's route, and a microbatch needs actions only on the stages of its route.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from loom.schedule.ir import Action, Op, Schedule


class ScheduleError(ValueError):
    """A broken schedule rule. ``rule`` names it; the message holds the reason and the grid."""

    def __init__(self, rule: str, reason: str, grid: str, actions: Collection[Action] = ()):
        super().__init__(f"[{rule}] {reason}\n{grid}")
        self.rule = rule
        self.reason = reason
        self.grid = grid
        self.actions = tuple(actions)


def dependencies(schedule: Schedule, action: Action) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` starts.

    F(s,m) needs F(s-1,m). I or B(s,m) needs F(s,m) and the input gradient of (s+1,m), i.e.
    I(s+1,m) when that stage splits its backward, else B(s+1,m). W(s,m) needs I(s,m). (The
    first and last stages are those of m's route.)
    """
    stage, op, microbatch = action.stage, action.op, action.microbatch
    if op is Op.F:
        return () if schedule.is_first(stage) else (Action(stage - 1, Op.F, microbatch),)
    if op is Op.W:
        return (Action(stage, Op.I, microbatch),)
    needed = [Action(stage, Op.F, microbatch)]
    if not schedule.is_last(stage):
        split = Action(stage + 1, Op.I, microbatch)
        needed.append(split if split in schedule else Action(stage + 1, Op.B, microbatch))
    return tuple(needed)


UNIT_DURATIONS: Mapping[Op, int] = {Op.F: 1, Op.I: 1, Op.W: 1, Op.B: 1}


@dataclass(frozen=True)
class Execution:
    """Result of ``execute``: when each action started/finished, and what never ran."""

    schedule: Schedule
    start: Mapping[Action, int]
    finish: Mapping[Action, int]
    # timeline[rank][t] is the action that started on ``rank`` at step t (None: idle or busy).
    timeline: tuple[tuple[Action | None, ...], ...]
    # pending[rank] is the suffix of the rank's list that could not run (empty when completed).
    pending: tuple[tuple[Action, ...], ...]

    @property
    def completed(self) -> bool:
        return not any(self.pending)

    @property
    def makespan(self) -> int:
        return max(self.finish.values(), default=0)

    def idle_in_window(self, rank: int) -> int:
        """Idle steps between the rank's first start and last finish (its internal bubble)."""
        row = self.schedule.actions[rank]
        if not row:
            return 0
        busy = sum(self.finish[a] - self.start[a] for a in set(row) if a in self.finish)
        return max(self.finish[a] for a in row) - min(self.start[a] for a in row) - busy


Replayed = tuple[list[list[tuple[Action, Any, Any]]], tuple[tuple[Action, ...], ...]]


def replay(schedule: Schedule, duration: Callable[[Action], Any],
           send_time: Callable[[Action, Action], Any] | None = None) -> Replayed:
    """The one replay engine: every rank runs its list in order, each action as soon as its rank
    is free and its dependencies have finished (plus ``send_time(dep, action)``, if given).

    Returns ``(slots, pending)``: per rank the ``(action, start, finish)`` it ran, and the
    suffix of its list that could never start (empty for every rank when the schedule runs to
    the end). Nothing is shared between ranks, so start times follow from the finish times of
    earlier actions alone: actions are processed as their inputs complete (each rank resumed
    when the action it waits for finishes), which gives a global clock's times without one.
    ``execute`` (unit steps) and ``loom.schedule.simulate`` (real costs) both use it.
    """
    rows = schedule.actions
    deps = {action: dependencies(schedule, action) for row in rows for action in row}
    finish: dict[Action, Any] = {}
    slots: list[list[tuple[Action, Any, Any]]] = [[] for _ in rows]
    free_at: list[Any] = [0] * len(rows)
    pointer = [0] * len(rows)
    waiting: dict[Action, list[int]] = {}  # unfinished dependency -> ranks blocked on it
    runnable = deque(range(len(rows)))
    while runnable:
        rank = runnable.popleft()
        row = rows[rank]
        while pointer[rank] < len(row):
            action = row[pointer[rank]]
            blocker = next((dep for dep in deps[action] if dep not in finish), None)
            if blocker is not None:
                waiting.setdefault(blocker, []).append(rank)
                break
            start = max([free_at[rank]] + [
                finish[dep] + (send_time(dep, action) if send_time else 0) for dep in deps[action]])
            end = start + duration(action)
            finish.setdefault(action, end)
            slots[rank].append((action, start, end))
            free_at[rank] = end
            pointer[rank] += 1
            runnable.extend(waiting.pop(action, ()))
    return slots, tuple(tuple(row[pointer[rank]:]) for rank, row in enumerate(rows))


def execute(schedule: Schedule, durations: Mapping[Op, int] = UNIT_DURATIONS) -> Execution:
    """Run every rank's list in order, each action as soon as its dependencies have finished,
    in whole steps (``durations`` >= 1 per op; one step each by default).

    Stops early (``completed`` is False) when no rank can progress: a deadlock, or a dependency
    that is not scheduled at all. The timeline is the step grid: a rank's row runs to the step
    of its last start, or, for a rank left waiting, to the step where everything had stopped.
    """
    if any(type(d) is not int or d < 1 for d in durations.values()):
        raise ValueError(f"execute: durations must be whole steps >= 1, got {dict(durations)}")
    slots, pending = replay(schedule, lambda action: durations[action.op])
    start: dict[Action, int] = {}
    finish: dict[Action, int] = {}
    for row in slots:
        for action, begin, end in row:
            start.setdefault(action, begin)
            finish.setdefault(action, end)
    stopped = max((end for row in slots for _, _, end in row), default=0)
    timeline = []
    for row, waiting in zip(slots, pending):
        length = stopped if waiting else (row[-1][1] + 1 if row else 0)
        steps: list[Action | None] = [None] * length
        for action, begin, _ in row:
            steps[begin] = action
        timeline.append(tuple(steps))
    return Execution(schedule=schedule, start=start, finish=finish, timeline=tuple(timeline),
                     pending=pending)


def memory_profile(schedule: Schedule, rank: int) -> tuple[Fraction, ...]:
    """Live activation units on ``rank`` while each of its actions runs (exact fractions)."""
    row = schedule.actions[rank]
    last_piece = {}  # (stage, microbatch) -> index of its last backward piece on this rank
    for index, action in enumerate(row):
        if action.op in (Op.W, Op.B):
            last_piece[(action.stage, action.microbatch)] = index
    live = Fraction(0)
    levels = []
    for index, action in enumerate(row):
        weight = schedule.stage_weight(action.stage)
        if action.op is Op.F:
            live += weight
        levels.append(live)
        if last_piece.get((action.stage, action.microbatch)) == index:
            live -= weight
    return tuple(levels)


def peak_memory(schedule: Schedule) -> tuple[float, ...]:
    """Peak live activation units per rank (1F1B: p on rank 0; GPipe: m everywhere)."""
    return tuple(
        float(max(memory_profile(schedule, rank), default=0)) for rank in range(schedule.pp_size)
    )


# ----------------------------------------------------------------------------------------------


def format_grid(
    schedule: Schedule,
    execution: Execution | None = None,
    mark: Collection[Action] = (),
    max_steps: int = 48,
) -> str:
    """Rank-by-step grid of the in-order execution; actions in ``mark`` print as ``[1F3]``.

    Actions that never ran are listed after ``|``. Long schedules show a window of
    ``max_steps`` steps around the first marked action.
    """
    execution = execution or execute(schedule)
    marked = set(mark)

    def cell(action: Action | None) -> str:
        if action is None:
            return "."
        return f"[{action}]" if action in marked else str(action)

    steps = max((len(t) for t in execution.timeline), default=0)
    focus = min(
        (execution.start[a] for a in marked if a in execution.start),
        default=steps if any(execution.pending) else 0,
    )
    first = max(0, min(focus - max_steps // 2, steps - max_steps))
    last = min(steps, first + max_steps)
    cells = [
        [cell(t[i]) if i < len(t) else "" for i in range(first, last)]
        for t in execution.timeline
    ]
    width = max([len(c) for row in cells for c in row] + [len(str(last - 1)), 1])
    lines = [
        f"{schedule.name}: steps {first}..{last - 1} of {steps}"
        if (first, last) != (0, steps)
        else f"{schedule.name}: {steps} steps"
    ]
    lines.append("step    " + " ".join(f"{i:<{width}}" for i in range(first, last)))
    for rank, row in enumerate(cells):
        line = f"rank {rank:<2} " + " ".join(f"{c:<{width}}" for c in row)
        if execution.pending[rank]:
            line += " | " + " ".join(cell(a) for a in execution.pending[rank])
        lines.append(line.rstrip())
    return "\n".join(lines)


def _fail(schedule: Schedule, rule: str, reason: str, *actions: Action) -> ScheduleError:
    return ScheduleError(rule, reason, format_grid(schedule, mark=actions), actions)


def validate(schedule: Schedule, memory_limit: float | None = None) -> None:
    """Raise ``ScheduleError`` unless ``schedule`` is complete, well placed and runnable.

    Rules, checked in this order: ``range`` (stage and microbatch exist), ``route`` (the stage
    is on the microbatch's route, when the schedule has routes), ``placement`` (each
    action on the rank owning its stage), ``duplicate``, ``missing`` (each (stage, microbatch)
    has F and either B or I and W), ``mixed`` (not both), ``order`` (a dependency on the same
    rank comes earlier in its list), ``deadlock`` (in-order execution finishes), ``memory``
    (peak live activations per rank <= ``memory_limit`` units).
    """
    seen: Counter[Action] = Counter()
    for rank, row in enumerate(schedule.actions):
        for action in row:
            if not (0 <= action.stage < schedule.num_stages):
                raise _fail(schedule, "range", f"{action}: stage {action.stage} does not exist "
                            f"(num_stages={schedule.num_stages})", action)
            if not (0 <= action.microbatch < schedule.num_microbatches):
                raise _fail(schedule, "range", f"{action}: microbatch {action.microbatch} does "
                            f"not exist (num_microbatches={schedule.num_microbatches})", action)
            if action.stage not in schedule.route_stages(action.microbatch):
                raise _fail(schedule, "route", f"{action}: microbatch {action.microbatch} takes "
                            f"route {schedule.route_of(action.microbatch)}, stages "
                            f"{_span(schedule.route_stages(action.microbatch))}", action)
            owner = schedule.rank_of(action.stage)
            if owner != rank:
                raise _fail(schedule, "placement", f"{action} is on rank {rank} but stage "
                            f"{action.stage} is placed on rank {owner}", action)
            seen[action] += 1
            if seen[action] > 1:
                raise _fail(schedule, "duplicate", f"{action} is scheduled more than once", action)
    _check_complete(schedule, seen)
    _check_rank_order(schedule)
    execution = execute(schedule)
    if not execution.completed:
        raise deadlock_error(schedule, execution)
    if memory_limit is not None:
        _check_memory(schedule, memory_limit, execution)


def deadlock_error(schedule: Schedule, execution: Execution | None = None) -> ScheduleError:
    """The ``deadlock`` error for a schedule whose in-order execution stops early.

    Shared with ``loom.schedule.simulate``: whether in-order execution finishes does not depend on the
    durations, so the unit-step grid explains a stall the simulator meets with any costs.
    """
    execution = execution or execute(schedule)
    blocked = [row[0] for row in execution.pending if row]
    waits = "; ".join(
        f"{a} waits for {', '.join(str(d) for d in dependencies(schedule, a) if d not in execution.finish)}"
        for a in blocked
    )
    return ScheduleError(
        "deadlock",
        f"no rank can progress under in-order execution: {waits}",
        format_grid(schedule, execution, mark=blocked),
        blocked,
    )


def _span(stages: range) -> str:
    return f"{stages.start}..{stages.stop - 1}"


def _check_complete(schedule: Schedule, seen: Counter[Action]) -> None:
    for stage in range(schedule.num_stages):
        for mb in range(schedule.num_microbatches):
            if stage not in schedule.route_stages(mb):
                continue  # another route's copy of the stage
            has = {op: Action(stage, op, mb) in seen for op in Op}
            where = f"stage {stage} microbatch {mb}"
            if not has[Op.F]:
                raise _fail(schedule, "missing", f"{where} has no forward {Action(stage, Op.F, mb)}")
            if has[Op.B] and (has[Op.I] or has[Op.W]):
                raise _fail(schedule, "mixed", f"{where} has both B and I/W",
                            *(Action(stage, op, mb) for op in Op if has[op] and op is not Op.F))
            if has[Op.I] != has[Op.W]:
                present, absent = (Op.I, Op.W) if has[Op.I] else (Op.W, Op.I)
                raise _fail(schedule, "missing", f"{where} has {present.value} but no "
                            f"{Action(stage, absent, mb)}", Action(stage, present, mb))
            if not (has[Op.B] or has[Op.I]):
                raise _fail(schedule, "missing", f"{where} has no backward (B, or I and W)")


def _check_rank_order(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            for dep in dependencies(schedule, action):
                where = schedule.position(dep)
                if where is not None and where[0] == rank and where[1] > index:
                    raise _fail(schedule, "order", f"{action} comes before its dependency "
                                f"{dep} on the same rank {rank}", action, dep)


def _check_memory(schedule: Schedule, limit: float, execution: Execution) -> None:
    for rank in range(schedule.pp_size):
        for action, level in zip(schedule.actions[rank], memory_profile(schedule, rank)):
            if level > limit:
                raise ScheduleError(
                    "memory",
                    f"rank {rank} holds {float(level):g} activation units at {action}, "
                    f"over the limit of {limit:g}",
                    format_grid(schedule, execution, mark=[action]),
                    [action],
                )
