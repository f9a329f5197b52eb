"""The IR: action tokens, placements, schedule helpers and the JSON / torch-CSV formats."""

import io

import pytest

from loom.schedule import Action, Op, Schedule, explicit_placement, looped_placement, v_placement
from loom.schedule.ir import csv_text, from_torch_rows
from loom.schedule.families import get, names


@pytest.mark.parametrize("token, action", [
    ("2F0", Action(2, Op.F, 0)),
    ("1I3", Action(1, Op.I, 3)),
    ("0W2", Action(0, Op.W, 2)),
    ("3B1", Action(3, Op.B, 1)),
    ("12F105", Action(12, Op.F, 105)),
])
def test_action_prints_and_parses_in_torch_form(token, action):
    assert str(action) == token
    assert Action.parse(token) == action


@pytest.mark.parametrize("bad", ["", "F0", "2X0", "2F", "1UNSHARD", "2F0x"])
def test_action_parse_rejects_malformed_tokens(bad):
    with pytest.raises(ValueError, match="expected <stage><F\\|I\\|W\\|B><microbatch>"):
        Action.parse(bad)


def test_placements():
    assert looped_placement(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert v_placement(4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert v_placement(2, 4) == (0, 1, 1, 0, 0, 1, 1, 0)  # Hanayo's wave
    assert explicit_placement({0: 1, 1: 0, 2: 0}) == (1, 0, 0)
    with pytest.raises(ValueError, match="every rank"):
        explicit_placement([0, 2])


def test_schedule_helpers():
    schedule = get("zbv")(4, 8)
    assert schedule.pp_size == 4
    assert schedule.chunks_per_rank == 2
    assert schedule.stages_of(1) == (1, 6)
    assert schedule.rank_of(7) == 0
    assert Action(7, Op.W, 0) in schedule
    assert schedule.position(schedule.actions[2][3]) == (2, 3)


def test_schedule_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="placement has 1 entries"):
        Schedule(2, 1, (0,), ((),))
    with pytest.raises(ValueError, match="uses rank 1"):
        Schedule(2, 1, (0, 1), ((),))


@pytest.mark.parametrize("name", names())
def test_json_round_trip_is_identity(name):
    schedule = get(name)(4, 9)
    assert Schedule.from_json(schedule.to_json()) == schedule


@pytest.mark.parametrize("name", names())
def test_torch_csv_round_trip_is_identity(name, tmp_path):
    schedule = get(name)(4, 9)
    path = tmp_path / "schedule.csv"
    schedule.to_torch_csv(path)
    loaded = Schedule.from_torch_csv(path, name=schedule.name)
    assert loaded == schedule
    assert Schedule.from_torch_csv(io.StringIO(csv_text(schedule)), name=name) == schedule


def test_torch_csv_format_is_one_row_per_rank_one_token_per_cell():
    text = csv_text(get("1f1b")(2, 2))
    assert text.splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"]


def test_from_torch_rows_skips_idle_and_bookkeeping_and_flattens_overlap():
    rows = [["0F0", "", None, "(0F1;0B0)OVERLAP_F_B", "0B1", "0REDUCE_GRAD"], ["1F0", "1B0", "1F1", "1B1"]]
    schedule = from_torch_rows(rows)
    assert [str(a) for a in schedule.actions[0]] == ["0F0", "0F1", "0B0", "0B1"]
    assert schedule.num_microbatches == 2
    assert schedule.placement == (0, 1)
    with pytest.raises(ValueError, match="communication action"):
        from_torch_rows([["0F0", "0SEND_F0"]])
