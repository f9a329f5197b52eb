"""Schedule search (``loom schedule search``): the shortest pipeline schedule under a memory limit.

Given per-stage costs of F, I and W, a send latency, a placement family and a memory limit,
``search`` returns the candidate with the shortest simulated makespan whose peak activation
memory stays within the limit on every rank; among equal makespans, the one with the least idle
time inside its longest rank span (the Zero Bubble paper's bubble, what an iteration costs once
iterations overlap), then the lowest peak. Memory follows ``loom.schedule.validate``: a
(stage, microbatch) is live from the start of its F to the end of its last backward piece, one
unit is one full rank's activations for one microbatch, a chunk of a v-chunk placement weighs
1/v. So 1F1B needs p units, and no schedule fits below 1 unit (one microbatch in flight).

Candidates, all ranked by the one replay engine (``loom.schedule.replay``, float costs) and the
winner re-simulated exactly with ``loom.schedule.simulate``:

a. every registered family (``loom.schedule.families``) whose placement is allowed and whose
   peak fits the limit;
b. forward-backward scheduling on the two-chunk placements: ``search_reverse`` builds the
   schedule backwards in time (every rank ends on a run of deferred W's, ranks staggered like
   a parallelogram), then ``search_priority`` rebuilds it forwards following the backward
   schedule's start times as priorities (a few stagger / reserve / patience settings);
c. the parametric list scheduler of ``search_greedy`` (ZB-1p / ZB-2p style) on each allowed
   placement, with a coordinate sweep over its knobs (reservation, warm-up caps, patience,
   W backlog, depth-first forwards);
d. local improvement of the best orders (small sizes only): swap adjacent actions on a rank,
   keep the swap when the order stays valid, within the limit, and the score improves;
e. a patient forward-backward pass (``_PATIENT``) with its own effort, ``effort / 4`` on top:
   ranks wait briefly for urgent inputs, except the last few, which lowers the Zero Bubble idle
   at the same makespan. It runs last, so everything before it is what it would be without it.

Why hand-written: no library does pipeline-schedule search. torch.distributed.pipelining ships
fixed families and a CSV loader; the Zero Bubble authors' ILP/heuristic lives inside their
Megatron fork and assumes their own schedule representation. This module works on Loom's IR,
so what it returns is what the simulator replays and the runtime executes.

Costs are those of one *full* stage (one rank's whole share of the model). On a placement with
v chunks per rank each chunk gets 1/v of them (``placement_costs``); the send latency is per
message and does not shrink. Give one ``OpCosts`` for every stage or one per rank.

Deterministic: the effort is counted in simulated actions, not seconds, so the same inputs give
the same schedule on any machine; ``time_budget_s`` is an extra safety stop that, when it fires,
trades that determinism for a bound on wall time.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loom.schedule.ir import Schedule, looped_placement, v_placement
from loom.schedule.families import SEARCH_PLACEMENTS, get, names
from loom.schedule.replay import EPS, F, Costs, Row, Score, decode, encode, peak_units, score
from loom.schedule.search_greedy import Knobs, list_schedule
from loom.schedule.search_local import improve
from loom.schedule.search_priority import priority_schedule
from loom.schedule.search_reverse import ReverseKnobs, reverse_schedule
from loom.schedule.validate import validate
from loom.schedule.cost import StageCosts, full_stage_costs
from loom.schedule.simulate import SimResult, simulate

PLACEMENTS = SEARCH_PLACEMENTS  # v=1 looped; v=2 looped (interleaved); v=2 V shape
MIN_MEMORY_LIMIT = 1.0  # one microbatch in flight: every chunk of it is live on its rank at once
DEFAULT_EFFORT = 500_000  # simulated actions over all candidates (p=32, m=256: ~12 candidates)
LOCAL_MAX_ACTIONS = 5_000  # local improvement only below this size: each try replays everything


class SearchError(ValueError):
    """The search cannot run with these inputs (the message names the argument and the rule)."""


@dataclass(frozen=True)
class Candidate:
    """One ranked candidate: where it came from and its replayed makespan and peak memory."""

    label: str
    placement: str
    makespan: float
    peak: float
    idle_zb: float = 0.0  # idle time inside the longest rank span (``SimResult.bubble_time_zb``)


@dataclass(frozen=True)
class SearchResult:
    """The best schedule, its reference simulation, and what the search looked at."""

    schedule: Schedule
    sim_result: SimResult
    costs: StageCosts  # the placement-scaled costs ``sim_result`` was simulated with
    memory_limit: float
    candidates_tried: int
    best: Candidate
    leaderboard: tuple[Candidate, ...] = field(default=())  # the best few, best first

    def summary(self) -> dict:
        return {
            "schedule": self.schedule.name,
            "placement": self.best.placement,
            "memory_limit": self.memory_limit,
            "candidates_tried": self.candidates_tried,
            **self.sim_result.summary(),
            "leaderboard": [dataclasses.asdict(c) for c in self.leaderboard],
        }


def placement_of(name: str, pp: int) -> tuple[int, ...]:
    """The stage -> rank tuple of a placement family."""
    if name == "looped":
        return looped_placement(pp)
    if name == "interleaved":
        return looped_placement(pp, 2)
    if name == "v":
        return v_placement(pp, 2)
    raise SearchError(f"placement: unknown {name!r}; choose from any, {', '.join(PLACEMENTS)}")


def placement_costs(costs: StageCosts, placement: tuple[int, ...]) -> StageCosts:
    """``costs`` of full stages, per global stage of ``placement`` (a chunk gets 1/v of them:
    ``loom.schedule.cost.full_stage_costs``, the CLI's one meaning of ``--costs``)."""
    pp = max(placement) + 1
    if len(costs.stages) not in (1, pp):
        raise SearchError(
            f"costs: give one F,I,W for every stage or one per rank ({pp}), got {len(costs.stages)}"
        )
    if costs.activation is not None:
        raise SearchError("costs: per-stage activation weights are not supported by the search; "
                          "it uses the validator's units (a chunk of v weighs 1/v)")
    return full_stage_costs(costs, Schedule(len(placement), 1, placement, [[]] * pp))


def _without_cyclic_gc(function: Callable[..., SearchResult]) -> Callable[..., SearchResult]:
    """Pause the cyclic garbage collector while ``function`` runs: the search makes millions of
    small tuples and lists and no cycles, and scanning them again and again took 10-15% of it."""
    @functools.wraps(function)
    def paused(*args: Any, **kwargs: Any) -> SearchResult:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused


@_without_cyclic_gc
def search(
    pp: int,
    microbatches: int,
    costs: StageCosts,
    memory_limit: float,
    placement: str = "any",
    *,
    effort: int = DEFAULT_EFFORT,
    time_budget_s: float | None = None,
) -> SearchResult:
    """The shortest-makespan schedule found whose peak memory is within ``memory_limit`` units.

    ``effort`` is in simulated actions; the patient pass (step e) spends ``effort / 4`` more."""
    if pp < 1 or microbatches < 1:
        raise SearchError(f"pp and microbatches must be >= 1, got pp={pp}, "
                          f"microbatches={microbatches}")
    if not memory_limit >= MIN_MEMORY_LIMIT:
        raise SearchError(
            f"memory_limit={memory_limit:g} is below the minimum of {MIN_MEMORY_LIMIT:g} unit: "
            "every schedule keeps at least one microbatch's activations (1 unit) live on each "
            f"rank; use memory_limit >= {MIN_MEMORY_LIMIT:g}"
        )
    allowed = PLACEMENTS if placement == "any" else (placement,)
    layouts = {name: placement_of(name, pp) for name in allowed}
    scaled = {name: placement_costs(costs, layout) for name, layout in layouts.items()}
    shapes = {name: Schedule(len(layout), microbatches, layout, [[] for _ in range(pp)])
              for name, layout in layouts.items()}
    fast = {name: Costs.of(scaled[name], shapes[name]) for name in allowed}
    budget = _Budget(effort, time_budget_s)
    pool = _Pool()

    for name, schedule in _families(pp, microbatches, layouts, budget):
        rows = encode(schedule)
        budget.spend(sum(map(len, rows)))
        pool.tried += 1
        peak = max(peak_units(rows, schedule.placement))
        if peak <= memory_limit + EPS:
            _add_scored(pool, schedule.name, name, rows, peak, schedule.placement, microbatches,
                        fast[name])

    # Half of what is left for forward-backward scheduling on the two-chunk placements, V first
    # (its chunks pair up on each rank, which the parallelogram's drain needs least memory for).
    # Two thirds of that go to V when both are allowed: it wins the unequal-cost cells.
    two_chunk = [name for name in ("v", "interleaved") if name in allowed]
    built: dict[str, Built] = {name: {} for name in two_chunk}
    half = budget.share(2)
    for n, name in enumerate(two_chunk):
        share = half.share(1) if n + 1 == len(two_chunk) else _Budget(
            2 * half.left // 3, None, half.deadline)
        _backward(name, layouts[name], microbatches, fast[name], memory_limit, share, pool,
                  _BACKWARD, built[name])
        half.spend(share.spent)
        budget.spend(share.spent)

    shares = len(allowed)
    for name in allowed:  # an equal share of what is left for each placement's sweep
        share = budget.share(shares)
        shares -= 1
        _sweep(name, layouts[name], microbatches, fast[name], memory_limit, share, pool)
        budget.spend(share.spent)

    for candidate, rows in pool.best(3):
        if budget.exhausted() or sum(map(len, rows)) > LOCAL_MAX_ACTIONS:
            break
        layout = layouts[candidate.placement]
        better = improve(rows, layout, microbatches, fast[candidate.placement], memory_limit,
                         Score(candidate.makespan, candidate.idle_zb), budget)
        if better is not None:
            new_rows, scored = better
            pool.add(Candidate(candidate.label + "+local", candidate.placement, scored.makespan,
                               max(peak_units(new_rows, layout)), scored.idle_zb), new_rows)

    patient = _Budget(effort // PATIENT_SHARE, None, budget.deadline)
    for n, name in enumerate(two_chunk):  # V first, as above
        share = patient.share(len(two_chunk) - n)
        _backward(name, layouts[name], microbatches, fast[name], memory_limit, share, pool,
                  _PATIENT, built[name])
        patient.spend(share.spent)

    if not pool.entries:  # cannot happen for limit >= 1: reserve=all always fits
        raise SearchError(f"no schedule fits memory_limit={memory_limit:g}")
    best, rows = pool.best(1)[0]
    schedule = decode(rows, shapes[best.placement], f"search[{best.label}]")
    validate(schedule, memory_limit=memory_limit + EPS)
    result = simulate(schedule, scaled[best.placement])
    return SearchResult(
        schedule=schedule,
        sim_result=result,
        costs=scaled[best.placement],
        memory_limit=memory_limit,
        candidates_tried=pool.tried,
        best=best,
        leaderboard=tuple(c for c, _ in pool.best(5)),
    )


# ----------------------------------------------------------------------------------------------


class _Budget:
    """Effort counted in simulated actions (deterministic), plus an optional wall-time stop."""

    def __init__(self, effort: int, time_budget_s: float | None, deadline: float | None = None):
        self.left = effort
        self.spent = 0
        self.deadline = deadline
        if time_budget_s is not None:
            self.deadline = time.monotonic() + time_budget_s

    def spend(self, actions: int) -> None:
        self.left -= actions
        self.spent += actions

    def share(self, parts: int) -> _Budget:
        """A budget of 1/parts of what is left (the caller spends what the share spent)."""
        return _Budget(max(self.left, 0) // max(parts, 1), None, self.deadline)

    def exhausted(self) -> bool:
        late = self.deadline is not None and time.monotonic() > self.deadline
        return self.left <= 0 or late


class _Pool:
    """Every candidate that fits; ``best`` orders by makespan, then peak, then arrival."""

    def __init__(self) -> None:
        self.entries: list[tuple[Candidate, list[Row]]] = []
        self.tried = 0

    def add(self, candidate: Candidate, rows: list[Row]) -> None:
        self.entries.append((candidate, rows))

    def best(self, count: int) -> list[tuple[Candidate, list[Row]]]:
        def key(n: int) -> tuple:
            c = self.entries[n][0]
            return (*Score(c.makespan, c.idle_zb).key(), c.peak, n)

        order = sorted(range(len(self.entries)), key=key)
        return [self.entries[n] for n in order[:count]]


# Families tried first: the ones that most often win (ZB-V is zero-bubble at T_F = T_I = T_W);
# the unit-step greedy ones (v_half, v_min) are slow to build and the list scheduler covers them.
_FAMILY_ORDER = ["zbv", "zb_h2", "zb_h1", "dualpipev", "interleaved_1f1b", "1f1b", "gpipe",
                 "looped_bfs"]


def _families(pp: int, microbatches: int, layouts: dict[str, tuple[int, ...]], budget: _Budget
              ) -> Iterator[tuple[str, Schedule]]:
    """Registered families whose placement is one of ``layouts`` (sizes they reject skipped)."""
    by_layout = {layout: name for name, layout in layouts.items()}
    for family in sorted(names(), key=lambda f: (_FAMILY_ORDER + [f]).index(f)):
        if budget.exhausted():
            return
        try:
            schedule = get(family)(pp, microbatches)
        except ValueError:
            continue
        if schedule.placement in by_layout:
            yield by_layout[schedule.placement], schedule


def _sweep(name: str, layout: tuple[int, ...], microbatches: int, costs: Costs, limit: float,
           budget: _Budget, pool: _Pool) -> None:
    """Coordinate search over the list scheduler's knobs, starting from the safe default."""
    pp = max(layout) + 1
    actions = 3 * len(layout) * microbatches
    shortest = min(min(d[:3]) for d in costs.duration)
    chunked = len(layout) > pp
    caps = [tuple(min(limit, a * (pp - 1 - r) / (len(layout) // pp) + 1 + b) for r in range(pp))
            for a, b in ((1, 0), (2, 0), (1, 1), (2, 1))]
    axes: list[tuple[str, list]] = [  # most useful first: the budget may end the sweep early
        ("reserve", [None, 1, 0, 2] if chunked else [None]),
        ("forward_first", [False, True]),
        ("patience", [0.0, costs.send * 2, shortest / 2]),
        ("w_fill", [0.0, 0.5, 1.0]),
        ("caps", [None, *caps]),
        ("depth_first", [True, False]),
        ("w_backlog", [None, 0, pp // 2, pp]),
    ]
    best_knobs, best_time = Knobs(), float("inf")
    seen: set[Knobs] = set()
    for _round in range(2):
        improved = False
        for axis, values in axes:
            for value in values:
                knobs = dataclasses.replace(best_knobs, **{axis: value})
                if knobs in seen:
                    continue
                if budget.exhausted() and best_time < float("inf"):
                    return
                seen.add(knobs)
                budget.spend(actions)
                pool.tried += 1
                made = list_schedule(layout, microbatches, costs, limit, knobs)
                if made is None:
                    continue
                rows, makespan, peak = made
                scored = score(rows, layout, microbatches, costs)
                idle = scored.idle_zb if scored is not None else float("inf")
                pool.add(Candidate(f"greedy:{name}:{knobs.label()}", name, makespan, peak, idle),
                         rows)
                if makespan < best_time - EPS:
                    best_knobs, best_time, improved = knobs, makespan, True
        if not improved:
            return


# (reverse knobs, forward reserve, forward patience in hops, calm last ranks), most useful first:
# the budget may stop the list early. Stagger 1 starts rank r's reversed schedule (p-1-r) hops
# late, mirroring the forward warm-up; reserve 0 lets the forward pass admit as deep as the memory
# allows.
_BACKWARD = [
    (ReverseKnobs(stagger=1.0), 0, 0.0, 0),
    (ReverseKnobs(stagger=1.0, i_first=True), 0, 0.0, 0),
    (ReverseKnobs(stagger=0.9, i_first=True), 0, 0.5, 0),
    (ReverseKnobs(stagger=1.0), 0, 0.5, 0),
    (ReverseKnobs(stagger=1.0, i_first=True), 0, 0.5, 0),
    (ReverseKnobs(stagger=1.0), None, 0.0, 0),
    (ReverseKnobs(stagger=1.2), 0, 0.0, 0),
    (ReverseKnobs(stagger=1.0), 1, 0.0, 0),
    (ReverseKnobs(), 0, 0.0, 0),
]
# The patient pass, with its own effort after everything else (so it only adds candidates).
# Patience of a fifth to a quarter hop (more than a round trip of latency, less than any action)
# lets a rank wait for the input of a more urgent action rather than start a less urgent one:
# that keeps the input-gradient chain on time and shortens the spans of the ranks it passes (the
# Zero Bubble idle). The last ``calm`` ranks get no patience: the last rank starts last and its
# span ends the makespan, so a wait there lengthens the makespan; the others have slack. The
# reversed schedules are mostly the ones the list above built already.
_PATIENT = [
    (ReverseKnobs(stagger=1.0), 0, 0.25, 2),
    (ReverseKnobs(stagger=0.9, i_first=True), 0, 0.2, 3),
    (ReverseKnobs(stagger=1.0, i_first=True), 0, 0.25, 2),
    (ReverseKnobs(stagger=0.9), 0, 0.25, 1),
]
PATIENT_SHARE = 4  # the patient pass gets effort / PATIENT_SHARE on top of ``effort``


Built = dict[ReverseKnobs, "tuple[list[Row], float, dict] | None"]


def _backward(name: str, layout: tuple[int, ...], microbatches: int, costs: Costs, limit: float,
              budget: _Budget, pool: _Pool, settings: list, built: Built) -> None:
    """Forward-backward candidates: a backward schedule, then a forward one by its priorities
    (``settings``: entries like ``_BACKWARD``'s; ``built`` caches the backward schedules)."""
    actions = 3 * len(layout) * microbatches
    hop = sum(d[F] for d in costs.duration) / len(layout) + costs.send
    pp = max(layout) + 1
    for knobs, reserve, patience, calm in settings:
        if budget.exhausted():
            return
        if knobs not in built:
            budget.spend(2 * actions)
            pool.tried += 1
            built[knobs] = made = reverse_schedule(layout, microbatches, costs, limit, knobs)
            if made is not None:
                _add_scored(pool, f"backward:{name}:{knobs.label()}", name, made[0], made[1],
                            layout, microbatches, costs)
        made = built[knobs]
        if made is None:
            continue
        budget.spend(2 * actions)
        pool.tried += 1
        calm = min(calm, pp - 1)
        waits = [patience * hop] * (pp - calm) + [0.0] * calm
        forward = priority_schedule(layout, microbatches, costs, limit, made[2], reserve, waits)
        if forward is not None:
            label = (f"forward-backward:{name}:{knobs.label()},reserve="
                     f"{'all' if reserve is None else reserve},patience={patience:g}"
                     + (f",calm={calm}" if calm and patience else ""))
            _add_scored(pool, label, name, forward[0], forward[1], layout, microbatches, costs)


def _add_scored(pool: _Pool, label: str, name: str, rows: list[Row], peak: float,
                layout: tuple[int, ...], microbatches: int, costs: Costs) -> None:
    scored = score(rows, layout, microbatches, costs)
    if scored is not None:
        pool.add(Candidate(label, name, scored.makespan, peak, scored.idle_zb), rows)
