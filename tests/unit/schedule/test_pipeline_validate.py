"""The validator: each rule it enforces, the error grid, dependencies, execution and memory."""

import pytest

from loom.schedule import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    dependencies,
    execute,
    looped_placement,
    peak_memory,
    validate,
)
from loom.schedule.families import get


def _schedule(rows, num_stages=2, microbatches=2, placement=None):
    return Schedule(
        num_stages=num_stages,
        num_microbatches=microbatches,
        placement=placement or looped_placement(len(rows), num_stages // len(rows)),
        actions=tuple(tuple(Action.parse(t) for t in row.split()) for row in rows),
        name="handmade",
    )


GOOD = ["0F0 0F1 0I0 0W0 0B1", "1F0 1I0 1F1 1B1 1W0"]


def test_a_correct_handmade_schedule_passes():
    validate(_schedule(GOOD))


def _rejects(schedule, rule, marked, reason_words, **kwargs):
    with pytest.raises(ScheduleError) as caught:
        validate(schedule, **kwargs)
    error = caught.value
    assert error.rule == rule
    for word in reason_words:
        assert word in error.reason
    assert f"[{marked}]" in error.grid, error.grid
    assert "rank 0" in error.grid and "rank 1" in error.grid and "step" in error.grid
    return error


def test_rejects_a_missing_w():
    rows = ["0F0 0F1 0I0 0W0 0B1", "1F0 1I0 1F1 1B1"]
    _rejects(_schedule(rows), "missing", "1I0", ["stage 1 microbatch 0", "1W0"])


def test_rejects_a_duplicated_f():
    rows = ["0F0 0F1 0F1 0I0 0W0 0B1", GOOD[1]]
    _rejects(_schedule(rows), "duplicate", "0F1", ["0F1", "more than once"])


def test_rejects_an_action_on_the_wrong_rank():
    rows = ["0F0 0F1 0I0 0W0 0B1 1F1", "1F0 1I0 1B1 1W0"]
    _rejects(_schedule(rows), "placement", "1F1", ["rank 0", "placed on rank 1"])


def test_rejects_w_before_its_i_on_the_same_rank():
    rows = ["0F0 0F1 0W0 0I0 0B1", GOOD[1]]
    _rejects(_schedule(rows), "order", "0W0", ["before its dependency 0I0"])


def test_rejects_a_deadlock_where_two_ranks_wait_for_each_other():
    # Rank 0 waits at 0B0 for rank 1's 1B0; rank 1 waits at 1F1 for rank 0's 0F1. Each rank's own
    # order is fine, only together do they hang.
    rows = ["0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"]
    error = _rejects(_schedule(rows), "deadlock", "0B0", ["no rank can progress", "0B0 waits for 1B0"])
    assert "[1F1]" in error.grid and "1F1 waits for 0F1" in error.reason


def test_rejects_mixing_full_and_split_backward_for_one_microbatch():
    rows = ["0F0 0F1 0I0 0W0 0B0 0B1", GOOD[1]]
    _rejects(_schedule(rows), "mixed", "0B0", ["both B and I/W"])


def test_rejects_unknown_stage_or_microbatch():
    rows = ["0F0 0F1 0F2 0I0 0W0 0B1", GOOD[1]]
    _rejects(_schedule(rows), "range", "0F2", ["microbatch 2 does not exist"])


def test_rejects_exceeding_the_memory_limit():
    schedule = get("gpipe")(2, 3)
    error = _rejects(schedule, "memory", "0F2", ["rank 0 holds 3", "limit of 2"], memory_limit=2)
    validate(schedule, memory_limit=3)
    assert error.actions == (Action(0, Op.F, 2),)


def test_dependencies_follow_the_rules():
    schedule = get("zb_h1")(3, 2)
    assert dependencies(schedule, Action(1, Op.F, 0)) == (Action(0, Op.F, 0),)
    assert dependencies(schedule, Action(0, Op.F, 0)) == ()
    assert dependencies(schedule, Action(1, Op.I, 1)) == (Action(1, Op.F, 1), Action(2, Op.I, 1))
    assert dependencies(schedule, Action(2, Op.I, 1)) == (Action(2, Op.F, 1),)
    assert dependencies(schedule, Action(1, Op.W, 1)) == (Action(1, Op.I, 1),)
    plain = get("1f1b")(3, 2)
    assert dependencies(plain, Action(0, Op.B, 0)) == (Action(0, Op.F, 0), Action(1, Op.B, 0))


def test_execution_is_asap_and_in_order():
    execution = execute(get("1f1b")(2, 2))
    assert execution.completed
    assert [str(a) if a else "." for a in execution.timeline[0]] == ["0F0", "0F1", ".", "0B0", ".", "0B1"]
    assert [str(a) if a else "." for a in execution.timeline[1]] == [".", "1F0", "1B0", "1F1", "1B1"]
    assert execution.makespan == 6


def test_memory_counts_until_the_last_backward_piece_and_weighs_chunks():
    # One microbatch through a 2-rank V: every stage weighs half a unit.
    v = get("zbv")(2, 1)
    assert peak_memory(v) == (1.0, 1.0)
    # W, not I, ends a microbatch's lifetime.
    rows = ["0F0 0F1 0I0 0I1 0W0 0W1", "1F0 1I0 1F1 1I1 1W0 1W1"]
    assert peak_memory(_schedule(rows)) == (2.0, 2.0)
