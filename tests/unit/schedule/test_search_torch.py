"""The schedule search against every schedule torch 2.13's ``torch.distributed.pipelining`` ships.

torch's schedule classes compute ``pipeline_order`` in their constructors and read only a few
attributes of the stages, so fake stages give their orders without processes (as in
``tests/unit/pipeline/test_pipeline_torch_interop.py``). Every class is tried with 1..8 stages per
rank (torch refuses what it does not take); each order that fits the memory limit is simulated
by Loom's simulator under the same full-stage costs (a chunk of v gets 1/v of them), and the
search must never be slower. torch's ``Schedule1F1B`` order names a microbatch that does not
exist on its last rank (its runtime runs its own loop, not that order); it is repaired the way
the interop test does, which makes it exactly Loom's ``1f1b``.

The grid runs the search with ``effort=1``: the seeds (torch's orders among them) are priced up
to ``SCREEN_PP`` ranks whatever the effort, so the guarantee does not depend on it, and the grid
stays fast. Strictly better cells come from the seeds on the wave placements and, with the
default effort, from the improvement steps.
"""

import pytest
import torch
from torch.distributed.pipelining import schedules as ts

from loom.pipeline.torch_orders import TORCH_CLASSES, pipeline_order, torch_schedule
from loom.schedule import Schedule, StageCosts, validate
from loom.schedule.families.zero_bubble import interleaved_zb, zb_h1
from loom.schedule.replay import Costs, encode, peak_units
from loom.schedule.search import (
    MAX_CHUNKS,
    SCREEN_PP,
    SearchError,
    makespan_lower_bound,
    placement_costs,
    search,
)
from loom.schedule.select import schedule_for
from loom.schedule.simulate import simulate

torch.set_num_threads(1)

PROFILES = {  # full-stage F, I, W and the send latency
    "F=1 I=1 W=0.5 lat=0.05": StageCosts.uniform(1, 1, 0.5, 0.05),
    "F=1 I=2 W=1 lat=0.1": StageCosts.uniform(1, 2, 1, 0.1),
}
GRID = [(p, m) for p in (4, 8) for m in (p, 2 * p, 4 * p)]


@pytest.fixture(scope="module")
def torch_orders() -> dict[tuple[int, int], list[Schedule]]:
    """Every order torch gives for each grid size."""
    orders = {}
    for p, m in GRID:
        made = [torch_schedule(cls, v, p, m)
                for cls in TORCH_CLASSES for v in range(1, MAX_CHUNKS + 1)]
        orders[p, m] = [schedule for schedule in made if schedule is not None]
    return orders


def test_every_torch_class_gives_orders_on_the_grid(torch_orders):
    names = {s.name.split("(")[0] for orders in torch_orders.values() for s in orders}
    assert names == {f"torch:{cls.__name__.removeprefix('Schedule')}" for cls in TORCH_CLASSES}
    chunks = {s.chunks_per_rank for orders in torch_orders.values() for s in orders}
    assert chunks == set(range(1, MAX_CHUNKS + 1))


@pytest.mark.parametrize("profile", PROFILES)
def test_search_is_never_worse_than_any_torch_schedule_that_fits(torch_orders, profile):
    costs = PROFILES[profile]
    better = 0
    for p, m in GRID:
        theirs = []
        for schedule in torch_orders[p, m]:
            scaled = placement_costs(costs, schedule.placement)
            makespan = simulate(schedule, scaled).makespan
            # no order beats the search's lower bound on its placement (it prunes with it)
            bound = makespan_lower_bound(schedule.placement, m, Costs.of(scaled, schedule))
            assert float(makespan) >= bound - 1e-9, schedule.name
            theirs.append((max(peak_units(encode(schedule), schedule.placement)), makespan,
                           schedule.name))
        for limit in (p, 2 * p):
            found = search(p, m, costs, limit, effort=1)
            ours = found.sim_result.makespan
            assert max(found.sim_result.peak_memory) <= limit
            fitting = [(makespan, name) for peak, makespan, name in theirs if peak <= limit]
            assert fitting, (p, m, limit)  # ZB-H1 and ZB-V fit p units
            best, name = min(fitting)
            assert ours <= best, (profile, p, m, limit, name, float(ours), float(best))
            better += ours < best
    assert better >= len(GRID)  # strictly better in at least half of the 2 x 6 cells


