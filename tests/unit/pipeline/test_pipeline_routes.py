"""Routes in the schedule IR (two copies of the stages, each microbatch through one) and the
bidirectional V family built on them: the IR, the validator, the simulator, the command line, and
the config rules for training it (what it refuses, by name; the runtime's parity tests are in
tests/dist/test_pipeline_bidirectional.py and test_pipeline_parity.py)."""

from __future__ import annotations

import io
import json

import pytest

from loom.config import ConfigError, load_config, resolve
from loom.models import PRESETS
from loom.pipeline.cli import main
from loom.schedule.ir import Action, Op, Schedule, csv_text
from loom.schedule.families import get, names, routed, simulation_only, trainable
from loom.schedule.families.bidirectional import bidirectional_placement
from loom.schedule.validate import ScheduleError, dependencies, peak_memory, validate
from loom.schedule.cost import StageCosts, full_stage_costs
from loom.schedule.simulate import simulate

CASES = [(p, m) for p in (2, 3, 4, 8) for m in (1, 2, 5, 2 * p, 4 * p)]


def _two_routes() -> Schedule:
    """Two copies of a 2-stage model on 2 ranks, mirrored; microbatch 0 down, 1 up."""
    rows = ([Action(0, Op.F, 0), Action(3, Op.F, 1), Action(3, Op.B, 1), Action(0, Op.B, 0)],
            [Action(2, Op.F, 1), Action(1, Op.F, 0), Action(1, Op.B, 0), Action(2, Op.B, 1)])
    return Schedule(4, 2, (0, 1, 1, 0), rows, name="mirrored", num_routes=2, routes=(0, 1))


def test_a_microbatch_depends_only_on_the_stages_of_its_route():
    schedule = _two_routes()
    validate(schedule)
    assert list(schedule.route_stages(1)) == [2, 3]
    assert dependencies(schedule, Action(2, Op.F, 1)) == ()  # the first stage of route 1
    assert dependencies(schedule, Action(1, Op.B, 0)) == (Action(1, Op.F, 0),)  # route 0's last
    assert dependencies(schedule, Action(2, Op.B, 1)) == (Action(2, Op.F, 1), Action(3, Op.B, 1))
    assert schedule.stage_weight(0) == 1  # the rank's only stage of route 0: a whole rank's


def test_an_action_off_the_microbatch_route_is_refused_by_name():
    good = _two_routes()
    rows = [list(row) for row in good.actions]
    rows[0][0] = Action(0, Op.F, 1)  # microbatch 1 takes route 1 (stages 2..3)
    with pytest.raises(ScheduleError) as info:
        validate(Schedule(4, 2, good.placement, rows, num_routes=2, routes=(0, 1)))
    assert info.value.rule == "route" and "stages 2..3" in info.value.reason


def test_routes_must_fit_the_stages_and_the_microbatches():
    with pytest.raises(ValueError, match="divide num_stages"):
        Schedule(3, 1, (0, 0, 0), [[]], num_routes=2)
    with pytest.raises(ValueError, match="one route in 0..1 per microbatch"):
        Schedule(4, 2, (0, 1, 1, 0), [[], []], num_routes=2, routes=(0, 2))


def test_json_keeps_the_routes():
    schedule = get("bidirectional_v")(4, 8)
    again = Schedule.from_json(schedule.to_json())
    assert again == schedule and again.routes == schedule.routes and again.num_routes == 2
    assert "routes" not in get("zbv")(4, 8).to_dict()  # one-route schedules: the JSON is as before


@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (4, 8), (8, 16)])
def test_the_csv_carries_the_routes_in_a_last_row_and_reads_back(p, m, tmp_path):
    """PyTorch's CSV has rows for ranks only: Loom appends ``routes=2,<route per microbatch>``
    (its extension), and its reader restores the schedule exactly, routes included."""
    schedule = get("bidirectional_v")(p, m)
    lines = csv_text(schedule).splitlines()
    assert len(lines) == p + 1
    assert lines[-1] == ",".join(["routes=2"] + [str(mb % 2) for mb in range(m)])
    assert lines[:p] == [",".join(map(str, row)) for row in schedule.actions]
    path = tmp_path / "bidi.csv"
    schedule.to_torch_csv(path)
    again = Schedule.from_torch_csv(path, name=schedule.name)
    assert again == schedule and again.routes == schedule.routes and again.num_routes == 2
    assert Schedule.from_torch_csv(path).name == "bidi"  # named after the file, as before


