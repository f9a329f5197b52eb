"""The one replay engine (``loom.schedule.replay``) that the validator, the simulator and the
search share: a case small enough to follow by hand (times and memory), the same case exactly
(Fractions) and in floats, the engine against the dependency rules stated on ``Action`` objects,
a broken schedule, and the search's pick on a fixed case."""

from fractions import Fraction

import pytest

from loom.schedule import Action, Schedule, StageCosts, dependencies, execute, peak_memory
from loom.schedule import simulate
from loom.schedule.cost import full_stage_costs, parse_cost_spec
from loom.schedule.families import get, names, routed
from loom.schedule.ir import csv_text
from loom.schedule.replay import Costs, encode, live_levels, replay, score
from loom.schedule.search import search

# Two ranks, one stage each, two microbatches, the backward split into I and W.
HAND = Schedule(2, 2, (0, 1), [
    [Action.parse(a) for a in "0F0 0F1 0I0 0W0 0I1 0W1".split()],
    [Action.parse(a) for a in "1F0 1I0 1W0 1F1 1I1 1W1".split()],
])
# F = 2, I = 3, W = 1, a send takes 1. Rank 1: 1F0 waits for 0F0 (ends 2) + 1, runs 3-5, then
# 1I0 5-8, 1W0 8-9, 1F1 9-11 (0F1 was there at 5), 1I1 11-14, 1W1 14-15. Rank 0: 0F0 0-2,
# 0F1 2-4, 0I0 waits for 1I0 (ends 8) + 1: 9-12, 0W0 12-13, 0I1 waits for 1I1 + 1: 15-18,
# 0W1 18-19.
HAND_STARTS = [[0, 2, 9, 12, 15, 18], [3, 5, 8, 9, 11, 14]]


def test_a_hand_computed_replay():
    replayed = replay(encode(HAND), HAND.placement, 2, Costs(((2, 3, 1, 4),) * 2, 1))
    assert replayed.completed
    assert replayed.start == HAND_STARTS
    assert replayed.end == [19, 15]
    assert replayed.finish(1) == [5, 8, 9, 11, 14, 15]


def test_a_backward_runs_as_one_B_or_as_I_and_W_per_stage_and_microbatch():
    """Microbatch 0 splits its backward, microbatch 1 runs it whole: 0B1 waits for 1B1, not for
    an I of stage 1 that does not exist (B = 4: rank 1 runs 1B1 11-15, 0B1 waits until 16)."""
    mixed = Schedule(2, 2, (0, 1), [
        [Action.parse(a) for a in "0F0 0F1 0I0 0W0 0B1".split()],
        [Action.parse(a) for a in "1F0 1I0 1W0 1F1 1B1".split()],
    ])
    replayed = replay(encode(mixed), mixed.placement, 2, Costs(((2, 3, 1, 4),) * 2, 1))
    assert replayed.start == [[0, 2, 9, 12, 16], [3, 5, 8, 9, 11]]
    assert replayed.end == [20, 15]


def test_an_action_outside_the_schedule_stops_its_rank_and_leaves_the_others_times():
    """A broken schedule's stray action (stage 5 of 2, microbatch 7 of 2: the validator's grid
    shows it) waits for a stage that never runs; every other action keeps its time."""
    stray = Schedule(2, 2, (0, 1), [list(HAND.actions[0]) + [Action.parse("5F7")],
                                    HAND.actions[1]])
    replayed = replay(encode(stray), stray.placement, 2, Costs(((2, 3, 1, 4),) * 6, 1))
    assert not replayed.completed
    assert replayed.start == HAND_STARTS
    assert replayed.end == [19, 15]


def test_the_search_score_of_the_hand_case():
    # the longest span is rank 0's, 0 to 19, with 12 units of work: 7 idle
    found = score(encode(HAND), HAND.placement, 2, Costs(((2.0, 3.0, 1.0, 4.0),) * 2, 1.0))
    assert (found.makespan, found.idle_zb) == (19.0, 7.0)


