"""``parallel.schedule_offload_limit`` (PipeOffload, issue 22 item 5): the config turns the
policy on for every consumer of ``schedule_of`` (trainer, estimator, planner), and refuses, by
name, what the runtime's offload is not tested with or a limit the policy cannot meet."""

from __future__ import annotations

import pytest

from loom.config import ConfigError, layout_of, load_config, resolve
from loom.schedule.ir import Op
from loom.schedule.offload import offload_peak
from loom.schedule.select import schedule_of

PP4 = {"parallel.pp": "4", "train.global_batch_size": "8", "train.micro_batch_size": "1",
       "parallel.schedule": "1f1b"}


def test_the_limit_reaches_the_schedule_every_consumer_gets():
    config = resolve(load_config(None, {**PP4, "parallel.schedule_offload_limit": "2"}), 4)
    layout = layout_of(config)
    assert layout.schedule_offload_limit == 2 and "offload@2" in layout.label()
    schedule = schedule_of(layout, max_stages=config.model.n_layers)
    assert any(a.op is Op.O for row in schedule.actions for a in row)
    assert max(offload_peak(schedule)) <= 2
    plain = schedule_of(layout_of(resolve(load_config(None, PP4), 4)))
    assert not plain.has_transfers and schedule.compute_only().actions == plain.actions


def test_the_memory_estimate_follows_the_limit():
    from loom.train.memory import estimate_memory

    plain = estimate_memory(resolve(load_config(None, PP4), 4))
    offloaded = estimate_memory(resolve(load_config(
        None, {**PP4, "parallel.schedule_offload_limit": "2"}), 4))
    # rank 0 of 1F1B at pp = 4 holds 4 units without, 2 with the offloads
    assert offloaded.rank == plain.rank == 0
    assert offloaded.activations == plain.activations / 2
    assert offloaded.parameters == plain.parameters


@pytest.mark.parametrize("overrides,world,field,words", [
    ({"parallel.schedule_offload_limit": "2"}, 1, "parallel.schedule_offload_limit",
     "needs parallel.pp > 1"),
    ({**PP4, "parallel.schedule_offload_limit": "1"}, 4, "parallel.schedule_offload_limit",
     ">= 2 units"),
    ({**PP4, "parallel.schedule": "zb_h1", "parallel.schedule_offload_limit": "2"}, 4,
     "parallel.schedule_offload_limit", "over the limit of 2"),
    ({**PP4, "parallel.schedule_offload_limit": "2", "train.recompute": "full"}, 4,
     "train.recompute", "does not compose"),
    ({**PP4, "parallel.schedule_offload_limit": "2", "train.offload_activations": "true"}, 4,
     "train.offload_activations", "does not compose"),
])
def test_refused_by_name(overrides, world, field, words):
    with pytest.raises(ConfigError) as error:
        resolve(load_config(None, overrides), world)
    assert error.value.field_name == field and words in str(error.value)
