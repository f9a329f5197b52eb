"""``simulate`` hands back ``busy`` and ``peak_memory`` computed from its scaled ints (issue 22
item 2: the search's summary line added up one Fraction per action). They must be exactly the
figures the timeline and the memory curves give, of the same number types."""

import dataclasses
from fractions import Fraction

import pytest

from loom.schedule.cost import parse_cost_spec
from loom.schedule.families import get
from loom.schedule.families.zero_bubble import interleaved_zb
from loom.schedule.search import placement_costs
from loom.schedule.simulate import simulate

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
