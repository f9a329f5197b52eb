"""Routes in the schedule IR (two copies of the stages, each microbatch through one) and the
bidirectional V family built on them: the IR, the validator, the simulator, the command line, and
the config rules for training it (what it refuses, by name; the runtime's parity tests are in
tests/dist/test_pipeline_bidirectional.py and test_pipeline_parity.py)."""

from __future__ import annotations

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


def test_json_keeps_the_routes_and_torch_csv_refuses_them():
    schedule = get("bidirectional_v")(4, 8)
    again = Schedule.from_json(schedule.to_json())
    assert again == schedule and again.routes == schedule.routes and again.num_routes == 2
    with pytest.raises(ValueError, match="cannot say which of the 2 routes"):
        csv_text(schedule)
    assert "routes" not in get("zbv")(4, 8).to_dict()  # one-route schedules: the JSON is as before


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
    _bidirectional({"model.preset": "tiny-moe", "parallel.ep": "2",
                    "train.global_batch_size": "4"}, 4)


@pytest.mark.parametrize("overrides, world, field_name, words", [
    ({"parallel.pp": "3", "model.n_layers": "6"}, 3, "parallel.pp", "even pp"),
    ({"train.global_batch_size": "1"}, 2, "train.global_batch_size", "m >= 2"),
    ({"parallel.pp": "4"}, 4, "parallel.schedule", "8 stages"),  # debug: 4 layers
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "1", "train.global_batch_size": "4"}, 4,
     "parallel.zero_stage", "ZeRO-1/2"),
    ({"parallel.dp_shard": "2", "parallel.zero_stage": "2", "train.global_batch_size": "4"}, 4,
     "parallel.zero_stage", "ZeRO-1/2"),
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
    assert main(["schedule", "export", "bidirectional_v", "--pp", "2", "-m", "4"]) == 2
    assert "--format" in capsys.readouterr().err
    path = tmp_path / "bidir.json"
    assert main(["schedule", "export", "bidirectional_v", "--pp", "2", "-m", "4", "-o",
                 str(path)]) == 0
    assert main(["schedule", "show", str(path)]) == 0
    assert "0F0" in capsys.readouterr().out