def test_one_route_csv_is_torchs_format_unchanged():
    """No routes row for one-route schedules: the same lines as the rank rows, byte for byte."""
    for schedule in (get("zbv")(4, 8), get("1f1b")(2, 3), _one_route_by_hand()):
        text = csv_text(schedule)
        assert text == "".join(",".join(map(str, row)) + "\r\n" for row in schedule.actions)
        assert "routes" not in text
        assert Schedule.from_torch_csv(io.StringIO(text),
                                       name=schedule.name) == schedule


def _one_route_by_hand() -> Schedule:
    rows = ([Action(0, Op.F, 0), Action(0, Op.B, 0)], [Action(1, Op.F, 0), Action(1, Op.B, 0)])
    return Schedule(2, 1, (0, 1), rows, name="by_hand")


def test_a_route_without_microbatches_cannot_be_placed_by_a_csv():
    """m = 1: route 1's stages run nothing, so no row shows where they sit (JSON can)."""
    with pytest.raises(ValueError, match="run no action"):
        csv_text(get("bidirectional_v")(2, 1))


def test_a_bad_routes_row_is_refused_by_name():
    text = csv_text(_two_routes()).replace("routes=2", "routes=two")
    with pytest.raises(ValueError, match="routes row"):
        Schedule.from_torch_csv(io.StringIO(text))


@pytest.mark.parametrize("p, m", CASES, ids=[f"p{p}-m{m}" for p, m in CASES])
def test_bidirectional_v_is_valid_balanced_and_within_1f1b_memory(p, m):
    schedule = get("bidirectional_v")(p, m)
    validate(schedule)
    assert schedule.placement == bidirectional_placement(p)
    for rank in range(p):  # each rank: two stages of each copy, the copies mirrored
        assert schedule.stages_of(rank) == tuple(sorted((rank, 2 * p - 1 - rank,
                                                         2 * p + p - 1 - rank, 3 * p + rank)))
    assert [schedule.route_of(mb) for mb in range(m)] == [mb % 2 for mb in range(m)]
    assert max(peak_memory(schedule)) <= p  # 1F1B's budget
    result = simulate(schedule)
    assert result.peak_memory == peak_memory(schedule)
    assert len(set(result.busy)) == 1 or m % 2  # an even m gives every rank the same work


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16), (8, 32)])
def test_bidirectional_v_bubble_against_1f1b_interleaved_and_zbv(p, m):
    """The measured ordering in docs/design.md (F = I = W per stage): below 1F1B, at most
    interleaved 1F1B's (equal at p = 8, m = 32), not below ZB-V's, which has no bubble at the
    same peak memory."""
    costs = StageCosts.uniform(1, 1, 1)
    bubble = {name: simulate(schedule, costs).bubble_zb for name, schedule in (
        ("bidirectional_v", get("bidirectional_v")(p, m)),
        ("1f1b", get("1f1b")(p, m)),
        ("interleaved_1f1b", get("interleaved_1f1b")(p, m, chunks=2)),
        ("zbv", get("zbv")(p, m)))}
    assert bubble["bidirectional_v"] < bubble["1f1b"], bubble
    assert bubble["bidirectional_v"] <= bubble["interleaved_1f1b"], bubble
    assert bubble["zbv"] <= bubble["bidirectional_v"], bubble


def _bidirectional(overrides: dict[str, str], world: int = 2):
    table = {"parallel.pp": "2", "parallel.schedule": "bidirectional-v",
             "train.global_batch_size": "8", "train.micro_batch_size": "1", **overrides}
    return resolve(load_config(None, table), world)