def test_memory_of_the_hand_case_by_order_and_over_time():
    # by order: rank 0 holds both microbatches from 0F1 until 0W0 ends
    assert live_levels(encode(HAND)[0], [1, 1]) == [1, 2, 2, 2, 1, 1]
    assert peak_memory(HAND) == (2.0, 1.0)
    result = simulate(HAND, StageCosts.uniform(2, 3, 1, latency=1))
    assert result.memory[0] == ((0, 1), (2, 2), (13, 1), (19, 0))
    # rank 1 frees 1W0's memory and takes 1F1's at 9: one point, the level after both
    assert result.memory[1] == ((0, 0), (3, 1), (9, 1), (15, 0))
    assert (result.makespan, result.bubble_time_zb) == (19, 7)


def test_fraction_costs_replay_exactly_and_float_costs_as_floats():
    half = simulate(HAND, StageCosts.uniform(1, Fraction(3, 2), Fraction(1, 2),
                                             latency=Fraction(1, 2)))
    for row, starts in zip(half.timeline, HAND_STARTS):
        assert [slot.start for slot in row] == [Fraction(t, 2) for t in starts]
    assert half.makespan == Fraction(19, 2)
    assert half.bubble_zb == Fraction(7, 19)  # exact: the ratio of two exact times
    floats = simulate(HAND, StageCosts.uniform(1.0, 1.5, 0.5, latency=0.5))
    assert floats.makespan == 9.5 and isinstance(floats.makespan, float)


CASES = [(name, p) for name in names() + routed() for p in (2, 3, 4)
         if name not in routed() or p % 2 == 0]  # two copies: an even p


@pytest.mark.parametrize("name, p", CASES)
def test_every_action_starts_as_soon_as_its_rank_and_its_dependencies_allow(name, p):
    """The engine's rules are ``validate.dependencies``: each start is the latest of the rank's
    previous finish and each dependency's finish (plus the send time from another rank)."""
    schedule = get(name)(p, 2 * p)
    costs = full_stage_costs(StageCosts.uniform(2, 3, 1, latency=Fraction(1, 3)), schedule)
    result = simulate(schedule, costs)
    for rank, row in enumerate(result.timeline):
        free = 0
        for slot in row:
            ready = [result.slot(dep).finish + (0 if schedule.rank_of(dep.stage) == rank
                                                else Fraction(1, 3))
                     for dep in dependencies(schedule, slot.action)]
            assert slot.start == max([free, *ready]), slot.action
            free = slot.finish


def test_a_rank_stops_at_an_action_whose_dependency_never_runs():
    broken = Schedule(2, 2, (0, 1), [HAND.actions[0], HAND.actions[1][:1] + HAND.actions[1][2:]])
    replayed = replay(encode(broken), broken.placement, 2, Costs(((1, 1, 1, 2),) * 2, 0))
    assert not replayed.completed
    # rank 1 runs 1F0, then 1W0 waits for the missing 1I0; rank 0 stops at 0I0, whose input
    # gradient (1I0, or 1B0 without it) never comes
    assert execute(broken).pending == (HAND.actions[0][2:], HAND.actions[1][2:])


def test_the_search_picks_this_schedule():
    """Pinned: p=4, m=8, limit 4, F=I=1, W=0.5, latency 0.05 (Benchmark A's row 'zbv + local
    swaps'). A change to the engine, the ranking or the candidates shows up here."""
    found = search(4, 8, parse_cost_spec("1,1,0.5,0.05"), 4)
    assert (found.best.label, found.candidates_tried) == ("zbv+local", 122)
    assert (found.sim_result.makespan, found.sim_result.bubble_time_zb) == (
        Fraction(111, 5), Fraction(11, 5))
    assert csv_text(found.schedule).splitlines()[0] == ",".join(
        "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0 "
        "7F4 7I4 7W4 0I1 0W1 7F5 7I5 7W5 0I2 0W2 7F6 7I6 7W6 0I3 0W3 7F7 7I7 7W7 0I4 0W4 0I5 0W5 "
        "0I6 0W6 0I7 0W7".split())
    assert csv_text(found.schedule).splitlines()[3] == ",".join(
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4 3I0 3W0 4F4 4I1 4W1 3F5 3I1 3W1 4F5 4I2 4W2 "
        "3F6 3I2 3W2 4F6 4I3 4W3 3F7 3I3 3W3 4F7 4I4 4W4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 3W4 4W5 4W6 "
        "4W7 3W5 3W6 3W7".split())
