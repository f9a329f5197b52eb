"""Every schedule family: valid for its microbatch counts, with the memory and bubble it promises.

Bubbles are measured with Loom's ASAP in-order execution at T_F = T_I = T_W = 1 and T_B = 2 (a
full backward is an input plus a weight gradient); the formulas are Table 2 of Qi et al. 2024.
"""

import math
from fractions import Fraction

import pytest

from loom.schedule import Op, StageCosts, execute, peak_memory, simulate, validate
from loom.schedule.cost import full_stage_costs
from loom.schedule.families import get, names
from loom.schedule.families.controllable_memory import v_half_budget, v_min_budget
from loom.schedule.replay import Costs, encode
from loom.schedule.search_greedy import Knobs, list_schedule

PP_SIZES = (2, 4, 8, 16)
UNIT = {Op.F: 1, Op.I: 1, Op.W: 1, Op.B: 2}

# Smallest valid microbatch count per family, as a function of p (see each docstring).
MIN_MICROBATCHES = {"interleaved_1f1b": lambda p: p, "dualpipev": lambda p: 2 * p}
SPLIT_BACKWARD = {"zb_h1", "zb_h2", "zbv", "v_half", "v_min"}


def microbatch_counts(name, p):
    low = MIN_MICROBATCHES.get(name, lambda p: 1)(p)
    return sorted({m for m in (1, p - 1, p, p + 1, 2 * p, 2 * p + 1, 4 * p) if m >= low})


CASES = [(name, p, m) for name in names() for p in PP_SIZES for m in microbatch_counts(name, p)]


@pytest.mark.parametrize("name, p, m", CASES, ids=[f"{n}-p{p}-m{m}" for n, p, m in CASES])
def test_family_passes_the_validator(name, p, m):
    schedule = get(name)(p, m)
    validate(schedule)
    assert schedule.pp_size == p and schedule.num_microbatches == m
    ops = {action.op for row in schedule.actions for action in row}
    if name in SPLIT_BACKWARD:
        assert Op.I in ops and Op.W in ops
    elif name != "dualpipev":  # DualPipeV mixes full and split backwards by design
        assert ops == {Op.F, Op.B}


def test_below_the_valid_range_the_error_names_the_nearest_valid_count():
    with pytest.raises(ValueError, match="nearest valid: 4"):
        get("interleaved_1f1b")(4, 3)


@pytest.mark.parametrize("p", PP_SIZES)
def test_peak_memory_of_the_single_chunk_families(p):
    m = 4 * p
    assert peak_memory(get("gpipe")(p, m)) == (m,) * p
    assert peak_memory(get("1f1b")(p, m))[0] == p
    assert peak_memory(get("zb_h1")(p, m)) == (p,) * p
    assert peak_memory(get("zb_h2")(p, m)) == (2 * p - 1,) * p


@pytest.mark.parametrize("p", PP_SIZES)
def test_peak_memory_of_the_v_shaped_zero_bubble_matches_1f1b(p):
    assert max(peak_memory(get("zbv")(p, 4 * p))) == p


@pytest.mark.parametrize("p", PP_SIZES)
def test_controllable_memory_schedules_stay_within_their_budgets(p):
    # Qi et al. 2024b: V-Half about 1/2 and V-Min about 1/3 of 1F1B's p units (+1 working unit)
    assert max(peak_memory(get("v_half")(p, 4 * p))) <= v_half_budget(p) == p // 2 + 1
    assert max(peak_memory(get("v_min")(p, 4 * p))) <= v_min_budget(p) == math.ceil(p / 3) + 1


@pytest.mark.parametrize("p", PP_SIZES)
def test_controllable_memory_orders_are_the_search_greedy_policy_at_unit_costs(p):
    # families._greedy with one route chooses what search_greedy does at its default knobs
    unit = Costs(((1.0,) * 4,) * 2 * p, 0.0)
    for name, budget in (("v_half", v_half_budget(p)), ("v_min", v_min_budget(p))):
        for m in microbatch_counts(name, p):
            schedule = get(name)(p, m)
            rows = list_schedule(schedule.placement, m, unit, budget, Knobs())[0]
            assert rows == encode(schedule), (name, p, m)


@pytest.mark.parametrize("p", (4, 8))
def test_v_half_halves_the_1f1b_bubble(p):
    # In chunk-sized steps 1F1B idles 2 * 3(p-1); V-Half about half of that (paper: B/2).
    assert _worst_bubble(get("v_half")(p, 4 * p)) <= 2 * 3 * (p - 1) * 0.6


