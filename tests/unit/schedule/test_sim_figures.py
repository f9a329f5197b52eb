"""``simulate`` hands back ``busy`` and ``peak_memory`` computed from its scaled ints (issue 22
item 2: the search's summary line added up one Fraction per action). They must be exactly the
figures the timeline and the memory curves give, of the same number types. ``headline`` gives
those figures without the timeline at all, for the search's winner: the same again."""

import dataclasses
from fractions import Fraction

import pytest

from loom.schedule.cost import OpCosts, StageCosts, parse_cost_spec
from loom.schedule.families import get
from loom.schedule.families.zero_bubble import interleaved_zb
from loom.schedule.search import placement_costs, search
from loom.schedule.simulate import Figures, headline, simulate
from loom.schedule.validate import ScheduleError
from loom.schedule.vocab_passes import vocab_1f1b

SCHEDULES = [get("1f1b")(4, 9), get("zbv")(4, 8), interleaved_zb(4, 12, chunks=3)]


@pytest.mark.parametrize("spec", ["1,1,1", "1,1,0.5,0.05", "1,2,1,0.1", "1.5,2,1,0.3"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.name)
def test_the_handed_back_figures_are_the_timeline_and_curve_figures(schedule, spec):
    result = simulate(schedule, placement_costs(parse_cost_spec(spec), schedule.placement))
    fresh = dataclasses.replace(result)  # the same fields, nothing cached yet
    assert "busy" not in fresh.__dict__ and "peak_memory" not in fresh.__dict__
    for mine, theirs in ((result.busy, fresh.busy), (result.peak_memory, fresh.peak_memory)):
        assert mine == theirs
        assert [type(x) for x in mine] == [type(x) for x in theirs]
    assert result.summary() == fresh.summary()


def test_a_chunk_cost_in_fractions_gives_fraction_figures():
    schedule = interleaved_zb(4, 12, chunks=3)  # F / 3 of a full stage: not whole
    result = simulate(schedule, placement_costs(parse_cost_spec("1,1,1"), schedule.placement))
    assert all(isinstance(b, Fraction) for b in result.busy)
    assert all(b == 12 * 3 for b in result.busy)  # F + I + W of 12 microbatches, 3 chunks of 1/3


# ``headline``: the same figures without the timeline (what the schedule search reports its
# winner with). Every kind of cost and schedule the simulator takes, compared number by number
# and type by type with ``simulate(...).figures``.
HEADLINE_COSTS = {
    "ints": StageCosts.uniform(1, 2, 1),
    "decimals": parse_cost_spec("1,2,1,0.1"),
    "floats": StageCosts.uniform(1.1, 2.3, 0.7, latency=0.05),
    "fractions": StageCosts.uniform(Fraction(1, 3), Fraction(2, 3), Fraction(1, 3),
                                    latency=Fraction(1, 7)),
    "held weights": dataclasses.replace(StageCosts.uniform(1, 1, 1), weight_grad_fraction=0.25),
    "per stage": StageCosts((OpCosts(1, 1, 1), OpCosts(1.2, 1, 0.9), OpCosts(1, 2, 1),
                             OpCosts(0.7, 1, 1)), latency=0.1),
}
HEADLINE_SCHEDULES = [get("1f1b")(4, 9), get("zbv")(4, 8), get("gpipe")(4, 5),
                      interleaved_zb(4, 12, chunks=3), get("bidirectional_v")(4, 8),
                      vocab_1f1b(4, 6)]


def _figures_and_types(figures: Figures) -> tuple:
    numbers = (figures.makespan, *figures.busy, *figures.span, *figures.peak_memory,
               figures.bubble_zb, figures.bubble_makespan)
    return numbers, [type(x) for x in numbers]


@pytest.mark.parametrize("costs", HEADLINE_COSTS.values(), ids=HEADLINE_COSTS.keys())
@pytest.mark.parametrize("schedule", HEADLINE_SCHEDULES, ids=lambda s: s.name)
def test_the_headline_is_the_simulation_s_figures_number_for_number(schedule, costs):
    if len(costs.stages) > 1 and len(costs.stages) != schedule.num_stages:
        costs = dataclasses.replace(costs, stages=tuple(
            costs.stages[rank] for rank in schedule.placement))  # each stage its rank's costs
    vocab = (Fraction(1, 2), Fraction(3, 4))
    figures = headline(schedule, costs, vocab_costs=vocab)
    simulated = simulate(schedule, costs, vocab_costs=vocab)
    assert _figures_and_types(figures) == _figures_and_types(simulated.figures)
    assert figures == simulated.figures
    assert figures.summary() == {key: value for key, value in simulated.summary().items()
                                 if key in figures.summary()}


def test_the_headline_refuses_what_simulate_refuses():
    schedule = get("1f1b")(2, 2)
    rows = [list(row) for row in schedule.actions]
    rows[0].reverse()  # rank 0 waits for a backward before its forward: a deadlock
    stuck = dataclasses.replace(schedule, actions=tuple(tuple(row) for row in rows))
    with pytest.raises(ScheduleError) as simulated:
        simulate(stuck)
    with pytest.raises(ScheduleError) as headlined:
        headline(stuck)
    assert str(headlined.value) == str(simulated.value)
    with pytest.raises(ValueError, match="costs give 2 stages, the schedule has 4"):
        headline(get("1f1b")(4, 4), StageCosts((OpCosts(1, 1, 1),) * 2))


def test_the_search_reports_its_winner_by_the_headline_and_simulates_it_when_asked():
    found = search(8, 32, parse_cost_spec("1,2,1,0.1"), 8)
    assert "sim_result" not in found.__dict__  # not simulated yet
    assert found.summary()["makespan"] == float(found.figures.makespan)
    summary = found.summary()
    assert found.sim_result.figures == found.figures
    assert found.sim_result.timeline  # the full simulation, timeline and all
    simulated = found.sim_result.summary()  # what the report held when it was simulated first
    assert {key: summary[key] for key in simulated} == simulated
    assert found.summary() == summary  # the same report before and after it was simulated


def test_a_simulation_without_memory_curves_still_has_its_bubbles():
    schedule = get("1f1b")(4, 8)
    timed_only = simulate(schedule, memory=False)
    full = simulate(schedule)
    assert timed_only.bubble_zb == full.bubble_zb == 3 / 11  # 1F1B: (p-1)/(m+p-1)
    assert timed_only.bubble_makespan == full.bubble_makespan
