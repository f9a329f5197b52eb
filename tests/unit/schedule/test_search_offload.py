"""PipeOffload placed by the schedule search (issue 22 item 5): with ``offload=True`` a schedule
over the memory limit competes once ``insert_offload`` has made it fit, priced with its transfers
on the host link (``simulate_offload``); without it the search is what it always was."""

from __future__ import annotations

import pytest

from loom.pipeline.cli import main
from loom.schedule.cost import StageCosts, full_stage_costs as _full_stage
from loom.schedule.offload import count_transfers, simulate_offload
from loom.schedule.search import search
from loom.schedule.validate import validate_transfers

EFFORT = 60_000  # small: the offload step does not depend on it


def _costs(copy_time: float) -> StageCosts:
    """Unit F, I, W and a host link that moves one activation unit in ``copy_time``."""
    return StageCosts.uniform(1, 1, 1, host_bandwidth=1 / copy_time, host_unit_bytes=1)


def test_a_fast_host_link_beats_every_schedule_that_fits_without_offload():
    # p = 4 needs 4 units for 1F1B; at 2 the search without offload squeezes the pipeline
    costs = _costs(0.5)
    plain = search(4, 8, costs, 2, effort=EFFORT)
    found = search(4, 8, costs, 2, effort=EFFORT, offload=True)
    assert found.schedule.has_transfers and found.schedule.name.endswith("+offload]")
    validate_transfers(found.schedule, memory_limit=2)
    # its figures are the transfers' simulation, on the costs it reports
    assert found.sim_result.makespan == simulate_offload(found.schedule,
                                                         found.costs).result.makespan
    assert found.sim_result.makespan < plain.sim_result.makespan
    assert found.best.makespan == pytest.approx(float(found.sim_result.makespan))
    assert found.leaderboard[0] == found.best
    assert found.summary()["offloads"] == sum(
        n for (_, op), n in count_transfers(found.schedule).items() if op.name == "O") > 0


def test_a_slow_host_link_keeps_the_schedule_without_transfers():
    # a unit takes 50 F-times each way: every offload costs more than the pipeline gains
    costs = _costs(50)
    plain = search(4, 8, costs, 2, effort=EFFORT)
    found = search(4, 8, costs, 2, effort=EFFORT, offload=True)
    assert not found.schedule.has_transfers
    assert found.schedule == plain.schedule and found.best == plain.best
    assert found.sim_result.makespan == plain.sim_result.makespan
    assert "offloads" not in found.summary()


def test_when_nothing_is_over_the_limit_offload_changes_nothing():
    # GPipe's peak is m = 8: at that limit every looped family fits, there is nothing to offload
    costs = _costs(0.5)
    plain = search(4, 8, costs, 8, placement="looped", effort=EFFORT)
    found = search(4, 8, costs, 8, placement="looped", effort=EFFORT, offload=True)
    assert found.schedule == plain.schedule and not found.schedule.has_transfers


def test_the_default_is_the_search_without_offload():
    costs = _costs(0.5)
    default = search(4, 8, costs, 2, effort=EFFORT)
    explicit = search(4, 8, costs, 2, effort=EFFORT, offload=False)
    assert default == explicit and not default.schedule.has_transfers


def test_cli_offload_flags(capsys):
    argv = ["schedule", "search", "--pp", "4", "-m", "8", "--memory-limit", "2", "--effort",
            str(EFFORT)]
    assert main(argv + ["--offload", "--host-copy-time", "0.5"]) == 0
    assert "+offload]" in capsys.readouterr().out
    assert main(argv + ["--offload"]) == 2
    assert "--host-copy-time" in capsys.readouterr().err
    assert main(argv + ["--host-copy-time", "0.5"]) == 2
    assert "--offload" in capsys.readouterr().err


def test_the_training_path_lets_the_search_place_the_offloads():
    """``parallel.schedule = "search"`` with ``parallel.schedule_offload_limit``: the search
    weighs the offloads itself (the config names no host link: copies priced as free) instead of
    searching without them and offloading its pick afterwards; the config accepts a limit the
    search's pick without offload would miss (2 units at pp = 4, whose 1F1B needs 4)."""
    from loom.config import layout_of, load_config, resolve
    from loom.schedule.select import schedule_of

    config = resolve(load_config(None, {
        "parallel.pp": "4", "train.global_batch_size": "8", "train.micro_batch_size": "1",
        "parallel.schedule": "search", "parallel.schedule_offload_limit": "2"}), 4)
    layout = layout_of(config)
    schedule = schedule_of(layout, max_stages=config.model.n_layers)
    validate_transfers(schedule, memory_limit=2)
    chunks = min(8, config.model.n_layers // 4)
    free = StageCosts.uniform(1, 1, 1)
    plain = search(4, 8, free, 2, max_chunks=chunks)
    assert schedule.has_transfers and schedule.name.endswith("+offload]")
    assert simulate_offload(schedule, _full_stage(free, schedule)).result.makespan < \
        plain.sim_result.makespan