def test_search_is_strictly_better_where_the_gap_allows(torch_orders):
    # p=8, m=32, limit 2p, F=1 I=2 W=1 latency 0.1: torch's best is its interleaved zero bubble
    # with 4 chunks per rank, 136.7; the search reaches 130.45, the bound of 4 chunks per rank,
    # (F+I+W) m + (p-1)(F/4 + latency), which that order misses by 6.25.
    costs = PROFILES["F=1 I=2 W=1 lat=0.1"]
    theirs = min(simulate(s, placement_costs(costs, s.placement)).makespan
                 for s in torch_orders[8, 32]
                 if max(peak_units(encode(s), s.placement)) <= 16)
    found = search(8, 32, costs, 16)
    assert float(theirs) == pytest.approx(136.7)
    assert float(found.sim_result.makespan) == pytest.approx(4 * 32 + 7 * (1 / 4 + 0.1))
    assert found.schedule.chunks_per_rank == 4


@pytest.mark.parametrize("p", (2, 3, 4, 8))
@pytest.mark.parametrize("chunks", (1, 2, 3, 5, 8))
def test_interleaved_zb_is_torchs_interleaved_zero_bubble(p, chunks):
    for m in sorted({1, p - 1 or 1, p, p + 1, 2 * p, 3 * p + 1, 4 * p}):
        theirs = torch_schedule(ts.ScheduleInterleavedZeroBubble, chunks, p, m)
        ours = interleaved_zb(p, m, chunks)
        validate(ours)  # also where torch refuses m (not a multiple of its rounds)
        if theirs is not None:
            assert (ours.placement, ours.actions) == (theirs.placement, theirs.actions), m
        else:  # torch refused the sizes: never an order that does not validate
            with pytest.raises(Exception):  # noqa: B017  (torch's assorted errors)
                pipeline_order(ts.ScheduleInterleavedZeroBubble, chunks, p, m)
        if chunks == 1:
            assert ours.actions == zb_h1(p, m).actions


def test_max_chunks_bounds_the_stages_per_rank():
    costs = StageCosts.uniform(1, 1, 1)
    assert search(4, 16, costs, 4).schedule.chunks_per_rank == MAX_CHUNKS  # 1/v of the ramp
    assert search(4, 16, costs, 4, max_chunks=3).schedule.chunks_per_rank <= 3
    assert search(4, 16, costs, 4, max_chunks=1).schedule.chunks_per_rank == 1
    with pytest.raises(SearchError, match="max_chunks=1"):
        search(4, 16, costs, 4, "v", max_chunks=1)  # the V needs two stages per rank
    # the trainer's search: the model's layers over pp bound the chunks
    assert schedule_for("search", 4, 16, memory_limit=4, max_stages=12).chunks_per_rank <= 3
    assert schedule_for("search", 4, 16, memory_limit=4, max_stages=6).chunks_per_rank == 1


def test_screened_search_prices_the_best_torch_order_above_the_screen():
    # p = 2 x SCREEN_PP: the seeds are ranked on a copy with SCREEN_PP ranks and only the best
    # are priced; torch's best here is its interleaved zero bubble with 8 chunks per rank
    # (equal costs, no latency: the ramp shrinks with v and nothing else grows).
    p, m = 2 * SCREEN_PP, 2 * 2 * SCREEN_PP
    costs = StageCosts.uniform(1, 1, 1)
    theirs = torch_schedule(ts.ScheduleInterleavedZeroBubble, 8, p, m)
    best = simulate(theirs, placement_costs(costs, theirs.placement)).makespan
    found = search(p, m, costs, p, effort=1)
    assert found.sim_result.makespan <= best
