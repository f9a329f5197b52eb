"""BitPipe's own order (``loom.schedule.families.bitpipe``): the paper's schedule figures action
for action, valid and deadlock-free over a grid of sizes within 1F1B's memory, the bubble of one
basic unit, the sizes it refuses by name, and its export (the runtime's parity with one process
is in tests/dist/test_pipeline_bidirectional.py)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from loom.config import ConfigError, load_config, resolve
from loom.pipeline.cli import main
from loom.schedule.cost import StageCosts
from loom.schedule.families import get, names, routed, trainable
from loom.schedule.families.bidirectional import bidirectional_placement
from loom.schedule.ir import Op, Schedule, csv_text
from loom.schedule.simulate import simulate
from loom.schedule.validate import peak_memory, validate
from tests.unit.pipeline.test_pipeline_routes import eager_windows

# The paper's figures (p = 4; the authors' repository draws them), transcribed per rank: one
# unit of 4 microbatches (0, 1 down, 2, 3 up), then two units concatenated. Stages 0..7 are the
# down copy (rank 0 holds 0 and 7), 8..15 the up copy (rank 0 holds 11 and 12).
FIGURE_M4 = [
    "0F0 0F1 11F2 12F2 11F3 12F3 7F0 7B0 7F1 7B1 12B2 11B2 12B3 11B3 0B0 0B1",
    "1F0 10F2 1F1 10F3 13F2 6F0 13F3 6F1 6B0 13B2 6B1 13B3 10B2 1B0 10B3 1B1",
    "9F2 2F0 9F3 2F1 5F0 14F2 5F1 14F3 14B2 5B0 14B3 5B1 2B0 9B2 2B1 9B3",
    "8F2 8F3 3F0 4F0 3F1 4F1 15F2 15B2 15F3 15B3 4B0 3B0 4B1 3B1 8B2 8B3",
]
# Ranks 0 and 3 of the m = 8 figure from the first backward of unit 1's last leg on: the next
# unit's first two forwards come before the last backward of the unit before.
FIGURE_M8_RANK0_TAIL = "0B0 0F4 0F5 0B1 11F6 12F6 11F7 12F7 7F4 7B4 7F5 7B5"
FIGURE_M8_RANK3_TAIL = "8B2 8F6 8F7 8B3 3F4 4F4 3F5 4F5 15F6 15B6 15F7 15B7"

GRID = [(p, k * p) for p in (2, 4, 6, 8) for k in (1, 2, 3, 4)]


def tokens(row) -> str:
    return " ".join(map(str, row))


def test_it_is_registered_as_a_trainable_family_with_two_copies():
    assert "bitpipe" in routed() and "bitpipe" in trainable() and "bitpipe" not in names()
    assert get("BitPipe") is get("bitpipe")


def test_one_unit_is_the_papers_figure_on_every_rank():
    schedule = get("bitpipe")(4, 4)
    assert [tokens(row) for row in schedule.actions] == FIGURE_M4
    assert schedule.routes == (0, 0, 1, 1)  # the unit's first half down, second half up


def test_two_units_concatenate_as_in_the_papers_figure():
    one, two = get("bitpipe")(4, 4), get("bitpipe")(4, 8)
    for rank, tail in ((0, FIGURE_M8_RANK0_TAIL), (3, FIGURE_M8_RANK3_TAIL)):
        assert tail in tokens(two.actions[rank]), rank
    for rank in range(4):  # unit 0's forwards and backwards keep their order
        first = [a for a in two.actions[rank] if a.microbatch < 4]
        assert first == list(one.actions[rank]), rank
    assert two.routes == (0, 0, 1, 1, 0, 0, 1, 1)
    # and the figure's timing at F = 1, B = 2 per stage: 28 slots for one unit, 53 for two
    costs = StageCosts.uniform(1, 1, 1)
    assert (simulate(one, costs).makespan, simulate(two, costs).makespan) == (28, 53)


@pytest.mark.parametrize("p, m", GRID, ids=[f"p{p}-m{m}" for p, m in GRID])
def test_valid_deadlock_free_and_within_1f1b_memory(p, m):
    schedule = get("bitpipe")(p, m)
    validate(schedule)  # dependencies, routes, completeness, in-order replay without deadlock
    assert schedule.placement == bidirectional_placement(p) and schedule.num_routes == 2
    assert [schedule.route_of(mb) for mb in range(m)] == [(mb % p) // (p // 2)
                                                          for mb in range(m)]
    assert {a.op for row in schedule.actions for a in row} == {Op.F, Op.B}  # full backwards
    result = simulate(schedule, StageCosts.uniform(1, 1, 1))  # replays every rank in order
    assert len(set(result.busy)) == 1  # every rank the same work
    # peak: the W + 1 forwards before the first backward, half a unit each; p in the middle
    expected = [Fraction(3 * p // 2 + min(r, p - 1 - r) + 1, 2) for r in range(p)]
    assert list(peak_memory(schedule)) == expected
    assert max(expected) == p


@pytest.mark.parametrize("p", [2, 4, 6, 8, 10])
def test_one_unit_idles_p_minus_2_over_4p_minus_2(p):
    """At F = 1, B = 2 per stage: (p-2)/(3m+p-2) at m = p, the fill and drain of one unit."""
    result = simulate(get("bitpipe")(p, p), StageCosts.uniform(1, 1, 1))
    # every rank: 2p forwards and 2p backwards (6p slots) and 2(p-2) idle ones
    assert result.makespan == 6 * p + 2 * (p - 2) and set(result.busy) == {6 * p}
    assert result.bubble_time_zb == result.bubble_time_makespan == 2 * (p - 2)
    assert result.bubble_zb == pytest.approx((p - 2) / (4 * p - 2), abs=1e-12)


def test_concatenated_units_stay_below_1f1b():
    costs = StageCosts.uniform(1, 1, 1)
    for p, m in GRID:
        bubble = simulate(get("bitpipe")(p, m), costs).bubble_zb
        assert bubble < simulate(get("1f1b")(p, m), costs).bubble_zb or p == 2, (p, m)
        assert bubble <= (p - 2) / (4 * p - 2) + 1e-12, (p, m)  # more units never idle more


@pytest.mark.parametrize("p, m, words", [
    (3, 6, "even"), (1, 2, "even"), (0, 4, "even"),
    (4, 6, "multiple of pp_size=4"), (4, 2, "multiple of pp_size=4"), (2, 0, "nearest valid: 2"),
])
def test_sizes_outside_the_paper_are_refused_with_the_rule(p, m, words):
    with pytest.raises(ValueError, match=words):
        get("bitpipe")(p, m)


def test_the_config_names_the_rule_for_a_microbatch_count_it_cannot_take():
    table = {"parallel.pp": "2", "parallel.schedule": "bitpipe", "model.preset": "debug",
             "train.global_batch_size": "4", "train.micro_batch_size": "1"}
    assert resolve(load_config(None, table), 2).parallel.schedule == "bitpipe"
    with pytest.raises(ConfigError) as info:
        resolve(load_config(None, {**table, "train.global_batch_size": "3"}), 2)
    assert info.value.field_name == "parallel.schedule"
    assert "multiple of pp_size=2" in str(info.value)


def test_the_command_line_exports_csv_with_routes_and_json_that_read_back(capsys, tmp_path):
    schedule = get("bitpipe")(4, 8)
    assert main(["schedule", "export", "bitpipe", "--pp", "4", "-m", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed == csv_text(schedule)
    assert printed.splitlines()[-1] == "routes=2,0,0,1,1,0,0,1,1"
    for suffix in ("csv", "json"):
        path = tmp_path / f"bitpipe.{suffix}"
        assert main(["schedule", "export", "bitpipe", "--pp", "4", "-m", "8", "-o",
                     str(path)]) == 0
        again = (Schedule.from_torch_csv(path, name="bitpipe") if suffix == "csv"
                 else Schedule.from_json(path.read_text()))
        assert again == schedule and again.routes == schedule.routes, suffix
    assert json.loads((tmp_path / "bitpipe.json").read_text())["routes"] == list(schedule.routes)
    assert main(["schedule", "simulate", "bitpipe", "--pp", "4", "-m", "6"]) == 2
    assert "multiple of pp_size=4" in capsys.readouterr().err



@pytest.mark.parametrize("p, m, mean", [(2, 4, 0.125), (4, 8, 0.134), (4, 16, 0.069),
                                        (8, 16, 0.134), (8, 32, 0.069)])
def test_gradients_are_final_earlier_than_in_the_greedy_order(p, m, mean):
    """The point of the paper's order for eager synchronisation: a stage's last backward comes
    well before the step's end (the greedy bidirectional_v defers W pieces into the drain)."""
    windows = eager_windows(get("bitpipe")(p, m))
    assert sum(windows) / len(windows) == pytest.approx(mean, abs=0.0005)
    greedy = eager_windows(get("bidirectional_v")(p, m))
    assert sum(windows) / len(windows) > 2 * sum(greedy) / len(greedy)