def test_the_config_trains_it_with_an_even_pp_and_data_parallelism():
    assert "bidirectional_v" in routed() and "bidirectional_v" in trainable()
    assert "bidirectional_v" not in names() + simulation_only()  # one-copy lists (search, CSV)
    assert _bidirectional({}).parallel.schedule == "bidirectional-v"
    _bidirectional({"parallel.dp_replicate": "2", "train.global_batch_size": "4"}, 4)
    _bidirectional({"parallel.pp": "4", "model.n_layers": "8"}, 4)  # 2p stages per copy
    _bidirectional({"model.tie_embeddings": "true"})  # each copy's ends share one rank
    _bidirectional({"parallel.tp": "2", "parallel.cp": "2"}, 8)
    _bidirectional({"parallel.dp_shard": "2", "parallel.reshard_after_forward": "false",
                    "train.global_batch_size": "4"}, 4)  # ZeRO-3, gathered across the step
    for stage in ("1", "2"):  # ZeRO-1/2: the copy sum acts on the reduced slices
        _bidirectional({"parallel.dp_shard": "2", "parallel.zero_stage": stage,
                        "train.global_batch_size": "4"}, 4)
    _bidirectional({"model.preset": "tiny-moe", "parallel.ep": "2",
                    "train.global_batch_size": "4"}, 4)


@pytest.mark.parametrize("overrides, world, field_name, words", [
    ({"parallel.pp": "3", "model.n_layers": "6"}, 3, "parallel.pp", "even pp"),
    ({"train.global_batch_size": "1"}, 2, "train.global_batch_size", "m >= 2"),
    ({"parallel.pp": "4"}, 4, "parallel.schedule", "8 stages"),  # debug: 4 layers
    # tied embeddings with ZeRO-1/2: each copy's ends share one Parameter on one rank, which
    # two stages' ZeRO buckets cannot both hold (looped pipelines train it: test_pipeline_tied)
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "1", "model.tie_embeddings": "true",
      "train.global_batch_size": "4"}, 4, "parallel.dp_shard", "ZeRO-1 cannot shard it"),
    # each copy's tied ends share one Parameter on one rank, which ZeRO-3 cannot shard twice
    ({"parallel.dp_shard": "2", "parallel.reshard_after_forward": "false",
      "model.tie_embeddings": "true", "train.global_batch_size": "4"}, 4, "parallel.dp_shard",
     "first and last stage on one rank"),
])
def test_the_config_refuses_what_it_does_not_train_by_name(overrides, world, field_name, words):
    with pytest.raises(ConfigError) as info:
        _bidirectional({"model.preset": "debug", **overrides}, world)
    assert info.value.field_name == field_name, str(info.value)
    assert words in str(info.value)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_model_preset_resolves_with_it_at_pp2(preset):
    """Dense, tied (GPT) and MoE presets alike."""
    assert _bidirectional({"model.preset": preset}).model.n_layers >= 4


