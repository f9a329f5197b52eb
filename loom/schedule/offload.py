"""PipeOffload in the schedule IR: offload and reload actions, where they go, what they cost.

Deep pipelines hold many microbatches' activations at once: 1F1B keeps p of them on rank 0, and
a schedule that fills the pipeline with m > p in flight keeps more. PipeOffload (Wan et al. 2025,
"PipeOffload: Improving Scalability of Pipeline Parallelism with Memory Optimization") moves a
microbatch's saved activations to host memory after its forward and brings them back before its
backward; the copies run on the device's copy engines beside the compute, so where the link is
fast enough they cost nothing but host memory. When only some activations can go (the link is
slow, or only part of the peak has to go), the paper offloads selectively: those that would
otherwise sit longest on the device.

In Loom the transfers are actions of the one IR (``Op.O`` offload, ``Op.R`` reload, tokens
``2O3`` / ``2R3``), in the rank's list where they are issued, so the validator, the simulator and
the runtime all read them from the same data:

* ``loom.schedule.validate.validate_transfers`` (``validate`` calls it for any schedule holding
  them): the compute actions obey every rule of ``validate``; then the ``offload`` rule: each
  transfer on the rank that owns its stage, at most one O and one R per (stage, microbatch), both
  or neither, in the order F < O < R < the first backward piece (I or B) in the rank's list; then
  ``memory`` with ``offload_levels``' accounting: an offloaded (stage, microbatch) does not
  count on the device from the end of the compute action after its O (the one its copy
  overlaps) to its R.
* ``insert_offload`` (the policy): given a schedule and a per-rank device limit in activation
  units, walks each rank's list in order and, whenever an F (or a reload) would go over the limit,
  offloads first the microbatches whose backward is furthest away (the paper's selective offload;
  Belady's rule for a cache), and reloads each just in time: ``prefetch`` compute actions before
  its backward when the limit leaves room, else right before it. A pure function of the IR.
* ``simulate_offload`` (``loom.schedule.simulate.simulate`` refuses schedules with transfers and
  names this one, which builds on it): the compute replay of ``simulate`` plus two copy streams per rank (device-to-host for O, host-to-device for R, each
  one transfer at a time, the two directions concurrent as on GPUs with separate copy engines).
  A transfer is issued when the compute stream reaches it in the list (after the compute action
  before it finishes), starts when its stream is free and its dependency has finished, and takes
  ``StageCosts.transfer_time`` (activation bytes over ``host_bandwidth``). A backward waits for
  its reload; the second compute action after an O (and a reload after that first one) waits
  for the O to finish (its buffers are free only then), so a slow link costs time, never memory
  beyond ``offload_levels``. Memory
  over time: an offload frees at its end, a reload allocates at its start.

Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from fractions import Fraction

from loom.schedule import families
from loom.schedule.cost import Number, OpCosts, StageCosts
from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.simulate import SimResult, Slot, step_function
from loom.schedule.validate import deadlock_error, dependencies, offload_levels, transfer_levels

_BACKWARD_FIRST = (Op.I, Op.B)  # the piece that reads the saved activations


def offload_peak(schedule: Schedule) -> tuple[Fraction, ...]:
    """Peak of ``offload_levels`` per rank (exact)."""
    return tuple(max(offload_levels(schedule, rank), default=Fraction(0))
                 for rank in range(schedule.pp_size))


# ----------------------------------------------------------------------------------------------
# The policy


def insert_offload(schedule: Schedule, limit: float, *, prefetch: int = 2) -> Schedule:
    """``schedule`` with offloads and reloads that keep every rank's device activations (by
    ``offload_levels``) within ``limit`` units; ``schedule`` itself when it already fits.

    Per rank, in list order: when an F (or a reload) would go over the limit, offload the
    microbatches on the device whose first backward piece is furthest away (ties: the higher
    stage, then microbatch) among those whose F is at least two compute actions back, each with
    an O right after its own F (as early as it can go: its copy overlaps the compute action after
    it, and is off the device after that, ``offload_levels``); an offloaded microbatch is
    reloaded before its first backward piece (I or B), ``prefetch`` compute actions earlier when
    the limit allows (so the copy overlaps them), else as late as it fits. The compute order is
    not changed, so the makespan changes only by the waits for reloads (``simulate_offload``).
    Raises ValueError when the limit is below what one action needs with everything else
    offloaded, or when ``schedule`` already holds transfers.
    """
    if schedule.has_transfers:
        raise ValueError(f"{schedule.name}: already holds offload/reload actions")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    cap = Fraction(limit)
    rows = [_offload_row(schedule, rank, cap, prefetch) for rank in range(schedule.pp_size)]
    if all(len(row) == len(schedule.actions[rank]) for rank, row in enumerate(rows)):
        return schedule
    return Schedule(schedule.num_stages, schedule.num_microbatches, schedule.placement,
                    tuple(rows), name=f"{schedule.name}+offload{limit:g}",
                    num_routes=schedule.num_routes, routes=schedule.routes)


def _offload_row(schedule: Schedule, rank: int, cap: Fraction, prefetch: int) -> list[Action]:
    row = schedule.actions[rank]
    # whole numbers of 1/scale units: exact as the fractions, a tenth of their cost
    scale = math.lcm(*(w.denominator for w in schedule.stage_weights))
    weights = [int(w * scale) for w in schedule.stage_weights]
    most = math.floor(cap * scale)  # the cap in those units: levels are whole, the floor is exact
    first_back: dict[tuple[int, int], int] = {}
    last: dict[tuple[int, int], int] = {}
    for n, action in enumerate(row):
        key = (action.stage, action.microbatch)
        if action.op in _BACKWARD_FIRST:
            first_back.setdefault(key, n)
        if action.op in (Op.W, Op.B):
            last[key] = n
    before: list[list[Action]] = [[] for _ in row]
    after: list[Action | None] = [None] * len(row)  # the O right after a victim's F
    forward: dict[tuple[int, int], int] = {}
    on_device: set[tuple[int, int]] = set()  # forwarded, backward not started: offloadable
    offloaded: set[tuple[int, int]] = set()
    live = 0
    for n, action in enumerate(row):
        key = (action.stage, action.microbatch)
        weight = weights[action.stage]
        reload = action.op in _BACKWARD_FIRST and key in offloaded
        need = weight if action.op is Op.F or reload else 0
        while live + need > most:
            # an O right after a victim's F frees after the next compute action: in time for
            # this one only when that F is at least two actions back
            victims = [k for k in on_device if first_back.get(k, -1) > n and forward[k] < n - 1]
            if not victims:
                raise ValueError(
                    f"{schedule.name}: rank {rank} needs {(live + need) / scale:g} activation "
                    f"units at {action} with every offloadable microbatch (forwarded, backward "
                    f"not begun) offloaded, over the limit of "
                    f"{float(cap):g}")
            victim = max(victims, key=lambda k: (first_back[k], k))
            after[forward[victim]] = Action(victim[0], Op.O, victim[1])
            on_device.discard(victim)
            offloaded.add(victim)
            live -= weights[victim[0]]
        if action.op is Op.F:
            forward[key] = n
            on_device.add(key)
            live += weight
        if reload:
            before[n].append(Action(action.stage, Op.R, action.microbatch))
            offloaded.discard(key)
            live += weight
        if action.op in _BACKWARD_FIRST:
            on_device.discard(key)
        if last.get(key) == n:
            live -= weight
    out = [a for n, action in enumerate(row)
           for a in (*before[n], action, *([after[n]] if after[n] else []))]
    return _hoist_reloads(schedule, rank, out, cap, prefetch) if prefetch else out


def _hoist_reloads(schedule: Schedule, rank: int, row: list[Action], cap: Fraction,
                   prefetch: int) -> list[Action]:
    """Move each reload up to ``prefetch`` compute actions earlier, one at a time, while it stays
    after its offload and the rank's device level (``transfer_levels``) stays within ``cap``.

    A move swaps the reload with the action before it, which changes the levels at those two
    places only (both add and free the same in either order), so each try costs O(1), not a
    pass over the row (that pass made the policy quadratic: seconds per schedule at p = 4 with
    eight chunks, what the search's offload step prices)."""
    weights = schedule.stage_weights
    levels = list(transfer_levels(row, weights))
    over = sum(level > cap for level in levels)  # places over the cap
    position = {action: n for n, action in enumerate(row)}
    for reload in [a for a in row if a.op is Op.R]:
        weight = weights[reload.stage]
        for _ in range(prefetch):
            at = position[reload]
            if at == 0 or row[at - 1] == Action(reload.stage, Op.O, reload.microbatch):
                break  # never past its own offload
            before = row[at - 1]
            added = weights[before.stage] if before.op in (Op.F, Op.R) else 0
            moved = (levels[at - 1] - added + weight, levels[at - 1] + weight)
            if over - (levels[at - 1] > cap) - (levels[at] > cap) or max(moved) > cap:
                break
            row[at - 1], row[at] = reload, before
            levels[at - 1], levels[at] = moved
            position[reload], position[before] = at - 1, at
            over = 0  # the two moved levels are within the cap, and were the only ones over
    return row


# ----------------------------------------------------------------------------------------------
# The simulator


@dataclass(frozen=True)
class OffloadSim:
    """What ``simulate_offload`` measured: ``result`` (compute timeline and device memory over
    time, as ``simulate`` gives them), ``transfers[rank]`` (the O and R slots, in list order), and
    ``copy_wait[rank]``: the time that rank's compute actions waited for copies (a backward for
    its reload, an action for an offload to free its buffers) beyond everything else they waited
    for: the cost the transfers expose."""

    result: SimResult
    transfers: tuple[tuple[Slot, ...], ...]
    copy_wait: tuple[Number, ...]

    @property
    def offloads(self) -> tuple[int, ...]:
        """How many (stage, microbatch) each rank offloads."""
        return tuple(sum(1 for s in row if s.action.op is Op.O) for row in self.transfers)


def simulate_offload(schedule: Schedule, costs: StageCosts | None = None) -> OffloadSim:
    """Replay ``schedule`` (with or without transfers) on compute and copy streams per rank (see
    the module docstring). ``costs.host_bandwidth`` and ``costs.host_unit_bytes`` price the
    transfers. A stall raises the validator's ``deadlock`` error."""
    costs = costs or StageCosts.uniform(1, 1, 1)
    costs.check(schedule)
    send = costs.message_time()
    rows = schedule.actions
    start: dict[Action, Number] = {}
    finish: dict[Action, Number] = {}
    compute_free: list[Number] = [0] * schedule.pp_size
    copy_free = [{Op.O: 0, Op.R: 0} for _ in rows]
    wait: list[Number] = [0] * schedule.pp_size
    pointer = [0] * schedule.pp_size
    # per rank, the offloads issued since its last compute action (the next one overlaps them)
    # and those the last compute action overlapped (the next one waits for them to finish)
    uncovered: list[list[Action]] = [[] for _ in rows]
    covered: list[list[Action]] = [[] for _ in rows]
    deps = {a: dependencies(schedule, a) for row in rows for a in row}
    remaining = sum(map(len, rows))
    while remaining:
        progressed = False
        for rank, row in enumerate(rows):
            while pointer[rank] < len(row):
                action = row[pointer[rank]]
                needed = deps[action]
                if any(d not in finish for d in needed):
                    break
                if action.op.is_transfer:
                    # a reload allocates: like a compute action, after the offloads that the
                    # last compute action overlapped have freed their buffers
                    gate = [finish[o] for o in covered[rank]] if action.op is Op.R else []
                    begin = max([compute_free[rank], copy_free[rank][action.op]]
                                + [finish[d] for d in needed] + gate)
                    end = begin + costs.transfer_time(schedule, action.stage)
                    copy_free[rank][action.op] = end
                    if action.op is Op.O:
                        uncovered[rank].append(action)
                else:
                    ready = [finish[d] + (send if schedule.rank_of(d.stage) != rank else 0)
                             for d in needed]
                    gate = [finish[o] for o in covered[rank]]
                    begin = max([compute_free[rank]] + ready + gate)
                    others = max([compute_free[rank]] + [t for d, t in zip(needed, ready)
                                                         if d.op is not Op.R])
                    wait[rank] += begin - others
                    covered[rank], uncovered[rank] = uncovered[rank], []
                    end = begin + costs.op_costs(action.stage).of(action.op)
                    compute_free[rank] = end
                start[action], finish[action] = begin, end
                pointer[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise deadlock_error(schedule.compute_only())
    timeline = tuple(tuple(Slot(a, start[a], finish[a]) for a in row if not a.op.is_transfer)
                     for row in rows)
    transfers = tuple(tuple(Slot(a, start[a], finish[a]) for a in row if a.op.is_transfer)
                      for row in rows)
    memory = tuple(_curve(schedule, costs, row, start, finish) for row in rows)
    result = SimResult(name=schedule.name, num_stages=schedule.num_stages,
                       num_microbatches=schedule.num_microbatches, placement=schedule.placement,
                       timeline=timeline, memory=memory, costs=costs.describe())
    return OffloadSim(result, transfers, tuple(wait))


def _curve(schedule: Schedule, costs: StageCosts, row: Iterable[Action],
           start: dict[Action, Number], finish: dict[Action, Number]
           ) -> tuple[tuple[Number, Number], ...]:
    """Device activation memory of one rank over time: F and R allocate at their start; O frees
    at its end; I frees ``1 - weight_grad_fraction`` and W the rest at their ends, B all of it."""
    kept = costs.weight_grad_fraction
    events: list[tuple[Number, int, Number]] = []  # (time, 0 = free / 1 = allocate, delta)
    for action in row:
        weight = costs.activation_weight(schedule, action.stage)
        delta = {Op.F: weight, Op.R: weight, Op.O: -weight, Op.B: -weight,
                 Op.I: -weight * (1 - kept), Op.W: -weight * kept}[action.op]
        if delta:
            events.append((start[action], 1, delta) if delta > 0 else (finish[action], 0, delta))
    return tuple(step_function(events))


def best_with_offload(pp_size: int, microbatches: int, costs: StageCosts, limit: float,
                      names: Iterable[str] | None = None) -> tuple[Schedule, OffloadSim]:
    """The schedule with the shortest simulated makespan that fits ``limit`` units per rank,
    over the one-copy families (``names``: a subset of ``families.names()``) at their default
    chunks, each as it is when its peak fits and else with ``insert_offload``'s transfers, priced
    by ``costs``' host link (``simulate_offload``). ``costs`` are one full rank's (a single
    ``OpCosts``): a family with v stages per rank runs each at 1/v of them. Ties: fewer
    transfers, then the family's name. A family that cannot schedule ``microbatches``, or whose peak the policy cannot bring
    under the limit, is left out; ValueError when none is left.

    This is how the host link enters the choice: with a fast link a schedule that keeps the
    pipeline full (and holds more) may win once offloaded; with a slow one the low-memory
    families do."""
    if len(costs.stages) != 1:
        raise ValueError("best_with_offload compares placements: give one full rank's costs")
    full = costs.stages[0]
    best: tuple | None = None
    for name in names if names is not None else families.names():
        try:
            schedule = insert_offload(families.get(name)(pp_size, microbatches), limit)
        except ValueError:
            continue
        v = schedule.chunks_per_rank
        chunk = OpCosts(*(None if x is None else x / v if not isinstance(x, int)
                          else Fraction(x, v) for x in (full.f, full.i, full.w, full.b)))
        sim = simulate_offload(schedule, replace(costs, stages=(chunk,)))
        key = (sim.result.makespan, sum(map(len, sim.transfers)), name)
        if best is None or key < best[0]:
            best = (key, schedule, sim)
    if best is None:
        raise ValueError(f"no family fits {limit:g} activation units per rank at pp={pp_size}, "
                         f"m={microbatches}, with or without offload")
    return best[1], best[2]


def count_transfers(schedule: Schedule) -> Counter:
    """How many offloads (``Op.O``) and reloads (``Op.R``) each rank issues: ``{(rank, op): n}``."""
    return Counter((rank, a.op) for rank, row in enumerate(schedule.actions)
                   for a in row if a.op.is_transfer)
