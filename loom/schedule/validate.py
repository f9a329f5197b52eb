"""Rules every schedule must obey, the in-order execution that checks them, and memory accounting.

``validate(schedule)`` raises ``ScheduleError`` with a rank-by-step grid and a one-line reason
naming the broken rule. The pieces are public because the simulator, the search and the runtime
reuse them:

* ``dependencies(schedule, action)``: what must finish before ``action`` may start.
* ``execute(schedule, durations)``: the replay (``loom.schedule.replay``, the one engine, which
  applies the same rules to integer-coded actions) in whole steps, one each by default, as a
  rank-by-step grid.
* ``memory_profile`` / ``peak_memory``: live activations per rank, in units of one full rank's
  activations for one microbatch. A (stage, microbatch) is live from the start of its F to the
  end of its last backward piece (W, or B when not split); a stage on a rank that owns v stages
  (of its route) weighs 1/v.

With routes (``Schedule.num_routes`` > 1) "the next stage" and "the last stage" are those of the
microbatch's route, and a microbatch needs actions only on the stages of its route.

Vocabulary parallelism (``Op.S`` / ``Op.T``, ``loom.schedule.vocab_passes``): rule ``vocab``, one
S and one T of every microbatch on every rank, numbered by that rank (its vocabulary shard), S
before T, one route only; their dependencies join the deadlock check.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.replay import (B, CODE_OP, Costs, Row, encode, encode_row, live_levels,
                                  replay, with_vocab)


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
    first and last stages are those of m's route.) PipeOffload's transfers: O(s,m) needs
    F(s,m), R(s,m) needs O(s,m), and I or B(s,m) also needs R(s,m) when it is scheduled.
    Vocabulary passes: S(r,m) needs the last stage's F(m); T(r,m) needs S(q,m) of every shard
    q; and the last stage's I or B(m) needs T(q,m) of every shard q.
    """
    stage, op, microbatch = action.stage, action.op, action.microbatch
    if op is Op.S:
        return (Action(schedule.num_stages - 1, Op.F, microbatch),)
    if op is Op.T:
        return tuple(Action(shard, Op.S, microbatch) for shard in range(schedule.pp_size))
    if op is Op.O:  # offload: the activations exist once the forward has run
        return (Action(stage, Op.F, microbatch),)
    if op is Op.R:  # reload: what comes back must have gone
        return (Action(stage, Op.O, microbatch),)
    if op is Op.F:
        return () if schedule.is_first(stage) else (Action(stage - 1, Op.F, microbatch),)
    if op is Op.W:
        return (Action(stage, Op.I, microbatch),)
    needed = [Action(stage, Op.F, microbatch)]
    if schedule.has_transfers and op is not Op.W and Action(stage, Op.R, microbatch) in schedule:
        needed.append(Action(stage, Op.R, microbatch))  # offloaded: the backward waits for it
    if not schedule.is_last(stage):
        split = Action(stage + 1, Op.I, microbatch)
        needed.append(split if split in schedule else Action(stage + 1, Op.B, microbatch))
    elif schedule.has_vocab_passes:
        needed.extend(Action(shard, Op.T, microbatch) for shard in range(schedule.pp_size))
    return tuple(needed)


UNIT_DURATIONS: Mapping[Op, int] = {Op.F: 1, Op.I: 1, Op.W: 1, Op.B: 1, Op.S: 1, Op.T: 1}


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


def execute(schedule: Schedule, durations: Mapping[Op, int] = UNIT_DURATIONS) -> Execution:
    """Run every rank's list in order, each action as soon as its dependencies have finished,
    in whole steps (``durations`` >= 1 per op; one step each by default).

    Stops early (``completed`` is False) when no rank can progress: a deadlock, or a dependency
    that is not scheduled at all. The timeline is the step grid: a rank's row runs to the step
    of its last start, or, for a rank left waiting, to the step where everything had stopped.
    """
    if any(type(d) is not int or d < 1 for d in durations.values()):
        raise ValueError(f"execute: durations must be whole steps >= 1, got {dict(durations)}")
    rows = encode(schedule)
    # one row of durations per stage, broken schedules' stages beyond the last one included
    stages = max([schedule.num_stages - 1] + [s for row in rows for s, _, _ in row]) + 1
    step: tuple = tuple(durations.get(op) for op in CODE_OP)
    costs = Costs((step,) * stages, 0)
    if schedule.has_vocab_passes:
        costs = with_vocab(costs, durations.get(Op.S, 1), durations.get(Op.T, 1))
    replayed = replay(rows, schedule.placement, schedule.num_microbatches, costs,
                      schedule.stages_per_route)
    begins = replayed.start
    ends = [replayed.finish(rank) for rank in range(len(rows))]
    pending = tuple(row[len(begins[rank]):] for rank, row in enumerate(schedule.actions))
    stopped = max((end for row in ends for end in row), default=0)
    start: dict[Action, int] = {}
    finish: dict[Action, int] = {}
    timeline = []
    for rank, row in enumerate(schedule.actions):
        steps: list[Action | None] = [None] * (stopped if pending[rank] else
                                               begins[rank][-1] + 1 if begins[rank] else 0)
        for action, begin, end in zip(row, begins[rank], ends[rank]):
            start.setdefault(action, begin)
            finish.setdefault(action, end)
            steps[begin] = action
        timeline.append(tuple(steps))
    return Execution(schedule=schedule, start=start, finish=finish, timeline=tuple(timeline),
                     pending=pending)


