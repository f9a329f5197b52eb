"""Periodic extension (``loom.schedule.periodic``) and the search above ``REDUCE_FROM``.

A schedule's steady state repeats: growing a family's order for few microbatches by copies of
its period gives exactly the order the family builds for more, and whatever ``extend`` returns
is a complete, valid schedule whose peak memory is the small one's. Above ``REDUCE_FROM``
actions the search explores a copy with fewer microbatches and grows or rebuilds its best
orders: it must still return a valid full-size schedule within the limit, and never one slower
than a family seed that fits."""

import functools

import pytest

from loom.schedule import StageCosts, validate
from loom.schedule.families import get
from loom.schedule.families.zero_bubble import interleaved_zb
from loom.schedule.ir import Schedule
from loom.schedule.periodic import extend, in_order
from loom.schedule.replay import decode, encode, peak_units
from loom.schedule.search import (REDUCE_FROM, placement_costs, reduced_microbatches, search)
from loom.schedule.simulate import simulate

PERIODIC = {  # families whose order for m microbatches is the order for fewer, grown
    "1f1b": get("1f1b"),
    "zb_h1": get("zb_h1"),
    "zb_h2": get("zb_h2"),
    "zbv": get("zbv"),
    "interleaved_1f1b(v=2)": functools.partial(get("interleaved_1f1b"), chunks=2),
    "interleaved_zb(v=2)": functools.partial(interleaved_zb, chunks=2),
    "interleaved_zb(v=4)": functools.partial(interleaved_zb, chunks=4),
}


def _grown(small: Schedule, m: int) -> Schedule | None:
    rows = extend(encode(small), small.num_microbatches, m)
    if rows is None:
        return None
    like = Schedule(small.num_stages, m, small.placement, [[]] * small.pp_size)
    return decode(rows, like, small.name + "+grown")


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("family", list(PERIODIC))
def test_growing_a_family_order_gives_the_family_order_for_more_microbatches(family, p):
    make = PERIODIC[family]
    small, large = make(p, 3 * p), make(p, 8 * p)
    grown = _grown(small, 8 * p)
    assert grown is not None
    assert grown.actions == large.actions


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "zbv", "interleaved_zb(v=4)"])
def test_a_grown_schedule_is_valid_and_keeps_the_small_peak(family):
    make = PERIODIC.get(family) or get(family)
    small = make(4, 12)
    grown = _grown(small, 4 * 12 + 4)
    assert grown is not None  # GPipe too: a window of one F and one B at its turn
    validate(grown, memory_limit=max(peak_units(encode(small), small.placement)))
    assert peak_units(encode(grown), grown.placement) == peak_units(encode(small),
                                                                    small.placement)
    assert grown.num_microbatches == 52


def test_extend_refuses_rows_out_of_order_and_sizes_it_cannot_reach():
    rows = encode(get("1f1b")(4, 8))
    assert in_order(rows, 8)
    assert extend(rows, 8, 8) == rows
    assert extend(rows, 8, 7) is None  # it only grows
    swapped = [list(row) for row in rows]
    first_f = [n for n, (s, o, k) in enumerate(swapped[0]) if o == 0][:2]
    a, b = first_f
    swapped[0][a], swapped[0][b] = swapped[0][b], swapped[0][a]  # F(0,1) before F(0,0)
    assert not in_order(swapped, 8)
    assert extend(swapped, 8, 16) is None


def test_the_copy_is_smaller_only_above_the_threshold():
    assert reduced_microbatches(16, 64, 8) == 64  # 24,576 actions: explored as it is
    assert 3 * 16 * 64 * 8 <= REDUCE_FROM
    assert reduced_microbatches(16, 128, 8) == 48  # 3p, and 128 - 48 a multiple of p
    assert reduced_microbatches(32, 256, 8) == 96
    assert reduced_microbatches(32, 100, 8) == 100  # fewer than 4p: nothing to gain
    assert reduced_microbatches(64, 256, 8) == 256  # a copy of 192: more than half
    assert reduced_microbatches(64, 512, 1) == 192


SEEDS = [get(name) for name in ("1f1b", "zb_h1", "zb_h2", "zbv", "interleaved_1f1b")] + [
    functools.partial(interleaved_zb, chunks=v) for v in (2, 4)]


@pytest.mark.parametrize("costs, limit", [
    (StageCosts.uniform(1, 1, 0.5, 0.05), 16),
    (StageCosts.uniform(1, 2, 1, 0.1), 32),
])
def test_the_search_above_the_threshold_is_valid_and_never_worse_than_a_fitting_seed(costs,
                                                                                      limit):
    p, m = 16, 128
    assert reduced_microbatches(p, m, 8) < m
    found = search(p, m, costs, limit, effort=100_000)  # a fifth of the default: a short test
    schedule = found.schedule
    assert schedule.num_microbatches == m and schedule.pp_size == p
    validate(schedule, memory_limit=limit)
    assert max(found.sim_result.peak_memory) <= limit
    assert found.sim_result.makespan == simulate(schedule, found.costs).makespan
    for make in SEEDS:
        seed = make(p, m)
        if max(peak_units(encode(seed), seed.placement)) <= limit:
            theirs = simulate(seed, placement_costs(costs, seed.placement)).makespan
            assert found.sim_result.makespan <= theirs, seed.name
