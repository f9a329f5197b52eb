"""PipeOffload in the IR (issue 22 item 5): offload/reload actions, their validator rules, the
policy that places them under a device limit, and the simulator's pricing of the transfers."""

from __future__ import annotations

from fractions import Fraction

import pytest

from loom.schedule import families
from loom.schedule.cost import StageCosts
from loom.schedule.ir import Action, Op, Schedule
from loom.schedule.offload import (best_with_offload, count_transfers, insert_offload,
                                   offload_levels, offload_peak, simulate_offload)
from loom.schedule.simulate import simulate
from loom.schedule.validate import ScheduleError, memory_profile, peak_memory, validate


def _with_row(schedule: Schedule, rank: int, tokens: str) -> Schedule:
    rows = list(schedule.actions)
    rows[rank] = tuple(Action.parse(t) for t in tokens.split())
    return Schedule(schedule.num_stages, schedule.num_microbatches, schedule.placement,
                    tuple(rows), name="edited")


def test_tokens_round_trip_and_torch_csv_refuses_them():
    assert str(Action(2, Op.O, 3)) == "2O3" and Action.parse("1R0") == Action(1, Op.R, 0)
    assert Op.O.is_transfer and Op.R.is_transfer and not Op.F.is_transfer
    offloaded = insert_offload(families.get("1f1b")(4, 8), 2)
    assert offloaded.has_transfers
    assert Schedule.from_json(offloaded.to_json()) == offloaded
    assert offloaded.compute_only().actions == families.get("1f1b")(4, 8).actions
    with pytest.raises(ValueError, match="no offload/reload"):
        offloaded.to_torch_csv("/dev/null")


def test_validator_rules():
    base = families.get("1f1b")(2, 4)  # rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    good = _with_row(base, 0, "0F0 0O0 0F1 0R0 0B0 0F2 0B1 0F3 0B2 0B3")
    validate(good, memory_limit=2)
    # 0O0's copy overlaps 0F1, which still counts it; it is off the device until 0R0
    assert offload_levels(good, 0) == (1, 1, 2, 2, 2, 2, 2, 2, 2, 1)
    assert offload_levels(_with_row(base, 0, "0F0 0O0 0F1 0F2 0R0 0B0 0B1 0F3 0B2 0B3"), 0)[
        :5] == (1, 1, 2, 2, 3)
    cases = {
        "reload after backward": "0F0 0O0 0F1 0B0 0R0 0F2 0B1 0F3 0B2 0B3",
        "offload before forward": "0O0 0F0 0F1 0R0 0B0 0F2 0B1 0F3 0B2 0B3",
        "no reload": "0F0 0O0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
        "reload without offload": "0F0 0F1 0R0 0B0 0F2 0B1 0F3 0B2 0B3",
        "reload before offload": "0F0 0R0 0O0 0F1 0B0 0F2 0B1 0F3 0B2 0B3",
    }
    for what, tokens in cases.items():
        with pytest.raises(ScheduleError) as error:
            validate(_with_row(base, 0, tokens))
        assert error.value.rule == "offload", what
    with pytest.raises(ScheduleError) as error:  # a transfer on a rank that does not own it
        validate(_with_row(base, 1, " ".join(map(str, base.actions[1])) + " 0O3"))
    assert error.value.rule == "placement"
    # memory counts the offloads: 1F1B at p = 4 holds 4 on rank 0, 2 with the policy's offloads
    deep = insert_offload(families.get("1f1b")(4, 8), 2)
    validate(deep, memory_limit=2)
    with pytest.raises(ScheduleError) as error:
        validate(deep.compute_only(), memory_limit=2)
    assert error.value.rule == "memory"


@pytest.mark.parametrize("family,p,m,limit", [
    ("1f1b", 4, 16, 2), ("1f1b", 8, 32, 3), ("gpipe", 4, 8, 2), ("interleaved_1f1b", 4, 8, 2),
    ("zbv", 4, 8, 3.5), ("dualpipev", 4, 8, 2), ("hanayo", 4, 8, 2),
])
def test_policy_meets_the_limit_and_keeps_the_compute_order(family, p, m, limit):
    schedule = families.get(family)(p, m)
    offloaded = insert_offload(schedule, limit)
    validate(offloaded, memory_limit=limit)
    assert max(offload_peak(offloaded)) <= limit < max(peak_memory(schedule))
    assert offloaded.compute_only().actions == schedule.actions
    counts = count_transfers(offloaded)
    for rank in range(p):
        assert counts[rank, Op.O] == counts[rank, Op.R]
    # ranks already within the limit move nothing
    for rank in range(p):
        if max(memory_profile(schedule, rank)) <= limit:
            assert counts[rank, Op.O] == 0
    # in time too, on a fast and a slow host link: the simulated device peak stays in the limit
    for bandwidth in (8, Fraction(1, 3)):
        sim = simulate_offload(offloaded, StageCosts.uniform(1, 2, 1, host_bandwidth=bandwidth,
                                                             host_unit_bytes=1))
        assert max(sim.result.peak_memory) <= limit


