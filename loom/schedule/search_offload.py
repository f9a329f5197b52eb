"""Step f of the schedule search (``loom.schedule.search``): PipeOffload inside the search.

Only with ``search(..., offload=True)`` (PipeOffload, ``loom.schedule.offload``), after the
search's steps a-e, which it leaves as they are: the family seeds (all of them up to the search's
``SCREEN_PP`` ranks; above, the ``OFFLOAD_SCREENED`` best of the screen run with no limit) whose
peak is over the limit are replayed without it, and the ``OFFLOAD_CANDIDATES`` fastest whose
makespan beats a-e's winner get ``insert_offload(seed, limit)``'s transfers and are priced with
``simulate_offload`` (compute plus copy streams on ``costs.host_bandwidth`` /
``host_unit_bytes``; unpriced, the copies take no time), fastest first, stopping at the first
that cannot beat the best priced one. One wins only with a makespan shorter than a-e's winner
by more than float noise: a tie keeps the schedule without transfers. Only seeds, not the inner
sweeps' candidates: those are built under the limit (they never go over it), and pricing
transfers costs a full simulation each. Offloading never shortens a schedule (the compute order
stays, the copies only add waits), so a seed no faster than a-e's winner without its transfers
is not priced at all, and a slow host link costs a few simulations, not a different answer.

It communicates through its arguments only: the search hands it its winner, the seeds to weigh,
a function that builds a seed on the problem and the problem's per-placement layouts and costs,
and gets back the winner to keep (a ``SearchResult``, ``loom.schedule.search_types``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from loom.schedule.cost import OpCosts, StageCosts
from loom.schedule.ir import Schedule
from loom.schedule.offload import insert_offload, offload_peak, simulate_offload
from loom.schedule.replay import EPS, Costs, Row, score
from loom.schedule.search_types import Candidate, Place, SearchResult

OFFLOAD_CANDIDATES = 4  # the fastest seeds over the limit whose offloaded versions are
# simulated with their transfers (each a full ``simulate_offload``)

Seed = TypeVar("Seed")  # the search's seed: only its ``label`` is read here
Made = tuple[Place, list[Row], float, Schedule | None]  # place, rows, peak units, schedule


class Placements(Protocol):
    """What step f reads of the search's problem: per placement, the layout and the costs."""

    microbatches: int

    def layout(self, place: Place) -> tuple[int, ...]: ...

    def scaled(self, place: Place) -> StageCosts: ...

    def fast(self, place: Place) -> Costs: ...


def with_offload(found: SearchResult, seeds: Sequence[Seed],
                 made: Callable[[Seed], Made | None], problem: Placements,
                 late: Callable[[], bool]) -> SearchResult:
    """Step f (``search(..., offload=True)``, see the module docstring): ``found``, steps a-e's
    winner, or the fastest of the few fastest ``seeds`` over its limit once ``insert_offload``
    has made them fit and ``simulate_offload`` has priced their transfers, when that is shorter.

    ``made(seed)`` builds a seed on ``problem`` at ``found``'s limit (None where it does not take
    these sizes or placements); ``late()`` says the search's time budget has run out."""
    limit = found.memory_limit
    bar = float(found.figures.makespan)
    bar -= EPS * max(1.0, bar)  # a tie keeps the schedule without transfers
    tried = 0
    over: list[tuple[float, int, str, Place, Schedule]] = []
    for n, seed in enumerate(seeds):
        if late():
            break
        built = made(seed)
        if built is None:
            continue
        place, rows, peak, schedule = built
        tried += 1
        if peak <= limit + EPS or schedule is None:
            continue  # it fits as it is: steps a-e weighed it
        # offloading keeps the compute order and only adds waits: no faster than this replay
        scored = score(rows, problem.layout(place), problem.microbatches, problem.fast(place))
        if scored is not None and scored.makespan < bar:
            over.append((scored.makespan, n, seed.label, place, schedule))
    best: tuple[tuple, Candidate, Schedule, Place] | None = None
    priced: list[Candidate] = []
    # priced in floats, as steps a-e rank (exact fractions cost 5x at p = 16 with 8 chunks);
    # the winner is simulated again with the exact costs, as ``search`` simulates its winner
    floats = {place: float_costs(problem.scaled(place)) for *_, place, _ in over}
    for replayed, n, label, place, schedule in sorted(over, key=lambda item: item[:2])[
            :OFFLOAD_CANDIDATES]:
        if best is not None and replayed >= best[0][0]:
            break  # its transfers can only lengthen it: no shorter than the best priced one
        try:
            offloaded = insert_offload(schedule, limit)
        except ValueError:  # some action needs more than the limit with all else offloaded
            continue
        name = f"search[{label}+offload]"
        offloaded = dataclasses.replace(offloaded, name=name)
        sim = simulate_offload(offloaded, floats[place])
        peak = float(max(offload_peak(offloaded)))
        if peak > limit + EPS:
            raise AssertionError(f"{name}: device peak {peak:g} over the limit {limit:g} (a bug "
                                 "in insert_offload)")
        makespan = float(sim.result.makespan)
        candidate = Candidate(f"{label}+offload", place[0], makespan, peak,
                              float(sim.result.bubble_time_zb), place[1])
        priced.append(candidate)
        key = (makespan, sum(map(len, sim.transfers)), n)
        if makespan < bar and (best is None or key < best[0]):
            best = (key, candidate, offloaded, place)
    tried += len(priced)
    if best is None:
        return dataclasses.replace(found, candidates_tried=found.candidates_tried + tried)
    board = list(found.leaderboard)
    for candidate in sorted(priced, key=lambda c: c.makespan):
        # before the first entry of steps a-e that it beats by more than float noise
        at = next((k for k, c in enumerate(board) if candidate.makespan < c.makespan
                   - EPS * max(1.0, c.makespan)), len(board))
        board.insert(at, candidate)
    _, candidate, schedule, place = best
    result = simulate_offload(schedule, problem.scaled(place)).result
    return SearchResult(schedule=schedule, figures=result.figures, costs=problem.scaled(place),
                        memory_limit=limit, candidates_tried=found.candidates_tried + tried,
                        best=candidate, leaderboard=tuple(board[:5]), simulated=result)


def float_costs(costs: StageCosts) -> StageCosts:
    """``costs`` with float durations (the host link's fields as they are)."""
    return dataclasses.replace(costs, stages=tuple(
        OpCosts(*(None if x is None else float(x) for x in (c.f, c.i, c.w, c.b)))
        for c in costs.stages))