def test_the_command_line_lists_shows_simulates_and_exports_json(capsys, tmp_path):
    assert main(["schedule", "list"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("bidirectional_v"))
    assert "simulation only" not in line and "two model copies" in line
    assert main(["schedule", "simulate", "bidirectional_v", "--pp", "4", "-m", "8", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    schedule = get("bidirectional_v")(4, 8)  # --costs: a full stage's, a chunk of 2 takes half
    unit = full_stage_costs(StageCosts.uniform(1, 1, 1), schedule)
    assert figures["makespan"] == simulate(schedule, unit).makespan
    capsys.readouterr()
    assert main(["schedule", "export", "bidirectional_v", "--pp", "2", "-m", "4"]) == 0
    printed = capsys.readouterr().out  # Loom's CSV: the rank rows, then the routes row
    assert printed == csv_text(get("bidirectional_v")(2, 4))
    assert printed.splitlines()[-1] == "routes=2,0,1,0,1"
    for suffix in ("json", "csv"):
        path = tmp_path / f"bidir.{suffix}"
        assert main(["schedule", "export", "bidirectional_v", "--pp", "2", "-m", "4", "-o",
                     str(path)]) == 0
        assert main(["schedule", "show", str(path)]) == 0
        assert "0F0" in capsys.readouterr().out
        again = Schedule.from_json(path.read_text()) if suffix == "json" else \
            Schedule.from_torch_csv(path, name="bidirectional_v")
        assert again == get("bidirectional_v")(2, 4)
    assert main(["schedule", "export", "bidirectional_v", "--pp", "2", "-m", "1"]) == 2
    assert "--format" in capsys.readouterr().err  # a route without microbatches: JSON only


def eager_windows(schedule: Schedule) -> list[float]:
    """Per copy-sum unit of every rank (``route_copies.copy_units``) of a two-copy schedule: the
    share of the simulated step (F = I = W) left after both ranks of its pair are past its last
    W or B, the time an eager all-reduce has to hide behind (tests/unit/schedule/test_bitpipe.py
    compares BitPipe's order with it)."""
    from loom.pipeline.route_copies import copy_units
    from loom.pipeline.runtime import copy_groups

    p = schedule.pp_size
    result = simulate(schedule, StageCosts.uniform(1, 1, 1))
    finish = {slot.action: slot.finish for row in result.timeline for slot in row}
    span = max(finish.values())
    length = schedule.stages_per_route
    windows = []
    for rank in range(p):
        pair = next(ranks for ranks in copy_groups(schedule) if rank in ranks)
        for unit in copy_units(schedule, rank, pair, tied=False):
            ready = max(finish[next(a for a in reversed(schedule.actions[member])
                                    if a.op in (Op.W, Op.B)
                                    and a.stage % length in unit.model_stages)]
                        for member in pair)
            windows.append((span - ready) / span)
    return windows


@pytest.mark.parametrize("p, m, early, mean", [(2, 4, 1 / 2, 0.021), (4, 8, 7 / 8, 0.055),
                                               (4, 16, 7 / 8, 0.029), (8, 16, 7 / 8, 0.027),
                                               (8, 32, 15 / 16, 0.027)])
def test_eager_sync_has_the_drain_to_hide_behind(p, m, early, mean):
    """The numbers in docs/design.md ("BitPipe in full"): the greedy order fills the drain with
    W pieces, so units are ready only in the last few percent of the step; most are ready
    before its end, which is what eager synchronisation overlaps."""
    windows = eager_windows(get("bidirectional_v")(p, m))
    assert sum(w > 0 for w in windows) / len(windows) == early
    assert sum(windows) / len(windows) == pytest.approx(mean, abs=0.0005)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (4, 8), (4, 9), (8, 16)])
@pytest.mark.parametrize("tied", [False, True])
def test_both_ranks_of_a_pair_sum_the_same_units_in_the_same_order(p, m, tied):
    """Collectives on the pair's group are matched by order: the copy-sum units (one per model
    stage; a tied model's two ends together) come out the same on both ranks, each rank's unit
    on its own copy of those stages, and every model stage of the rank exactly once."""
    from loom.pipeline.route_copies import copy_units
    from loom.pipeline.runtime import copy_groups

    schedule = get("bidirectional_v")(p, m)
    length = schedule.stages_per_route
    for pair in copy_groups(schedule):
        orders = [copy_units(schedule, rank, pair, tied) for rank in pair]
        assert len({tuple(u.model_stages for u in units) for units in orders}) == 1, pair
        for rank, units in zip(pair, orders):
            held = sorted(s % length for s in schedule.stages_of(rank))
            assert sorted(j for u in units for j in u.model_stages) == held
            for unit in units:
                assert {schedule.rank_of(s) for s in unit.stages} == {rank}
                assert sorted(s % length for s in unit.stages) == sorted(unit.model_stages)
        ends = [u.model_stages for u in orders[0] if 0 in u.model_stages]
        assert ends in ([], [(0, length - 1)] if tied else [(0,)])
