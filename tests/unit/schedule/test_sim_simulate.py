"""The simulator's contract: in-order replay, send costs, memory curves, errors and plain data."""

import json
from fractions import Fraction

import pytest

from loom.schedule import Action, Op, Schedule, ScheduleError, execute, peak_memory
from loom.schedule.families import get, names
from loom.schedule import SimResult, StageCosts, parse_cost_spec, simulate

FAMILY_CASES = [(name, p) for name in names() for p in (2, 4)]


@pytest.mark.parametrize("name, p", FAMILY_CASES)
def test_with_unit_costs_it_agrees_with_the_validators_step_execution(name, p):
    schedule = get(name)(p, 4 * p)
    result = simulate(schedule, StageCosts.uniform(1, 1, 1, b=1))
    steps = execute(schedule)  # one step per action, no latency
    for row in schedule.actions:
        for action in row:
            assert result.slot(action).start == steps.start[action]
    assert result.makespan == steps.makespan


@pytest.mark.parametrize("name, p", FAMILY_CASES)
def test_memory_curves_agree_with_the_validator_and_return_to_zero(name, p):
    schedule = get(name)(p, 4 * p)
    result = simulate(schedule)
    assert tuple(float(x) for x in result.peak_memory) == peak_memory(schedule)
    for points in result.memory:
        assert points[0][0] == 0 and points[-1][1] == 0
        times = [t for t, _ in points]
        assert times == sorted(set(times))


@pytest.mark.parametrize("name", ["1f1b", "zb_h2", "zbv", "dualpipev"])
def test_the_memory_curve_is_the_sum_of_live_microbatches(name):
    # At any time, a rank holds the weight (1/v) of each (stage, microbatch) whose F has started
    # and whose last backward piece (B, or W) has not finished.
    p = 4
    result = simulate(get(name)(p, 2 * p), StageCosts.uniform(2, 3, 1, latency=Fraction(1, 2)))
    for rank, row in enumerate(result.timeline):
        weight = Fraction(1, len(set(a.stage for a in (s.action for s in row))))
        begin = {(s.action.stage, s.action.microbatch): s.start for s in row if s.action.op is Op.F}
        end = {(s.action.stage, s.action.microbatch): s.finish for s in row
               if s.action.op in (Op.B, Op.W)}
        for time in sorted({t for s in row for t in (s.start, s.finish)}):
            live = sum(weight for key in begin if begin[key] <= time < end[key])
            assert result.memory_at(rank, time) == live


def test_memory_at_reads_the_step_function():
    # GPipe, p = m = 2, T_F = 1, T_B = 2. Rank 0: F0 [0,1), F1 [1,2); rank 1 backs up B0 [3,5)
    # and B1 [5,7); rank 0 then runs B0 [5,7) and B1 [7,9).
    result = simulate(get("gpipe")(2, 2))
    assert [result.memory_at(0, t) for t in (0, 0.5, 1, 2, 6.9, 7, 9)] == [1, 1, 2, 2, 2, 1, 0]


def test_sends_cost_nothing_on_the_same_rank():
    # ZB-V turns around on rank p-1 (stages p-1 and p) and ends on rank 0: no send there.
    p, latency = 2, 10
    result = simulate(get("zbv")(p, 1), StageCosts.uniform(1, 1, 1, latency=latency))
    turn = result.slot(Action(p, Op.F, 0)).start - result.slot(Action(p - 1, Op.F, 0)).finish
    hop = result.slot(Action(1, Op.F, 0)).start - result.slot(Action(0, Op.F, 0)).finish
    assert (turn, hop) == (0, latency)


def test_per_stage_costs_make_the_slowest_stage_the_bottleneck():
    # A stage twice as slow in F sets the pace: its rank is the busiest and bounds the makespan.
    p, m = 4, 16
    base = simulate(get("1f1b")(p, m), StageCosts.per_stage([1] * 4, [1] * 4, [1] * 4))
    slow = simulate(get("1f1b")(p, m), StageCosts.per_stage([1, 1, 2, 1], [1] * 4, [1] * 4))
    assert slow.busy[2] == base.busy[2] + m == max(slow.busy)
    assert slow.makespan >= m * (2 + 2) > base.makespan
    assert slow.bubble_time_makespan == slow.makespan - slow.busy[2]


def test_b_defaults_to_i_plus_w_and_can_be_given():
    assert StageCosts.uniform(1, 2, 3).duration(Action(0, Op.B, 0)) == 5
    assert StageCosts.uniform(1, 2, 3, b=4).duration(Action(0, Op.B, 0)) == 4


def test_a_deadlock_raises_the_validators_error_with_the_grid():
    # Two ranks each start with a backward that needs the other's work first.
    swapped = Schedule(
        num_stages=2, num_microbatches=1, placement=(0, 1), name="broken",
        actions=((Action(0, Op.B, 0), Action(0, Op.F, 0)), (Action(1, Op.B, 0), Action(1, Op.F, 0))),
    )
    with pytest.raises(ScheduleError) as err:
        simulate(swapped)
    assert err.value.rule == "deadlock"
    assert "rank 0" in err.value.grid and "[0B0]" in err.value.grid


def test_costs_must_cover_every_stage():
    with pytest.raises(ValueError, match="costs give 3 stages, the schedule has 4"):
        simulate(get("1f1b")(4, 4), StageCosts.per_stage([1] * 3, [1] * 3, [1] * 3))


def test_result_round_trips_through_json():
    costs = StageCosts.uniform(1.5, 1.25, 0.75, latency=0.1, weight_grad_fraction=0.5)
    result = simulate(get("zbv")(4, 8), costs)
    again = SimResult.from_json(result.to_json())
    assert again.to_dict() == result.to_dict()
    data = json.loads(result.to_json())
    assert data["makespan"] == pytest.approx(float(result.makespan), rel=1e-12)
    assert {"bubble_zb", "bubble_makespan", "peak_memory", "busy", "timeline"} <= set(data)
    assert data["timeline"][0][0][0] == "0F0"


def test_cost_files_in_json_and_csv(tmp_path):
    csv_file = tmp_path / "costs.csv"
    csv_file.write_text("stage,F,I,W\n0,1,1,1\n1,2,0.5,0.5\n")
    from_csv = StageCosts.from_file(csv_file, latency="0.1")
    assert from_csv.op_costs(1).i == Fraction(1, 2) and from_csv.latency == Fraction(1, 10)
    json_file = tmp_path / "costs.json"
    json_file.write_text(json.dumps(from_csv.to_dict()))
    from_json = StageCosts.from_file(json_file)
    assert [c.of(Op.B) for c in from_json.stages] == [2, 1]
    assert simulate(get("1f1b")(2, 4), from_json).makespan == pytest.approx(
        float(simulate(get("1f1b")(2, 4), from_csv).makespan))


def test_the_cli_cost_spec():
    costs = parse_cost_spec("2,1.5,0.5,0.25")
    assert (costs.stages[0].f, costs.stages[0].i, costs.latency) == (2, Fraction(3, 2), Fraction(1, 4))
    with pytest.raises(ValueError, match="F,I,W"):
        parse_cost_spec("1,2")
