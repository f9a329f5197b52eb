"""One ``Layout`` value: a config and the planner's layouts turn into each other by value."""

import dataclasses

import pytest

from loom.config import layout_of, load_config, resolve, with_layout
from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.search import runnable, to_config
from loom.plan.space import Workload, layouts

WORK = Workload("debug", PRESETS["debug"], 256, 64)


def _planned(world: int) -> list[Layout]:
    found = [lay for group in layouts(WORK, world, 8) for lay in group]
    return [lay for lay in found if runnable(lay, WORK) is None]


@pytest.mark.parametrize("world", [4, 8])
def test_every_runnable_planned_layout_survives_the_round_trip_through_a_config(world):
    planned = _planned(world)
    assert len(planned) > 100  # the space is not trivially small
    kinds = {(lay.pp > 1, lay.zero_stage, lay.searched) for lay in planned}
    assert (True, 0, True) in kinds and (False, 3, False) in kinds  # search and ZeRO-3 included
    for lay in planned:
        # a searched layout without costs gets the config's default ones ("the planner fills them")
        expected = lay if lay.schedule_costs or not lay.searched \
            else dataclasses.replace(lay, schedule_costs="1,1,1,0")
        assert layout_of(to_config(lay, WORK)) == expected, lay.label()


@pytest.mark.parametrize("overrides", [
    {},
    {"parallel.dp_shard": 2, "parallel.zero_stage": 2, "train.recompute": "full"},
    {"parallel.pp": 2, "parallel.schedule": "zbv"},
    {"parallel.pp": 2, "parallel.schedule": "search", "parallel.schedule_placement": "v",
     "parallel.schedule_memory_limit": 3.0},
    {"parallel.tp": 2, "parallel.sequence_parallel": True, "parallel.cp": 2,
     "parallel.cp_mode": "ring"},
])
def test_a_config_written_back_from_its_layout_is_the_same_config(overrides):
    base = {"model.preset": "debug", "train.global_batch_size": 16, "train.micro_batch_size": 1}
    config = resolve(load_config(None, {**base, **overrides}), 8)
    lay = layout_of(config)
    assert lay.world == 8 and lay.global_batch == config.train.global_batch_size
    assert with_layout(config, lay) == config


def test_the_normal_form_leaves_unused_knobs_unset():
    config = resolve(load_config(None, {"model.preset": "debug", "parallel.zero_stage": 2}), 2)
    lay = layout_of(config)  # dp_replicate 2: nothing is sharded, no pipeline to schedule
    assert (lay.zero_stage, lay.schedule, lay.chunks, lay.schedule_costs) == (0, "none", 1, "")
    assert lay.microbatches == config.train.global_batch_size // (2 * lay.micro_batch)


def test_the_search_placement_follows_its_stages_per_rank_unless_named():
    assert Layout(pp=4, schedule="search", chunks=2).schedule_placement == "v"
    assert Layout(pp=4, schedule="search", chunks=1).schedule_placement == "looped"
    named = Layout(pp=4, schedule="search", chunks=2, schedule_placement="interleaved")
    assert named.schedule_placement == "interleaved" and not named.v_shaped
    assert Layout(pp=4, schedule="search", chunks=0).schedule_placement == "auto"


def test_the_grid_has_the_layouts_degrees():
    lay = Layout(pp=2, dp_shard=2, tp=2)
    grid = lay.grid()
    assert grid.size == lay.world == 8 and grid.degree("tp") == 2
    assert lay.label().startswith("pp2 dp_shard2 tp2")