def memory_profile(schedule: Schedule, rank: int) -> tuple[Fraction, ...]:
    """Live activation units on ``rank`` while each of its actions runs (exact fractions). With
    PipeOffload's transfers: ``offload_levels`` (offloaded activations off the device), one
    level per action, transfers included."""
    if schedule.has_transfers:
        return offload_levels(schedule, rank)
    weights, unit = _weights(schedule, rank)
    levels = live_levels(encode_row(schedule.actions[rank]), weights)
    return tuple(Fraction(level, unit) for level in levels)


def _weights(schedule: Schedule, rank: int) -> tuple[tuple[int, ...], int]:
    """Every stage's weight in units of 1/unit, unit the common denominator of ``rank``'s."""
    weights = schedule.stage_weights
    unit = math.lcm(*(weights[stage].denominator for stage in schedule.stages_of(rank)))
    return schedule.scaled_stage_weights(unit), unit


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

    A schedule with offload/reload actions (``Op.O`` / ``Op.R``) is checked by
    ``validate_transfers``: its compute actions by these rules, then the
    ``offload`` rule, and memory with offloaded activations off the device.
    """
    if schedule.has_transfers:
        validate_transfers(schedule, memory_limit)
        return
    rows = encode(schedule)
    vocab = schedule.has_vocab_passes
    if vocab:
        _check_vocab(schedule)
    seen = _check_actions(schedule, [[a for a in row if a[1] <= B] for row in rows]
                          if vocab else rows)
    _check_complete(schedule, seen)
    unit = Costs(((1, 1, 1, 1, 1, 1) if vocab else (1, 1, 1, 1),) * schedule.num_stages, 0)
    replayed = replay(rows, schedule.placement, schedule.num_microbatches, unit,
                      schedule.stages_per_route)
    if not replayed.completed:  # a dependency later on its own rank stalls it too: say which
        _check_rank_order(schedule)
        raise deadlock_error(schedule)
    if memory_limit is not None:
        _check_memory(schedule, memory_limit, rows)


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


def _check_actions(schedule: Schedule, rows: list[Row]) -> bytearray:
    """The rules of single actions (range, route, placement, duplicate); returns which actions
    are there, by index ``(op * stages + stage) * microbatches + microbatch``."""
    stages, mbs, placement = schedule.num_stages, schedule.num_microbatches, schedule.placement
    route = [schedule.route_of(k) for k in range(mbs)]
    seen = bytearray(4 * stages * mbs)
    for rank, row in enumerate(rows):
        for s, o, k in row:
            if (0 <= s < stages and 0 <= k < mbs and s // schedule.stages_per_route == route[k]
                    and placement[s] == rank and not seen[(o * stages + s) * mbs + k]):
                seen[(o * stages + s) * mbs + k] = 1
                continue
            action = Action(s, CODE_OP[o], k)
            if not 0 <= s < stages:
                raise _fail(schedule, "range", f"{action}: stage {s} does not exist "
                            f"(num_stages={stages})", action)
            if not 0 <= k < mbs:
                raise _fail(schedule, "range", f"{action}: microbatch {k} does not exist "
                            f"(num_microbatches={mbs})", action)
            if s // schedule.stages_per_route != route[k]:
                raise _fail(schedule, "route", f"{action}: microbatch {k} takes route "
                            f"{route[k]}, stages {_span(schedule.route_stages(k))}", action)
            if placement[s] != rank:
                raise _fail(schedule, "placement", f"{action} is on rank {rank} but stage {s} "
                            f"is placed on rank {placement[s]}", action)
            raise _fail(schedule, "duplicate", f"{action} is scheduled more than once", action)
    return seen


def _check_complete(schedule: Schedule, seen: bytearray) -> None:
    stages, mbs = schedule.num_stages, schedule.num_microbatches
    for stage in range(stages):
        for mb in range(mbs):
            if stage // schedule.stages_per_route != schedule.route_of(mb):
                continue  # another route's copy of the stage
            has = {op: seen[(code * stages + stage) * mbs + mb] == 1
                   for code, op in enumerate(CODE_OP)}
            where = f"stage {stage} microbatch {mb}"
            if not has[Op.F]:
                raise _fail(schedule, "missing", f"{where} has no forward {Action(stage, Op.F, mb)}")
            if has[Op.B] and (has[Op.I] or has[Op.W]):
                raise _fail(schedule, "mixed", f"{where} has both B and I/W",
                            *(Action(stage, op, mb) for op in CODE_OP if has[op] and op is not Op.F))
            if has[Op.I] != has[Op.W]:
                present, absent = (Op.I, Op.W) if has[Op.I] else (Op.W, Op.I)
                raise _fail(schedule, "missing", f"{where} has {present.value} but no "
                            f"{Action(stage, absent, mb)}", Action(stage, present, mb))
            if not (has[Op.B] or has[Op.I]):
                raise _fail(schedule, "missing", f"{where} has no backward (B, or I and W)")


def _check_vocab(schedule: Schedule) -> None:
    """Rule ``vocab``: every rank runs S then T of every microbatch on its own shard (its rank),
    once each; one route (the passes follow the one last stage)."""
    if schedule.num_routes > 1:
        first = next(a for row in schedule.actions for a in row if a.op.is_vocab)
        raise _fail(schedule, "vocab", f"{first}: vocabulary passes need one route (the output"
                    f" layer follows the last stage), the schedule has {schedule.num_routes}",
                    first)
    for rank, row in enumerate(schedule.actions):
        where: dict[tuple[Op, int], int] = {}
        for index, action in enumerate(row):
            if not action.op.is_vocab:
                continue
            if action.stage != rank:
                raise _fail(schedule, "vocab", f"{action} is on rank {rank}: shard"
                            f" {action.stage}'s passes run on rank {action.stage}", action)
            if not 0 <= action.microbatch < schedule.num_microbatches:
                raise _fail(schedule, "range", f"{action}: microbatch {action.microbatch} does not"
                            f" exist (num_microbatches={schedule.num_microbatches})", action)
            if (action.op, action.microbatch) in where:
                raise _fail(schedule, "duplicate", f"{action} is scheduled more than once", action)
            where[action.op, action.microbatch] = index
        for mb in range(schedule.num_microbatches):
            s_pass, t_pass = Action(rank, Op.S, mb), Action(rank, Op.T, mb)
            for op, action in ((Op.S, s_pass), (Op.T, t_pass)):
                if (op, mb) not in where:
                    raise _fail(schedule, "vocab", f"rank {rank} has no {action}: every rank runs"
                                " S and T of every microbatch on its shard")
            if where[Op.T, mb] < where[Op.S, mb]:
                raise _fail(schedule, "order", f"{t_pass} comes before its {s_pass} on rank"
                            f" {rank}", t_pass, s_pass)


def _check_rank_order(schedule: Schedule) -> None:
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            for dep in dependencies(schedule, action):
                where = schedule.position(dep)
                if where is not None and where[0] == rank and where[1] > index:
                    raise _fail(schedule, "order", f"{action} comes before its dependency "
                                f"{dep} on the same rank {rank}", action, dep)


def _check_memory(schedule: Schedule, limit: float, rows: list[Row]) -> None:
    for rank, row in enumerate(rows):
        weights, unit = _weights(schedule, rank)
        # the most a rank may hold, in 1/unit: levels are whole, so compare with the floor
        cap = math.floor(Fraction(limit) * unit) if math.isfinite(limit) else None
        for n, level in enumerate(live_levels(row, weights)):
            if level > cap if cap is not None else Fraction(level, unit) > limit:
                action = schedule.actions[rank][n]
                raise ScheduleError(
                    "memory",
                    f"rank {rank} holds {level / unit:g} activation units at {action}, "
                    f"over the limit of {limit:g}",
                    format_grid(schedule, execute(schedule), mark=[action]),
                    [action],
                )


# ----------------------------------------------------------------------------------------------
# PipeOffload's transfers (``loom.schedule.offload`` places and prices them)


def _transfer_fail(schedule: Schedule, reason: str, *actions: Action, rule: str = "offload"
          ) -> ScheduleError:
    compute = schedule.compute_only()
    marked = [a for a in actions if not a.op.is_transfer]
    return ScheduleError(rule, reason, format_grid(compute, mark=marked), actions)


def offload_levels(schedule: Schedule, rank: int) -> tuple[Fraction, ...]:
    """Live activation units on the device of ``rank`` at each action of its list (transfers
    included), by order: an F or an R adds the (stage, microbatch)'s weight (``stage_weight``)
    while it runs; the last backward piece (W, or B) frees after it; an O frees only after the
    next compute action in the list (its copy overlaps that action, which therefore still sees
    it: ``simulate_offload`` makes the compute action after that one wait for the copy, so the
    device never holds more than these levels). Without transfers this is
    ``validate.memory_profile``."""
    return transfer_levels(schedule.actions[rank], schedule.stage_weights)


def transfer_levels(row: Iterable[Action], weights: Sequence[Fraction]) -> tuple[Fraction, ...]:
    """``offload_levels`` of one rank's list ``row`` with the stages' ``weights``."""
    row = list(row)
    last = {(a.stage, a.microbatch): n for n, a in enumerate(row) if a.op in (Op.W, Op.B)}
    live, levels = Fraction(0), []
    in_flight = Fraction(0)  # offloads issued since the last compute action: still on the device
    for n, action in enumerate(row):
        weight = weights[action.stage]
        if action.op in (Op.F, Op.R):
            live += weight
        levels.append(live)
        if action.op is Op.O:
            in_flight += weight
        elif not action.op.is_transfer:  # the compute action that covers the copies in flight
            live -= in_flight
            in_flight = Fraction(0)
        if last.get((action.stage, action.microbatch)) == n:
            live -= weight
    return tuple(levels)


def validate_transfers(schedule: Schedule, memory_limit: float | None = None) -> None:
    """``validate`` for a schedule with PipeOffload's offload/reload actions
    (``loom.schedule.offload``): the compute actions obey every rule of ``validate``; then the
    ``offload`` rule (each transfer on the rank owning its stage, at most one O and one R per
    (stage, microbatch), both or neither, in the order F < O < R < its first backward piece, I
    or B); then ``memory`` by ``offload_levels``. Raises ``ScheduleError``."""
    validate(schedule.compute_only())
    stages, mbs = schedule.num_stages, schedule.num_microbatches
    for rank, row in enumerate(schedule.actions):
        where: dict[tuple[Op, int, int], int] = {}
        backward: dict[tuple[int, int], int] = {}
        for n, action in enumerate(row):
            key = (action.stage, action.microbatch)
            if action.op in (Op.I, Op.B):
                backward.setdefault(key, n)
            if action.op is Op.F or action.op.is_transfer:
                where.setdefault((action.op, *key), n)
            if not action.op.is_transfer:
                continue
            if not (0 <= action.stage < stages and 0 <= action.microbatch < mbs):
                raise _transfer_fail(schedule, f"{action}: no such stage or microbatch", action,
                            rule="range")
            if action.stage not in schedule.route_stages(action.microbatch):
                raise _transfer_fail(schedule, f"{action}: stage {action.stage} is not on microbatch "
                            f"{action.microbatch}'s route", action, rule="route")
            if schedule.rank_of(action.stage) != rank:
                raise _transfer_fail(schedule, f"{action} is on rank {rank} but stage {action.stage} is "
                            f"placed on rank {schedule.rank_of(action.stage)}", action,
                            rule="placement")
            if where[(action.op, *key)] != n:
                raise _transfer_fail(schedule, f"{action} is scheduled more than once", action,
                            rule="duplicate")
        for (op, stage, mb), n in where.items():
            if op is not Op.O:
                continue
            offload, reload = Action(stage, Op.O, mb), Action(stage, Op.R, mb)
            if (Op.R, stage, mb) not in where:
                raise _transfer_fail(schedule, f"{offload} has no {reload}: the backward would find its "
                            "activations on the host", offload)
            if not where[(Op.F, stage, mb)] < n:
                raise _transfer_fail(schedule, f"{offload} comes before {Action(stage, Op.F, mb)}: "
                            "there is nothing to offload yet", offload)
            if not n < where[(Op.R, stage, mb)]:
                raise _transfer_fail(schedule, f"{reload} comes before {offload}", offload, reload)
            first = backward[(stage, mb)]
            if not where[(Op.R, stage, mb)] < first:
                raise _transfer_fail(schedule, f"{reload} comes after {row[first]}, which needs the "
                            "activations back", reload, row[first])
        for (op, stage, mb) in where:
            if op is Op.R and (Op.O, stage, mb) not in where:
                raise _transfer_fail(schedule, f"{Action(stage, Op.R, mb)} reloads what no "
                            f"{Action(stage, Op.O, mb)} offloaded", Action(stage, Op.R, mb))
    if memory_limit is None:
        return
    limit = Fraction(memory_limit)
    for rank in range(schedule.pp_size):
        for action, level in zip(schedule.actions[rank], offload_levels(schedule, rank)):
            if level > limit:
                raise _transfer_fail(schedule, f"rank {rank} holds {float(level):g} activation units on "
                            f"the device at {action}, over the limit of {memory_limit:g}",
                            action, rule="memory")
