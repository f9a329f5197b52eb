"""``loom.schedule.search``: valid schedules within the limit, never worse than the families,
zero bubble where theory allows it, clear errors, and the ``loom schedule search`` command."""

import pytest

from loom.schedule import Schedule, validate
from loom.pipeline.cli import main
from loom.schedule.families import get, names
from loom.schedule.families.controllable_memory import v_min_budget
from loom.schedule.search import SearchError, placement_costs, search
from loom.schedule.replay import Costs, encode, peak_units, score
from loom.schedule.cost import StageCosts
from loom.schedule.simulate import simulate

EQUAL = StageCosts.uniform(1, 1, 1)
UNEQUAL = StageCosts.uniform(1, 1, 0.5, latency=0.05)

# (p, m, limit): V-Min level, p, 2p and m, for p in {2,3,4,8,16,32}; big sizes kept few
GRID = [
    (2, 2, v_min_budget(2)), (2, 16, 2), (2, 5, 4),
    (3, 3, v_min_budget(3)), (3, 7, 3), (3, 24, 6), (3, 9, 9),
    (4, 4, v_min_budget(4)), (4, 8, 4), (4, 13, 8), (4, 32, 32),
    (8, 8, v_min_budget(8)), (8, 24, 8), (8, 16, 16), (8, 64, 64),
    (16, 16, v_min_budget(16)), (16, 48, 32),
    (32, 32, v_min_budget(32)), (32, 64, 64),
]


@pytest.mark.parametrize("p, m, limit", GRID, ids=[f"p{p}-m{m}-L{L}" for p, m, L in GRID])
def test_search_returns_a_valid_schedule_within_the_limit(p, m, limit):
    costs = UNEQUAL if (p + m) % 2 else EQUAL
    result = search(p, m, costs, limit, effort=60_000 if p < 16 else 20_000)
    validate(result.schedule, memory_limit=limit)
    assert max(result.sim_result.peak_memory) <= limit
    assert result.schedule.num_microbatches == m and result.schedule.pp_size == p
    # the reported simulation is the reference simulator's, with the placement's costs
    assert result.sim_result.makespan == simulate(result.schedule, result.costs).makespan
    assert float(result.sim_result.makespan) == pytest.approx(result.best.makespan)


@pytest.mark.parametrize("placement", ["looped", "interleaved", "v"])
def test_search_keeps_to_the_requested_placement(placement):
    result = search(4, 8, UNEQUAL, 4, placement)
    assert result.best.placement == placement
    chunks = 1 if placement == "looped" else 2
    assert result.schedule.chunks_per_rank == chunks


@pytest.mark.parametrize("placement", ["looped", "interleaved", "v"])
def test_a_pinned_placement_below_every_family_s_memory_still_gets_a_schedule(placement):
    """With the looped placement pinned and a limit under p, no family's order fits (1F1B needs
    p): the list scheduler's safe setting must still be tried (it once was not: the lower-bound
    filter compared against an infinite best and closed every placement)."""
    for limit in (1, 2, 3):
        result = search(4, 16, UNEQUAL, limit, placement)
        validate(result.schedule, memory_limit=limit)
        assert result.best.placement == placement


@pytest.mark.parametrize("costs", [EQUAL, UNEQUAL], ids=["equal", "unequal"])
@pytest.mark.parametrize("p, m", [(2, 4), (3, 6), (4, 8), (4, 12)])
def test_search_is_never_worse_than_a_registered_family_that_fits(costs, p, m):
    for limit in (p, 2 * p):
        found = search(p, m, costs, limit)
        for family in names():
            try:
                schedule = get(family)(p, m)
            except ValueError:
                continue
            if max(peak_units(encode(schedule), schedule.placement)) > limit:
                continue
            theirs = simulate(schedule, placement_costs(costs, schedule.placement)).makespan
            assert found.sim_result.makespan <= theirs + 1e-9, (family, p, m, limit)


def test_zero_bubble_on_the_v_placement_with_equal_costs():
    # ZB-V theory: T_F = T_I = T_W on the V placement has no bubble at p units (so also at 2p)
    for p, m in ((4, 12), (8, 24)):
        result = search(p, m, EQUAL, 2 * p)
        zbv = get("zbv")(p, m)
        assert result.sim_result.bubble_zb == 0
        assert result.sim_result.makespan <= simulate(zbv, placement_costs(EQUAL, zbv.placement)).makespan


def test_a_limit_below_one_microbatch_is_a_clear_error():
    with pytest.raises(SearchError, match=r"memory_limit=0.5 is below the minimum of 1 unit"):
        search(4, 8, EQUAL, 0.5)


def test_a_limit_of_one_unit_still_works_and_chunk_costs_are_shares():
    result = search(4, 6, EQUAL, 1)
    validate(result.schedule, memory_limit=1)
    costs = placement_costs(StageCosts.uniform(1, 2, 1), (0, 1, 1, 0))
    assert [(c.f, c.i, c.w) for c in costs.stages][0] == (0.5, 1, 0.5)


@pytest.mark.parametrize("huge", [1e308, float("inf")])
def test_a_limit_no_schedule_reaches_is_no_limit(huge):
    """A rank never holds more than m units (every microbatch of all its stages), so an infinite
    limit, or one whose chunk count overflows a float, searches what a limit of 10 m does."""
    unbounded, bounded = search(4, 8, UNEQUAL, huge), search(4, 8, UNEQUAL, 80)
    assert unbounded.schedule == bounded.schedule
    assert unbounded.sim_result.makespan == bounded.sim_result.makespan


def test_search_is_deterministic():
    a = search(4, 9, UNEQUAL, 6)
    b = search(4, 9, UNEQUAL, 6)
    assert a.schedule == b.schedule and a.candidates_tried == b.candidates_tried


def test_fast_replay_agrees_with_the_simulator():
    for family in names():
        schedule = get(family)(4, 9)
        costs = placement_costs(UNEQUAL, schedule.placement)
        fast = score(encode(schedule), schedule.placement, 9, Costs.of(costs, schedule))
        assert fast.makespan == pytest.approx(float(simulate(schedule, costs).makespan)), family


def test_cli_search_writes_a_torch_csv_that_loads_and_validates(tmp_path, capsys):
    path = tmp_path / "s.csv"
    code = main(["schedule", "search", "--pp", "4", "--microbatches", "8", "--costs",
                 "1,1,0.5,0.02", "--memory-limit", "4", "-o", str(path), "--format", "torch-csv"])
    out, _ = capsys.readouterr()
    assert code == 0 and "makespan" in out
    schedule = Schedule.from_torch_csv(path, num_microbatches=8)
    validate(schedule, memory_limit=4)


def test_cli_search_reports_an_infeasible_limit_in_one_line(capsys):
    code = main(["schedule", "search", "--pp", "4", "--memory-limit", "0.5"])
    _, err = capsys.readouterr()
    assert code == 2 and "--memory-limit" in err and "minimum of 1" in err
    assert len(err.strip().splitlines()) == 1
