"""Hanayo's wave with several waves (``chunks = 2W``): a valid order for every size, on the wave
placement, with full backwards, a bubble that shrinks with every wave added and never exceeds
1F1B's, and the peak activation memory the module docstring states.

Makespans are simulated at F = I = W = 1 per full stage (a rank of v chunks spends 1/v of it on
each chunk, ``full_stage_costs``), so different chunk counts compare on the same work.
"""

from fractions import Fraction

import pytest

from loom.schedule import Op, StageCosts, peak_memory, simulate, validate
from loom.schedule.cost import full_stage_costs
from loom.schedule.families import get
from loom.schedule.families.zbv import zbv
from loom.schedule.ir import v_placement


def makespan(schedule):
    return simulate(schedule, full_stage_costs(StageCosts.uniform(1, 1, 1), schedule)).makespan


def wave_peak(p, chunks):
    """The peak once m >= 4p: 1F1B's p units plus floor((p+1)/3) chunk activations."""
    return p + Fraction((p + 1) // 3, chunks)


@pytest.mark.parametrize("chunks", (2, 4, 6))
@pytest.mark.parametrize("p", range(2, 9))
def test_every_size_is_a_valid_wave_order(p, chunks):
    for m in range(1, 4 * p + 1):
        schedule = get("hanayo")(p, m, chunks=chunks)
        validate(schedule)  # complete, on the owning ranks, no deadlock under in-order execution
        assert schedule.placement == v_placement(p, chunks)
        assert {a.op for row in schedule.actions for a in row} == {Op.F, Op.B}
        assert makespan(schedule) >= 3 * m  # the simulator replays it to the end


def test_one_wave_keeps_zbv_order_with_full_backwards():
    for p in (2, 4, 8):
        for m in (1, p, 2 * p + 1):
            expected = [[(a.stage, Op.B if a.op is Op.I else a.op, a.microbatch)
                         for a in row if a.op is not Op.W] for row in zbv(p, m).actions]
            rows = get("hanayo")(p, m, chunks=2).actions
            assert [[(a.stage, a.op, a.microbatch) for a in row] for row in rows] == expected


@pytest.mark.parametrize("p", (4, 8))
def test_more_waves_shrink_the_bubble_and_never_lose_to_1f1b(p):
    for m in (2 * p, 4 * p):
        one_f_one_b = makespan(get("1f1b")(p, m))
        by_waves = [makespan(get("hanayo")(p, m, chunks=2 * w)) for w in (1, 2, 3)]
        assert by_waves == sorted(by_waves, reverse=True) and len(set(by_waves)) == 3, by_waves
        assert by_waves[0] < one_f_one_b


@pytest.mark.parametrize("chunks", (4, 6))
def test_never_slower_than_1f1b_for_any_microbatch_count(chunks):
    for p in (2, 3, 5, 8):
        for m in range(1, 4 * p + 1):
            assert makespan(get("hanayo")(p, m, chunks=chunks)) <= makespan(get("1f1b")(p, m))


@pytest.mark.parametrize("chunks", (4, 6))
@pytest.mark.parametrize("p", range(2, 9))
def test_peak_memory_is_p_plus_the_turns_waiting_chunks(p, chunks):
    peaks = {m: Fraction(max(peak_memory(get("hanayo")(p, m, chunks=chunks)))
                         ).limit_denominator(64) for m in range(1, 4 * p + 1)}
    assert all(peaks[m] == m for m in range(1, p + 1))  # every microbatch in flight at once
    assert peaks[4 * p] == wave_peak(p, chunks)
    assert max(peaks.values()) == wave_peak(p, chunks)


@pytest.mark.parametrize("p", (4, 8))
def test_waves_hold_less_than_interleaving_at_the_same_chunks(p):
    # interleaved 1F1B idles less but holds p + (p-1)/v units; the wave p + floor((p+1)/3)/v
    for chunks in (4, 6):
        wave = get("hanayo")(p, 2 * p, chunks=chunks)
        interleaved = get("interleaved_1f1b")(p, 2 * p, chunks=chunks)
        assert max(peak_memory(wave)) < max(peak_memory(interleaved))
        assert makespan(interleaved) < makespan(wave)