def test_policy_offloads_the_longest_held_that_can_go_in_time():
    # 1F1B rank 0 at p = 4, limit 3: 0F3 needs room; an O frees after the compute action that
    # follows it, so only 0F0 and 0F1 can go in time, and 1's backward is the further away
    offloaded = insert_offload(families.get("1f1b")(4, 8), 3)
    row = [str(a) for a in offloaded.actions[0]]
    assert row[:6] == ["0F0", "0F1", "0O1", "0F2", "0F3", "0O3"]
    assert offload_levels(offloaded, 0)[:6] == (1, 2, 2, 3, 3, 3)
    assert insert_offload(families.get("1f1b")(4, 8), 4) == families.get("1f1b")(4, 8)
    with pytest.raises(ValueError, match="over the limit"):
        insert_offload(families.get("zb_h1")(4, 8), 2)  # I..W pieces cannot be offloaded


def test_levels_without_transfers_are_the_validators():
    schedule = families.get("zbv")(4, 8)
    for rank in range(4):
        assert offload_levels(schedule, rank) == memory_profile(schedule, rank)


def test_simulator_prices_transfers():
    schedule = families.get("1f1b")(4, 16)
    offloaded = insert_offload(schedule, 2)
    plain = simulate(schedule)
    # unpriced transfers: the same times, the memory of the limit
    free = simulate_offload(offloaded)
    assert free.result.makespan == plain.makespan
    assert [s.start for s in free.result.timeline[0]] == [s.start for s in plain.timeline[0]]
    assert max(free.result.peak_memory) == 2 and max(plain.peak_memory) == 4
    # simulate() has no host link: it refuses schedules with transfers and names the one to use
    with pytest.raises(ValueError, match="simulate_offload"):
        simulate(offloaded)
    # a slow link: the backwards wait for their reloads, and the makespan grows by those waits
    slow = simulate_offload(offloaded, StageCosts.uniform(1, 1, 1, host_bandwidth=1,
                                                          host_unit_bytes=4))
    assert slow.result.makespan > plain.makespan and max(slow.copy_wait) > 0
    for row in slow.transfers:
        for slot in row:
            assert slot.duration == 4
    # a transfer in flight still holds device memory: the time peak is above the order peak
    fast = simulate_offload(offloaded, StageCosts.uniform(1, 1, 1, host_bandwidth=4,
                                                          host_unit_bytes=1))
    assert fast.result.makespan == plain.makespan  # the copies hide in the schedule
    assert fast.transfers[0][0].duration == Fraction(1, 4)
    # the device never holds more than the limit, in time too: a slow link costs time instead
    for sim in (free, slow, fast):
        assert max(sim.result.peak_memory) == 2


def test_copy_waits_for_its_offload_on_the_copy_streams():
    offloaded = insert_offload(families.get("1f1b")(4, 8), 2)
    sim = simulate_offload(offloaded, StageCosts.uniform(1, 1, 1, host_bandwidth=1,
                                                         host_unit_bytes=3))
    times = {s.action: s for row in sim.transfers for s in row}
    compute = {s.action: s for row in sim.result.timeline for s in row}
    for action, slot in times.items():
        if action.op is Op.R:
            assert slot.start >= times[Action(action.stage, Op.O, action.microbatch)].finish
            assert compute[Action(action.stage, Op.B, action.microbatch)].start >= slot.finish
        else:
            assert slot.start >= compute[Action(action.stage, Op.F, action.microbatch)].finish


def test_the_host_link_enters_the_choice_of_schedule():
    def link(ratio):
        return StageCosts.uniform(1, 1, 1, host_bandwidth=1, host_unit_bytes=ratio)

    fast, fast_sim = best_with_offload(4, 16, link(Fraction(1, 4)), 3)
    validate(fast, memory_limit=3)
    assert fast.has_transfers and max(fast_sim.result.peak_memory) <= 3
    # better than every family that fits the limit without offload (V-Half and V-Min), at the
    # same memory
    fitting = [name for name in families.names()
               if max(peak_memory(families.get(name)(4, 16))) <= 3]
    assert fitting == ["v_half", "v_min"]
    for name in fitting:
        schedule = families.get(name)(4, 16)
        v = schedule.chunks_per_rank
        plain = simulate(schedule, StageCosts.uniform(Fraction(1, v), Fraction(1, v),
                                                      Fraction(1, v)))
        assert fast_sim.result.makespan < plain.makespan, name
    # and no worse than 1F1B offloaded to the same limit (one of the candidates)
    one_f_one_b = simulate_offload(insert_offload(families.get("1f1b")(4, 16), 3), link(0.25))
    assert fast_sim.result.makespan <= one_f_one_b.result.makespan
    # a slow link makes every offloaded candidate slower, and the choice no faster
    _, slow_sim = best_with_offload(4, 16, link(4), 3)
    assert slow_sim.result.makespan > fast_sim.result.makespan
    with pytest.raises(ValueError, match="no family fits"):
        best_with_offload(4, 16, link(1), 2, names=["zb_h1"])