def test_dualpipev_mixes_full_and_split_backwards():
    ops = {a.op for row in get("dualpipev")(4, 8).actions for a in row}
    assert ops == {Op.F, Op.B, Op.I, Op.W}


@pytest.mark.parametrize("p", (2, 4, 8))
def test_interleaved_peak_memory_matches_korthikanti(p):
    # Korthikanti et al. 2022 §4.2.3: 1F1B's p units times (1 + (p-1)/(p*v)) on rank 0.
    v = 2
    assert peak_memory(get("interleaved_1f1b")(p, 4 * p, chunks=v))[0] == p * (1 + (p - 1) / (p * v))


def _worst_bubble(schedule):
    execution = execute(schedule, UNIT)
    return max(execution.idle_in_window(rank) for rank in range(schedule.pp_size))


@pytest.mark.parametrize("p", (2, 4, 8))
def test_bubbles_match_the_zero_bubble_paper(p):
    m = 3 * p
    assert _worst_bubble(get("1f1b")(p, m)) == (p - 1) * 3  # (p-1)(T_F + T_B + T_W)
    assert _worst_bubble(get("zb_h1")(p, m)) == (p - 1) * 1  # (p-1)(T_F + T_B - T_W)
    assert _worst_bubble(get("zb_h2")(p, m)) == 0  # (p-1)(T_F + T_B - 2 T_W)
    assert _worst_bubble(get("zbv")(p, m)) == 0


@pytest.mark.parametrize("p", (2, 4, 8))
def test_interleaving_divides_the_1f1b_bubble_by_the_chunk_count(p):
    # In chunk-sized time units interleaved 1F1B idles (p-1)(T_F+T_B) per rank: 1/v of 1F1B.
    assert _worst_bubble(get("interleaved_1f1b")(p, 2 * p, chunks=2)) == (p - 1) * 3


# -- Hanayo's wave ---------------------------------------------------------------------------------


@pytest.mark.parametrize("p", (2, 4, 8))
def test_hanayo_is_one_wave_down_and_up_with_1f1b_memory(p):
    for m in (p, 2 * p, 4 * p):
        schedule = get("hanayo")(p, m)
        validate(schedule)
        assert schedule.placement == tuple(range(p)) + tuple(range(p - 1, -1, -1))
        assert max(peak_memory(schedule)) == p  # 2p chunks of half a unit, as 1F1B's p


def test_hanayo_runs_each_rank_in_the_waves_1f1b_order():
    """Rank r: 2(p-r)-1 forwards of the down chunk first, then full backwards (no I/W split)."""
    for p in (2, 4, 8):
        schedule = get("hanayo")(p, 4 * p)
        assert not any(a.op in (Op.I, Op.W) for row in schedule.actions for a in row)
        for rank, row in enumerate(schedule.actions):
            warmup = 2 * (p - rank) - 1
            assert [(a.stage, a.op) for a in row[:warmup]] == [(rank, Op.F)] * warmup, rank
            assert sum(a.op is Op.B for a in row) == sum(a.op is Op.F for a in row) == 2 * 4 * p


@pytest.mark.parametrize("p", (4, 8))
def test_hanayo_bubble_lies_between_interleaved_and_1f1b(p):
    # F = I = W = 1 per full stage (a chunk of two takes half): the wave's ramp hops are half
    # stages, so it idles 2/3 of 1F1B's time; interleaving (v=2) idles 1/2 of it but holds
    # (p-1)/2 more units
    for m in (2 * p, 4 * p):
        makespan = {}
        for name in ("1f1b", "interleaved_1f1b", "hanayo"):
            schedule = get(name)(p, m)
            costs = full_stage_costs(StageCosts.uniform(1, 1, 1), schedule)
            makespan[name] = simulate(schedule, costs).makespan
        work = 3 * m
        assert makespan["hanayo"] - work == Fraction(2, 3) * (makespan["1f1b"] - work)
        assert makespan["interleaved_1f1b"] < makespan["hanayo"] < makespan["1f1b"]


def test_hanayo_refuses_sweep_counts_that_are_not_whole_waves():
    for chunks in (1, 3, 5):
        with pytest.raises(ValueError, match=f"chunks={chunks} must be even"):
            get("hanayo")(4, 8, chunks=chunks)
