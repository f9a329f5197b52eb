"""Schedule search (``loom schedule search``): the shortest pipeline schedule under a memory limit.

Given per-stage costs of F, I and W, a send latency, a placement family and a memory limit,
``search`` returns the candidate with the shortest simulated makespan whose peak activation
memory stays within the limit on every rank; among equal makespans, the one with the least idle
time inside its longest rank span (the Zero Bubble paper's bubble, what an iteration costs once
iterations overlap), then the lowest peak. Memory follows ``loom.schedule.validate``: a
(stage, microbatch) is live from the start of its F to the end of its last backward piece, one
unit is one full rank's activations for one microbatch, a chunk of a v-chunk placement weighs
1/v. So 1F1B needs p units, and no schedule fits below 1 unit (one microbatch in flight).

Placements (``places``, in ``loom.schedule.search_places``): v = 1..``max_chunks`` (at most 8)
stages per rank, looped (v = 1), interleaved (looped with v >= 2), V (the v = 2 zig-zag) and
wave (the zig-zag with v >= 3, Hanayo's); ``placement`` pins one of the first three at its
classic chunk count (looped 1, interleaved 2, v 2, the config's ``parallel.schedule_placement``),
and ``max_chunks`` is what the model's layers allow (``loom.schedule.select`` passes layers // pp).

Candidates, all ranked by the one replay engine (``loom.schedule.replay``, float costs) and the
winner re-simulated exactly with ``loom.schedule.simulate.headline`` (its figures; the
result's full ``sim_result`` is simulated when first asked for):

a. seeds: every registered family (``loom.schedule.families``) at each chunk count it takes, and
   torch's interleaved zero bubble (``families.zero_bubble.interleaved_zb``), on an allowed
   placement and within the limit. That covers every schedule class torch 2.13's
   ``torch.distributed.pipelining`` ships (their orders are the families', tested against
   torch's), so the search is never worse than any of them that fits wherever all seeds are
   priced: up to ``SCREEN_PP`` ranks they all are, whatever the effort. A placement no family
   orders (the waves) gets the list scheduler's safe setting as its seed. Above ``SCREEN_PP``
   ranks the seeds are first screened on a copy of the problem with ``SCREEN_PP`` ranks and as
   many microbatches per rank, at most ``SCREEN_MICROBATCHES`` (the idle of these schedules grows
   with p - 1, so the copy ranks them at a fraction of the cost), then priced exactly in that
   order while each fits in what is left of half the effort (its F, I and W of every stage and
   microbatch), at least ``MIN_SEEDS`` of them; the waves' seeds are then only screened (the
   sweep builds them on the placements it takes up);
b. forward-backward scheduling on the two best multi-chunk placements the seeds found (a
   placement is left out once the best seed meets its ``makespan_lower_bound``):
   ``search_reverse`` builds the schedule backwards in time (every rank ends on a run of
   deferred W's, ranks staggered like a parallelogram), then ``search_priority`` rebuilds it
   forwards following the backward schedule's start times as priorities (a few stagger /
   reserve / patience settings);
c. the parametric list scheduler of ``search_greedy`` (ZB-1p / ZB-2p style) on those placements
   and the best one overall, with a coordinate sweep over its knobs (reservation, warm-up caps,
   patience, W backlog, depth-first forwards);
d. local improvement of the best orders, seeds included (small sizes only): swap adjacent
   actions on a rank, keep the swap when the order stays valid, within the limit, and the score
   improves;
e. a patient forward-backward pass (``_PATIENT``) with its own effort, ``effort / 4`` on top:
   ranks wait briefly for urgent inputs, except the last few, which lowers the Zero Bubble idle
   at the same makespan. It runs last, so everything before it is what it would be without it.

   Large problems (above ``REDUCE_FROM`` actions at the most chunks, with effort left after the
   seeds) run b, c and e on a copy with m' microbatches, m' in [3p, 4p) and at most m / 2
   (``reduced_microbatches``), with the effort scaled by m'/m, so they try the same orders at a
   fraction of the cost. The copy's best ``GROWN`` orders come back to full size only where they
   can win: its makespan on the copy plus the busiest rank's work for the m - m' microbatches it
   lacks (the steady state's slope) must be within ``GROWN_MARGIN`` of the best full-size one.
   Such an order is grown by repeating its steady state (``loom.schedule.periodic``), or, the
   first that does not grow, rebuilt at full size by its recipe; either is replayed and its peak
   checked at full size before it ranks. So the winner is always a full-size order, replayed and
   exactly simulated; the seeds are priced at full size as before. What the copy can miss: an
   order that ranks below the copy's best three yet would win at full size, or one whose
   prediction overstates it by more than the margin. Over a grid of 27 cells at p = 16-64
   (docs/benchmarks.md, "Search time, third pass") every winner's makespan was unchanged.
   Below the threshold the search is exactly what it was (``test_search_pinned.py``).
f. only with ``offload=True``: PipeOffload after a-e, which it leaves as they are
   (``loom.schedule.search_offload``).

Why hand-written: no library does pipeline-schedule search. torch.distributed.pipelining ships
fixed families and a CSV loader; the Zero Bubble authors' ILP/heuristic lives inside their
Megatron fork and assumes their own schedule representation. This module works on Loom's IR,
so what it returns is what the simulator replays and the runtime executes. Its inner loops (the
three list schedulers and the replay behind ``score``) also run compiled, to the same bits
(``loom.schedule.compiled``).

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
import inspect
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loom.schedule.ir import Schedule
from loom.schedule.families import get, names
from loom.schedule.families.interleaved import interleaved_1f1b, interleaved_1f1b_rows
from loom.schedule.families.zero_bubble import interleaved_zb, interleaved_zb_rows
from loom.schedule.periodic import extend
from loom.schedule.replay import (EPS, B, F, I, W, Costs, Row, Score, decode, encode, peak_units,
                                  score)
from loom.schedule.search_greedy import Knobs, list_schedule
from loom.schedule.search_local import improve
from loom.schedule.search_loop import Asap
from loom.schedule.search_priority import priority_schedule
from loom.schedule.search_reverse import ReverseKnobs, reverse_schedule
from loom.schedule.cost import StageCosts
from loom.schedule.search_offload import with_offload
from loom.schedule.search_pool import Budget, Pool, Recipe
from loom.schedule.search_places import (MAX_CHUNKS, PINNED, SearchError, place_of,
                                         placement_costs, placement_of, places)
from loom.schedule.search_types import Candidate, Place, SearchResult
from loom.schedule.simulate import headline

MAX_SEARCH_PP = 512  # ranks: 512 of two microbatches took 7.5 s on 2 cores
MIN_MEMORY_LIMIT = 1.0  # one microbatch in flight: every chunk of it is live on its rank at once
DEFAULT_EFFORT = 500_000  # simulated actions over all candidates (p=32, m=256: ~12 candidates)
LOCAL_MAX_ACTIONS = 5_000  # local improvement only below this size: each try replays everything
SCREEN_PP = 8  # above this many ranks the seeds are ranked on a copy with this many first
SCREEN_MICROBATCHES = 4 * SCREEN_PP  # ... and at most this many microbatches
MIN_SEEDS = 1  # family seeds priced exactly however little effort is left: the screen's best
OFFLOAD_SCREENED = 12  # step f above SCREEN_PP ranks: seeds built at full size, best screened
REDUCE_FROM = 30_000  # steps b, c, e explore a copy with fewer microbatches above these actions
REDUCED_PER_RANK = 3  # ... with about this many microbatches per rank (m' in [3p, 4p))
GROWN = 3  # the copy's best orders grown to full size (``periodic.extend``) and replayed
GROWN_MARGIN = 0.01  # ... unless their predicted makespan is this much over the best one's


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


class _Problem:
    """One (pp, microbatches, costs) instance: each placement's layout, scaled costs, empty
    schedule shape and float costs, made when first asked for (there are up to 15 placements)."""

    def __init__(self, pp: int, microbatches: int, costs: StageCosts):
        self.pp, self.microbatches, self.costs = pp, microbatches, costs
        self._made: dict[Place, tuple[tuple[int, ...], StageCosts, Schedule, Costs]] = {}

    def _make(self, place: Place) -> tuple[tuple[int, ...], StageCosts, Schedule, Costs]:
        if place not in self._made:
            layout = placement_of(place[0], self.pp, place[1])
            scaled = placement_costs(self.costs, layout)
            shape = Schedule(len(layout), self.microbatches, layout, [[] for _ in range(self.pp)])
            self._made[place] = (layout, scaled, shape, Costs.of(scaled, shape))
        return self._made[place]

    def layout(self, place: Place) -> tuple[int, ...]:
        return self._make(place)[0]

    def scaled(self, place: Place) -> StageCosts:
        return self._make(place)[1]

    def shape(self, place: Place) -> Schedule:
        return self._make(place)[2]

    def fast(self, place: Place) -> Costs:
        return self._make(place)[3]


@_without_cyclic_gc
def search(
    pp: int,
    microbatches: int,
    costs: StageCosts,
    memory_limit: float,
    placement: str = "any",
    *,
    max_chunks: int = MAX_CHUNKS,
    effort: int = DEFAULT_EFFORT,
    time_budget_s: float | None = None,
    offload: bool = False,
) -> SearchResult:
    """The shortest-makespan schedule found whose peak memory is within ``memory_limit`` units.

    ``max_chunks``: the most stages per rank (the model's layers / pp; at most ``MAX_CHUNKS``).
    ``effort`` is in simulated actions; the patient pass (step e) spends ``effort / 4`` more.
    ``offload``: also weigh PipeOffload (step f): the fastest seeds over the limit, with
    ``insert_offload``'s transfers and priced on ``costs``' host link; the winner may then hold
    offload / reload actions and its ``sim_result`` is ``simulate_offload``'s."""
    if pp < 1 or microbatches < 1:
        raise SearchError(f"pp and microbatches must be >= 1, got pp={pp}, "
                          f"microbatches={microbatches}", "pp" if pp < 1 else "microbatches")
    if pp > MAX_SEARCH_PP:
        raise SearchError(f"pp={pp}: the search prices every family on every placement, in time"
                          f" growing faster than the ranks (1,024 ranks of one microbatch took"
                          f" 24 s, 2,048 52 s); at most {MAX_SEARCH_PP} ranks (published"
                          " pipelines have p <= 128)", "pp")
    if not memory_limit >= MIN_MEMORY_LIMIT:
        raise SearchError(
            f"memory_limit={memory_limit:g} is below the minimum of {MIN_MEMORY_LIMIT:g} unit: "
            "every schedule keeps at least one microbatch's activations (1 unit) live on each "
            f"rank; use memory_limit >= {MIN_MEMORY_LIMIT:g}", "memory_limit")
    allowed = places(pp, placement, max_chunks)
    problem = _Problem(pp, microbatches, costs)
    for place in allowed:  # the costs' errors (per-rank count, activation weights) up front
        problem.fast(place)
    budget = Budget(effort, time_budget_s)
    pool = Pool()

    ranked = _seed(problem, allowed, memory_limit, budget, pool)

    # The placements worth the improvement steps: the two best multi-chunk placements the seeds
    # found for forward-backward scheduling (once V first by rule, as it won the unequal-cost
    # cells among two chunks; with more chunks the waves and interleaving often rank higher, and
    # ranking them beat the rule in 4 of 36 cells of a p in {4, 8} grid and lost in none); those
    # and the best placement overall for the list scheduler's sweep.
    # A placement whose lower bound (``makespan_lower_bound``) the best seed already meets is
    # left out: nothing on it can be shorter.
    # (no seed fits: every placement stays open; inf - EPS * inf would be NaN and close them all)
    best = pool.best(1)[0][0].makespan if pool.entries else float("inf")
    open_places = [place for place in allowed if not pool.entries or makespan_lower_bound(
        problem.layout(place), microbatches, problem.fast(place)) < best - EPS * max(1.0, best)]
    ranked = [place for place in ranked if place in open_places]
    chunked = [place for place in ranked if place[1] > 1]
    forward_backward = chunked[:2]
    swept = list(dict.fromkeys(forward_backward + (ranked or open_places)[:1]))

    # Large problems explore on a copy with fewer microbatches (``reduced_microbatches``), with
    # the effort scaled alike, and grow their best orders back (``_grown``); small ones explore
    # the problem itself, into the same pool and budget.
    # (Only while effort is left after the seeds: else the full-size steps build one order, the
    # patient pass's, which growing the copy's best would build again on top of the copy's.)
    small_m = reduced_microbatches(pp, microbatches, max(v for _, v in allowed))
    explore, xpool, xbudget = problem, pool, budget
    if small_m < microbatches and budget.left > 0:
        explore, xpool = _Problem(pp, small_m, costs), Pool()
        xbudget = Budget(max(budget.left, 0) * small_m // microbatches, None, budget.deadline)

    # Half of what is left for forward-backward scheduling, the better ranked first; two thirds
    # of that go to it when there are two placements.
    built: dict[Place, Built] = {place: {} for place in forward_backward}
    half = xbudget.share(2)
    for n, place in enumerate(forward_backward):
        share = half.share(1) if n + 1 == len(forward_backward) else Budget(
            2 * half.left // 3, None, half.deadline)
        if share.left < 2 * 2 * 3 * len(problem.layout(place)) * explore.microbatches:
            continue  # not even one backward and forward pass (``_backward``'s charge) is
            # left: the patient pass below always builds one, so this only drops a second pass
        _backward(place, explore, memory_limit, share, xpool, _BACKWARD, built[place])
        half.spend(share.spent)
        xbudget.spend(share.spent)

    shares = len(swept)
    for n, place in enumerate(swept):  # an equal share of what is left for each placement's
        if n and xbudget.exhausted():  # sweep; past the first, only while effort is left
            break
        share = xbudget.share(shares)
        shares -= 1
        _sweep(place, explore, memory_limit, share, xpool)
        xbudget.spend(share.spent)

    for candidate, rows in pool.best(3):
        if budget.exhausted() or sum(map(len, rows)) > LOCAL_MAX_ACTIONS:
            break
        layout = problem.layout(candidate.place)
        better = improve(rows, layout, microbatches, problem.fast(candidate.place), memory_limit,
                         Score(candidate.makespan, candidate.idle_zb), budget)
        if better is not None:
            new_rows, scored = better
            pool.add(dataclasses.replace(
                candidate, label=candidate.label + "+local", makespan=scored.makespan,
                peak=max(peak_units(new_rows, layout)), idle_zb=scored.idle_zb), new_rows)

    patient = Budget(effort // PATIENT_SHARE * explore.microbatches // microbatches, None,
                      budget.deadline)
    for n, place in enumerate(forward_backward):  # the better ranked first, as above
        share = patient.share(len(forward_backward) - n)
        _backward(place, explore, memory_limit, share, xpool, _PATIENT, built[place])
        patient.spend(share.spent)

    if xpool is not pool:
        _grown(xpool, explore, pool, problem, memory_limit)

    if not pool.entries:  # cannot happen for limit >= 1: reserve=all always fits
        raise SearchError(f"no schedule fits memory_limit={memory_limit:g}", "memory_limit")
    best, rows = pool.best(1)[0]
    name = f"search[{best.label}]"
    seeded = pool.built.get(id(rows))
    schedule = (decode(rows, problem.shape(best.place), name) if seeded is None
                else dataclasses.replace(seeded, name=name))
    _check_complete(rows, problem.layout(best.place), microbatches, name)
    # exactly, as ``simulate`` would (raises if it does not run)
    figures = headline(schedule, problem.scaled(best.place), rows=rows)
    if max(figures.peak_memory) > memory_limit + EPS:
        raise AssertionError(f"{name}: peak memory {float(max(figures.peak_memory)):g} over the "
                             f"limit {memory_limit:g} (a bug in the search's memory accounting)")
    found = SearchResult(
        schedule=schedule,
        figures=figures,
        costs=problem.scaled(best.place),
        memory_limit=memory_limit,
        candidates_tried=pool.tried,
        best=best,
        leaderboard=tuple(c for c, _ in pool.best(5)),
    )
    if not offload:
        return found
    seeds: list[_Seed] = [seed for seed in _seed_list(allowed) if isinstance(seed, _FamilySeed)]
    if pp > SCREEN_PP:  # building every family at full size costs more than the rest
        seeds = _screened(seeds, problem, allowed, float("inf"))[0][:OFFLOAD_SCREENED]
    made = functools.partial(_made, problem=problem, allowed=allowed, limit=memory_limit)
    return with_offload(found, seeds, made, problem, budget.late)


def reduced_microbatches(pp: int, microbatches: int, chunks: int) -> int:
    """The microbatches of the copy that steps b, c and e explore: ``microbatches`` itself up to
    ``REDUCE_FROM`` actions (3 per stage and microbatch at ``chunks`` stages per rank), else the
    fewest at or above ``REDUCED_PER_RANK * pp`` that differ from it by a multiple of ``pp``
    (so that a steady-state period of 1, 2, ... or pp microbatches can grow the copy back),
    when that is at most half of them (a larger copy costs more than it saves: the winner
    that does not grow is built again at full size)."""
    if 3 * pp * microbatches * chunks <= REDUCE_FROM:
        return microbatches
    small = microbatches - pp * ((microbatches - REDUCED_PER_RANK * pp) // pp)
    return small if 2 * small <= microbatches else microbatches


def _grown(small: Pool, copy: _Problem, pool: Pool, problem: _Problem, limit: float) -> None:
    """The best ``GROWN`` orders of the copy's pool at full size, added to ``pool`` when they
    run and fit: grown by repeating their steady state (``periodic.extend``) and replayed, or, the
    first that does not grow, rebuilt at full size by its recipe (the list schedulers again).

    One that cannot beat the pool's best is left out unbuilt: its makespan on the copy plus the
    busiest rank's work for the microbatches the copy lacks (the steady state's slope; its ramps
    do not shrink with more microbatches) over the best makespan by ``GROWN_MARGIN``. Where no
    seed fits (nothing in ``pool``), every order of the copy is tried in turn until one does."""
    pool.tried += small.tried
    best = pool.best(1)[0][0].makespan if pool.entries else float("inf")
    slope = _busiest(problem.costs) * (problem.microbatches - copy.microbatches)
    rebuilt = False
    for candidate, rows in small.best(GROWN):
        if candidate.makespan + slope > best * (1 + GROWN_MARGIN):
            break  # the others are longer on the copy too
        rebuilt |= _to_full_size(candidate, rows, small, copy, pool, problem, limit, rebuilt)
    if not pool.entries:
        for candidate, rows in small.best(len(small.entries)):
            if _to_full_size(candidate, rows, small, copy, pool, problem, limit, False) and \
                    pool.entries:
                return


def _to_full_size(candidate: Candidate, rows: list[Row], small: Pool, copy: _Problem,
                  pool: Pool, problem: _Problem, limit: float, rebuilt: bool) -> bool:
    """``_grown``'s step for one order: grow it, or rebuild it unless ``rebuilt`` (one was
    already), and add it to ``pool`` if it runs and fits. True when it was rebuilt."""
    layout = problem.layout(candidate.place)
    grown, scored = extend(rows, copy.microbatches, problem.microbatches), None
    from_recipe = grown is None
    if from_recipe:
        recipe = small.recipes.get(id(rows))
        if rebuilt or recipe is None:
            return False
        made = recipe(problem, limit)
        if made is None:
            return False
        grown, scored = made
    peak = _peak(grown, layout)
    if peak > limit + EPS:
        return False
    if scored is None:
        return _add_scored(pool, candidate.label, candidate.place, grown, peak, problem) \
            and from_recipe
    pool.add(Candidate(candidate.label, candidate.placement, scored.makespan, peak,
                       scored.idle_zb, candidate.chunks), grown)
    return from_recipe


def _greedy_recipe(place: Place, knobs: Knobs, problem: _Problem, limit: float
                   ) -> tuple[list[Row], Score | None] | None:
    """A sweep candidate on ``problem``: its rows (its idle is replayed by the caller)."""
    made = list_schedule(problem.layout(place), problem.microbatches, problem.fast(place), limit,
                         knobs)
    return None if made is None else (made[0], None)


def _backward_recipe(place: Place, knobs: ReverseKnobs, forward: tuple | None, problem: _Problem,
                     limit: float) -> tuple[list[Row], Score | None] | None:
    """A backward candidate (``forward`` None) or a forward-backward one (``forward``: its
    reserve and per-rank waits) on ``problem``: rows, and the score where built with it."""
    layout, m, costs = problem.layout(place), problem.microbatches, problem.fast(place)
    made = reverse_schedule(layout, m, costs, limit, knobs)
    if made is None or forward is None:
        return None if made is None else (made[0], None)
    reserve, waits = forward
    asap = Asap(layout, m, costs)  # scored while built, as ``_backward`` does
    made = priority_schedule(layout, m, costs, limit, made[2], reserve, waits, asap)
    return None if made is None else (made[0], asap.score(made[0]))


def _check_complete(rows: list[Row], layout: tuple[int, ...], microbatches: int,
                    name: str) -> None:
    """The winner holds, once each and on the stage's rank, every (stage, microbatch)'s F and
    either its I and W or its B (the families' seeds may run full backwards).

    What ``loom.schedule.validate`` checks that the search has not checked already: every
    candidate's replay ran to its end (so nothing waits forever) and its peak was within the
    limit (``headline`` confirms both for the winner). Stated on the integer rows with sets and
    counts, the check costs a tenth of a full validation (1.8 s at p=64, m=512 and eight chunks
    per rank), which the search's callers run where they need it (``loom.schedule.select``)."""
    pairs = len(layout) * microbatches
    on_rank = [{s for s, r in enumerate(layout) if r == rank} for rank in range(len(rows))]
    seen: set[tuple[int, int, int]] = set()
    ops: Counter[int] = Counter()
    for rank, row in enumerate(rows):
        seen.update(row)
        ops.update([o for _, o, _ in row])
        if not {s for s, _, _ in row} <= on_rank[rank]:
            raise AssertionError(f"{name}: rank {rank} holds a stage placed elsewhere (a bug "
                                 "in the search)")
    mbs = [k for row in rows for _, _, k in row]
    split = set()
    if ops[B]:  # which pairs run I and W, which run B
        split = {(s, k) for s, o, k in seen if o == I}
    # distinct actions in range: then these counts mean every F, I, W (or B) is there
    if (len(seen) != len(mbs) or set(ops) - {F, I, W, B}
            or (mbs and (min(mbs) < 0 or max(mbs) >= microbatches))
            or ops[F] != pairs or ops[I] != ops[W] or ops[I] + ops[B] != pairs
            or (ops[B] and (split != {(s, k) for s, o, k in seen if o == W}
                            or any((s, k) in split for s, o, k in seen if o == B)))):
        raise AssertionError(f"{name}: not every (stage, microbatch) has its F and either its I "
                             "and W or its B, once each (a bug in the search)")


# ----------------------------------------------------------------------------------------------


def _label(place: Place) -> str:
    """``v``, ``interleaved``, ``looped`` at their classic chunk counts, else ``interleavedx4``."""
    return place[0] if place in PINNED.values() else f"{place[0]}x{place[1]}"


def _ranked_places(pool: Pool, allowed: list[Place]) -> list[Place]:
    """The placements that hold a candidate, by their best candidate, best first."""
    ranked: list[Place] = []
    for candidate, _ in pool.best(len(pool.entries)):
        if candidate.place in allowed and candidate.place not in ranked:
            ranked.append(candidate.place)
    return ranked


# Families tried first when nothing is screened: the ones that most often win (ZB-V is
# zero-bubble at T_F = T_I = T_W); the unit-step greedy ones (v_half, v_min) are slow to build.
_FAMILY_ORDER = ["zbv", "zb_h2", "zb_h1", "dualpipev", "interleaved_1f1b", "1f1b", "gpipe",
                 "looped_bfs"]


@dataclass(frozen=True)
class _FamilySeed:
    """A family's order: ``make(pp, microbatches)``, which raises ValueError for sizes it does
    not take."""

    label: str
    make: Callable[[int, int], Schedule]
    # the same order as ``placement, encode(rows)`` without the Action objects, where the family
    # has that form (``families.zero_bubble.interleaved_zb_rows``): what the pricing needs
    rows: Callable[[int, int], tuple[tuple[int, ...], list[Row]]] | None = None


@dataclass(frozen=True)
class _GreedySeed:
    """The list scheduler's safe setting (reserve all: it cannot deadlock) on ``place``."""

    label: str
    place: Place


_Seed = _FamilySeed | _GreedySeed
# families that also build their rows directly (``_FamilySeed.rows``)
_CODED: dict[Callable, Callable] = {interleaved_1f1b: interleaved_1f1b_rows}


def _seed_list(allowed: list[Place]) -> list[_Seed]:
    """Every family at every chunk count it takes (up to the largest allowed), torch's
    interleaved zero bubble, then the waves' list-scheduled seeds (Hanayo orders only whole
    waves, an even chunk count; the list scheduler seeds every wave placement)."""
    top = max(v for _, v in allowed)
    seeds = []
    for family in sorted(names(), key=lambda f: (_FAMILY_ORDER + [f]).index(f)):
        generator = get(family)
        coded = _CODED.get(generator)
        if "chunks" in inspect.signature(generator).parameters:
            seeds += [_FamilySeed(f"{family}(v={v})", functools.partial(generator, chunks=v),
                                  coded and functools.partial(coded, chunks=v))
                      for v in range(1, top + 1)]  # one chunk too: not always the 1F1B order
        else:
            seeds.append(_FamilySeed(family, generator))
    seeds += [_FamilySeed(f"interleaved_zb(v={v})", functools.partial(interleaved_zb, chunks=v),
                          functools.partial(interleaved_zb_rows, chunks=v))
              for v in range(2, top + 1)]
    seeds += [_GreedySeed(f"greedy:{_label(place)}:{Knobs().label()}", place)
              for place in allowed if place[0] == "wave"]
    return seeds


def _made(seed: _Seed, problem: _Problem, allowed: list[Place], limit: float,
          rows_only: bool = False) -> tuple[Place, list[Row], float, Schedule | None] | None:
    """The seed's placement, integer rows, peak units and (a family's) schedule on ``problem``;
    None when it does not take these sizes, lands on a placement that is not allowed, or (a
    list-scheduled seed) cannot be built. ``rows_only``: no schedule where the family builds
    the rows directly (the search decodes the winner's rows: the same schedule)."""
    if isinstance(seed, _GreedySeed):
        made = list_schedule(problem.layout(seed.place), problem.microbatches,
                             problem.fast(seed.place), limit, Knobs())
        return None if made is None else (seed.place, made[0], made[2], None)
    if rows_only and seed.rows is not None:
        try:
            layout, rows = seed.rows(problem.pp, problem.microbatches)
        except ValueError:
            return None
        place = place_of(layout)
        if place not in allowed:
            return None
        return place, rows, _peak(rows, layout), None
    try:
        schedule = seed.make(problem.pp, problem.microbatches)
    except ValueError:
        return None
    place = place_of(schedule.placement)
    if place not in allowed:
        return None
    rows = encode(schedule)
    return place, rows, _peak(rows, schedule.placement), schedule


_LIVE_STEP = (1, 0, -1, -1)  # by op code: F allocates; W, or B when not split, frees; I holds


def _peak(rows: list[Row], layout: tuple[int, ...]) -> float:
    """The peak live units over the ranks of a complete schedule (``replay.peak_units``' figure).

    A (stage, microbatch) is live from its F to its last backward piece, which in a complete
    schedule is its W or, unsplit, its B: so the level while an F runs is the running sum of
    +1 per F and -1 per W or B before it, and only F's raise it. One pass of ``accumulate``
    per rank (the families' seeds are priced by the hundred, up to 800,000 actions each)."""
    peak = 0.0
    step = _LIVE_STEP.__getitem__
    for rank, row in enumerate(rows):
        if row:
            level = max(itertools.accumulate(map(step, [o for _, o, _ in row])))
            peak = max(peak, level / max(layout.count(rank), 1))
    return peak


def _seed(problem: _Problem, allowed: list[Place], limit: float, budget: Budget,
          pool: Pool) -> list[Place]:
    """Step a: price the seeds exactly: all of them up to ``SCREEN_PP`` ranks, whatever the
    effort (at those sizes they are cheap, and they are what makes the search never worse than
    torch's schedules); above it, best screened first while each fits in what is left of half
    the effort (and at least ``MIN_SEEDS`` families that fit). Only ``time_budget_s`` stops them
    earlier. Returns the placements by their best seed, best first: by the exact prices, or by
    the screen's estimates when there is one. A list-scheduled seed is only screened then: it
    is the sweep's first candidate, which builds it on the placements the screen ranks first."""
    seeds = _seed_list(allowed)
    screened = problem.pp > SCREEN_PP
    ranked: list[Place] = []
    chunks: dict[str, int] = {}  # screened: a seed's stages per rank on the copy, by its label
    if screened:
        seeds, ranked, chunks = _screened(seeds, problem, allowed, limit)
        seeds = [seed for seed in seeds if isinstance(seed, _FamilySeed)]
    share = budget.share(2)  # screened: half the effort at most, the rest is the improvements'
    priced = 0
    for seed in seeds:
        # screened, past the first: only a seed whose actions (at most F, I and W of each of
        # its stages and microbatches) fit in what is left of the half
        if priced >= MIN_SEEDS and (budget.late() or (
                screened and 3 * problem.pp * chunks.get(seed.label, 1) * problem.microbatches
                > share.left)):
            break
        made = _made(seed, problem, allowed, limit, rows_only=True)
        if made is None:
            continue
        place, rows, peak, schedule = made
        pool.tried += 1
        share.spend(sum(map(len, rows)))
        budget.spend(sum(map(len, rows)))
        if peak <= limit + EPS and _add_scored(pool, seed.label, place, rows, peak, problem,
                                               schedule):
            priced += isinstance(seed, _FamilySeed)
    return ranked or _ranked_places(pool, allowed)


def _screened(seeds: list[_Seed], problem: _Problem, allowed: list[Place], limit: float
              ) -> tuple[list[_Seed], list[Place], dict[str, int]]:
    """``seeds`` ordered by their makespan estimated on a copy of the problem with
    ``SCREEN_PP`` ranks: the same microbatches per rank (at most ``SCREEN_MICROBATCHES`` in all:
    past four per rank the steady state adds work, not idle, to every seed alike), costs of
    evenly spread ranks, the limit scaled likewise; the copy's idle (its makespan less the
    busiest rank's work) scaled by (p - 1) / (SCREEN_PP - 1), which is how these schedules'
    ramps grow. Those that do not fit
    the copy's limit, or do not take its sizes, come last, in their own order. Also returns the
    placements of those that fit, by their best estimate, and each built seed's stages per
    rank by its label."""
    pp, m = problem.pp, problem.microbatches
    small_m = max(1, min(round(m * SCREEN_PP / pp), SCREEN_MICROBATCHES))
    small_limit = max(MIN_MEMORY_LIMIT, limit * SCREEN_PP / pp)
    costs = problem.costs
    if len(costs.stages) > 1:
        costs = dataclasses.replace(costs, stages=tuple(
            costs.stages[round(r * (pp - 1) / (SCREEN_PP - 1))] for r in range(SCREEN_PP)))
    copy = _Problem(SCREEN_PP, small_m, costs)
    busy, small_busy = _busiest(problem.costs), _busiest(costs)
    keyed = []
    for n, seed in enumerate(seeds):
        made = _made(seed, copy, allowed, small_limit, rows_only=True)
        estimate, fits = float("inf"), False
        if made is not None:
            place, rows, peak, _ = made
            scored = score(rows, copy.layout(place), small_m, copy.fast(place))
            if scored is not None:
                idle = scored.makespan - small_busy * small_m
                estimate = busy * m + idle * (pp - 1) / (SCREEN_PP - 1)
                fits = peak <= small_limit + EPS
        keyed.append(((not fits, estimate, n), seed, made[0] if made else None))
    keyed.sort(key=lambda item: item[0])
    ranked = [place for key, _, place in keyed if place is not None and not key[0]]
    chunks = {seed.label: place[1] for _, seed, place in keyed if place is not None}
    return [seed for _, seed, _ in keyed], list(dict.fromkeys(ranked)), chunks


def makespan_lower_bound(layout: tuple[int, ...], microbatches: int, costs: Costs) -> float:
    """No schedule on ``layout`` (a looped, V or wave placement) with these float costs ends
    sooner: rank r's first forward waits for microbatch 0's forwards on the stages before it
    (chunk 0 runs down the ranks in every one of these placements) and a send after each, and
    then the rank has all its work to do. The search leaves out a placement whose bound its best
    seed already meets: nothing on it can be shorter."""
    pp = max(layout) + 1
    work = [0.0] * pp
    for stage, rank in enumerate(layout):  # a backward runs as I and W, or as one B
        d = costs.duration[stage]
        work[rank] += (d[F] + min(d[I] + d[W], d[B])) * microbatches
    bound, arrival = 0.0, 0.0
    for rank in range(pp):  # stage r of chunk 0 is on rank r
        bound = max(bound, arrival + work[rank])
        arrival += costs.duration[rank][F] + costs.send
    return bound


def _busiest(costs: StageCosts) -> float:
    """The largest F + I + W of one full stage: a rank's work per microbatch."""
    return max(float(c.f) + float(c.i) + float(c.w) for c in costs.stages)


def _sweep(place: Place, problem: _Problem, limit: float, budget: Budget, pool: Pool) -> None:
    """Coordinate search over the list scheduler's knobs, starting from the safe default."""
    layout, microbatches, costs = problem.layout(place), problem.microbatches, problem.fast(place)
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
                if budget.exhausted() and (best_time < float("inf") or pool.entries):
                    return  # the safe default runs only when nothing else fits (limit < p)
                seen.add(knobs)
                budget.spend(actions)
                pool.tried += 1
                made = list_schedule(layout, microbatches, costs, limit, knobs)
                if made is None:
                    continue
                rows, makespan, peak = made  # the idle is replayed if it ever counts
                pool.add(Candidate(f"greedy:{_label(place)}:{knobs.label()}", place[0], makespan,
                                   peak, 0.0, place[1]), rows,
                         idle_from=(layout, microbatches, costs),
                         recipe=functools.partial(_greedy_recipe, place, knobs))
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


def _backward(place: Place, problem: _Problem, limit: float, budget: Budget, pool: Pool,
              settings: list, built: Built) -> None:
    """Forward-backward candidates: a backward schedule, then a forward one by its priorities
    (``settings``: entries like ``_BACKWARD``'s; ``built`` caches the backward schedules)."""
    layout, microbatches, costs = problem.layout(place), problem.microbatches, problem.fast(place)
    actions = 3 * len(layout) * microbatches
    hop = sum(d[F] for d in costs.duration) / len(layout) + costs.send
    pp = max(layout) + 1
    name = _label(place)
    for knobs, reserve, patience, calm in settings:
        if budget.exhausted():
            return
        if knobs not in built:
            budget.spend(2 * actions)
            pool.tried += 1
            built[knobs] = made = reverse_schedule(layout, microbatches, costs, limit, knobs)
            if made is not None:
                _add_scored(pool, f"backward:{name}:{knobs.label()}", place, made[0], made[1],
                            problem, recipe=functools.partial(_backward_recipe, place, knobs,
                                                              None))
        made = built[knobs]
        if made is None:
            continue
        budget.spend(2 * actions)
        pool.tried += 1
        calm = min(calm, pp - 1)
        waits = [patience * hop] * (pp - calm) + [0.0] * calm
        asap = Asap(layout, microbatches, costs)  # replays the rows as they are built
        forward = priority_schedule(layout, microbatches, costs, limit, made[2], reserve, waits,
                                    asap)
        if forward is not None:
            label = (f"forward-backward:{name}:{knobs.label()},reserve="
                     f"{'all' if reserve is None else reserve},patience={patience:g}"
                     + (f",calm={calm}" if calm and patience else ""))
            scored = asap.score(forward[0])
            pool.add(Candidate(label, place[0], scored.makespan, forward[1], scored.idle_zb,
                               place[1]), forward[0],
                     recipe=functools.partial(_backward_recipe, place, knobs, (reserve, waits)))


def _add_scored(pool: Pool, label: str, place: Place, rows: list[Row], peak: float,
                problem: _Problem, built: Schedule | None = None,
                recipe: Recipe | None = None) -> bool:
    """Add ``rows`` (and ``built``, its schedule if there is one) to the pool with its score;
    False when it deadlocks (nothing added)."""
    scored = score(rows, problem.layout(place), problem.microbatches, problem.fast(place))
    if scored is None:
        return False
    pool.add(Candidate(label, place[0], scored.makespan, peak, scored.idle_zb, place[1]), rows,
             built, recipe=recipe)
    return True
