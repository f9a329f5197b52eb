"""SkipPipe paths (issue 18): the path rules and their refusals by name, the random generator,
the replay of paths over a cluster (checked against hand-computed times) and the path scheduler
against random valid paths and the full pipeline on a two-region cluster."""

from __future__ import annotations

import pytest

from loom.cluster import Link, regions
from loom.config import load_config, resolve
from loom.errors import ConfigError
from loom.schedule.path_replay import PathCosts, replay_paths
from loom.schedule.path_search import compare, schedule_paths
from loom.schedule.paths import (Path, PathRules, PathSet, check_path, check_paths, full_paths,
                                 random_paths, skip_count, stage_orders)


def test_skip_zero_with_one_replica_is_the_ordinary_pipeline():
    rules = skip_count(4, 0.0)
    assert rules.skips == 0 and stage_orders(rules) == [(0, 1, 2, 3)]
    full = full_paths(4, 6)
    assert all(p.stages == (0, 1, 2, 3) and p.replicas == (0,) * 4 for p in full.paths)
    assert random_paths(rules, 1, 6, seed=3) == full
    check_paths(full, rules)


@pytest.mark.parametrize("stages, ratio, words", [
    (4, 0.3, "nearest valid: 0.25"),                 # 1.2 stages: not whole; 2 is too many
    (8, 0.3, "nearest valid: 0.25 or 0.375"),        # 2.4 stages
    (4, 0.75, "first and last stage are never skipped"),
    (4, 0.5, "would leave stages 1..2 untrained; at most 0.25"),
    (5, 1.0, "must be a number in [0, 1)"),
    (5, -0.2, "must be a number in [0, 1)"),
    (8, 0.625, "more than 1 consecutive"),          # 5 skips of 6 middle stages, limit 1
])
def test_ratios_that_break_the_constraints_are_refused_by_name(stages, ratio, words):
    limit = 1 if stages == 8 else 3
    with pytest.raises(ConfigError) as err:
        skip_count(stages, ratio, max_consecutive_skips=limit)
    assert err.value.field_name == "parallel.skip_ratio" and words in str(err.value)
    with pytest.raises(ConfigError, match="parallel.max_swaps"):
        skip_count(6, 1 / 3, max_swaps=2)


def test_check_path_names_each_broken_rule():
    rules = PathRules(6, 1, max_consecutive_skips=1, max_swaps=1)
    check_path(Path.of((0, 2, 4, 3, 5), (0,) * 5), rules, 1)  # skips 1, swaps 3<->4: fine
    bad = {
        (1, 2, 3, 4, 5): "must start at the first stage",
        (0, 1, 2, 5, 4): "must end at the last stage",
        (0, 1, 2, 3, 4, 5): "visits 6 stages",
        (0, 4, 2, 3, 5): "beyond swaps of adjacent stages",
        (0, 1, 1, 3, 5): "visits a stage twice",
    }
    for stages, words in bad.items():
        with pytest.raises(ValueError, match=words):
            check_path(Path.of(stages, (0,) * len(stages)), rules, 1)
    with pytest.raises(ValueError, match="skips more than 1 consecutive"):
        check_path(Path.of((0, 3, 4, 5), (0,) * 4), PathRules(6, 2, 1, 0), 1)
    with pytest.raises(ValueError, match="2 swaps; at most 1"):
        check_path(Path.of((0, 2, 1, 4, 3, 7), (0,) * 6), PathRules(8, 2, 3, 1), 1)
    with pytest.raises(ValueError, match="replica outside"):
        check_path(Path.of((0, 2, 4, 5), (0, 0, 2, 0)), PathRules(6, 2, 1, 0), 2)


def test_unbalanced_skips_are_refused():
    rules = skip_count(4, 0.25)
    lopsided = PathSet(4, 1, tuple(Path.of((0, 1, 3), (0, 0, 0)) for _ in range(4)))
    with pytest.raises(ValueError, match="stage 1 is visited by 4 microbatches; balanced"):
        check_paths(lopsided, rules)


@pytest.mark.parametrize("seed", range(5))
def test_random_paths_obey_every_rule(seed):
    rules = skip_count(8, 0.25, max_swaps=1)
    paths = random_paths(rules, 3, 12, seed=seed, swap_probability=1.0)
    check_paths(paths, rules)  # ends fixed, exact skips, balance, consecutive skips, swaps
    assert [p.replicas[0] for p in paths.paths] == [m % 3 for m in range(12)]
    assert any(list(p.stages) != sorted(p.stages) for p in paths.paths)  # some swap happened
    counts = paths.stage_visits()
    assert {counts[s] for s in range(1, 7)} <= {8}  # 12 * 4 visits over 6 stages, exactly
    assert PathSet.from_json(paths.to_json()) == paths


GBIT = 1e9 / 8


def test_replay_matches_hand_computed_times():
    cluster = regions([1, 1], intra=Link(0.0, 10 * GBIT), inter=Link(0.01, 1 * GBIT),
                      compute=[1.0, 0.5])
    allocation = {(0, 0): 0, (1, 0): 1}
    costs = PathCosts((0.1, 0.1), activation_bytes=1e8 / 8)  # 0.1 s on the 1 Gbit link
    one = replay_paths(full_paths(2, 1), cluster, allocation, costs)
    # F0 0-0.1, hop 0.11, F1 (half speed) 0.21-0.41, B1 0.41-0.81, hop 0.11, B0 0.92-1.12
    assert one.makespan == pytest.approx(1.12)
    two = replay_paths(full_paths(2, 2), cluster, allocation, costs)
    # mb 1's F0 0.1-0.2; its activation waits for the link (busy until 0.2): lands 0.31, F1
    # waits for node 1 (mb 0's F1 until 0.41) then B first: mb0 B1 0.41-0.81, mb1 F1 0.81-1.01,
    # mb1 B1 1.01-1.41, hop to 1.52, B0 1.52-1.72 (mb 0's B0 ran 0.92-1.12)
    assert two.makespan == pytest.approx(1.72)
    assert two.finishes == pytest.approx([1.12, 1.72])
    grads = PathCosts((0.1, 0.1), 1e8 / 8, gradient_bytes=(1e8 / 8, 0.0))
    two_replicas = {(0, 0): 0, (0, 1): 1, (1, 0): 1, (1, 1): 0}
    spread = replay_paths(full_paths(2, 2, 2), cluster, two_replicas, grads)
    # stage 0's replicas on nodes 0 and 1 average 1e8/8 bytes: 2 steps of half over 1 Gbit
    assert spread.makespan == pytest.approx(spread.backward_end + 2 * (0.01 + 0.05))


def _two_regions():
    """Four stages x two replicas on two regions of four nodes (the far one half as fast);
    each stage has a replica in each region, alternating, so the ordinary pipeline (replica
    m % 2 everywhere) crosses the slow link at every hop."""
    cluster = regions([4, 4], intra=Link(1e-3, 10 * GBIT), inter=Link(0.05, 0.1 * GBIT),
                      compute=[1.0, 0.5])
    allocation = {(s, r): (r if s % 2 == 0 else 1 - r) * 4 + s for s in range(4) for r in (0, 1)}
    costs = PathCosts.uniform(4, 0.1, activation_bytes=4e6, gradient_bytes=2e6)
    return cluster, allocation, costs


def test_scheduled_paths_beat_random_paths_and_the_full_pipeline():
    cluster, allocation, costs = _two_regions()
    rules = skip_count(4, 0.25)
    result = compare(rules, 2, 6, cluster, allocation, costs, samples=4)
    assert result.scheduled <= result.random_best < result.random_mean
    assert result.scheduled < result.full_scheduled < result.full
    paths = schedule_paths(rules, 2, 6, cluster, allocation, costs, restarts=0, rounds=1)
    check_paths(paths, rules)


def test_scheduler_honours_the_node_memory_limit():
    cluster, allocation, costs = _two_regions()
    rules = skip_count(4, 0.25)
    paths = schedule_paths(rules, 2, 6, cluster, allocation, costs, memory=3, rounds=1)
    check_paths(paths, rules)
    for stage in range(4):
        for replica in (0, 1):
            assert len(paths.visitors(stage, replica)) <= 3
    with pytest.raises(ValueError, match="memory limit"):
        schedule_paths(rules, 2, 8, cluster, allocation, costs, memory=3)


def _skippipe(overrides: dict[str, str], world: int = 4):
    table = {"parallel.pp": "4", "parallel.schedule": "skippipe", "model.preset": "debug",
             "train.global_batch_size": "8", "train.micro_batch_size": "1", **overrides}
    return resolve(load_config(None, table), world)


def test_the_config_refuses_what_skippipe_cannot_run_by_name():
    assert _skippipe({"parallel.skip_ratio": "0.25"}).parallel.skip_ratio == 0.25
    assert _skippipe({"parallel.pp": "2", "parallel.stage_replicas": "2"}).parallel.dp_replicate == 2
    refused = {
        ("parallel.skip_ratio", "0.5"): "would leave stages 1..2 untrained",
        ("parallel.skip_ratio", "0.3"): "nearest valid: 0.25",
        ("parallel.stage_replicas", "2"): "must equal dp_replicate = 1",
        ("model.tie_embeddings", "true"): "tied embeddings",
        ("data.packing", "pack"): "does not run it yet",
        ("train.recompute", "full"): "does not run it yet",
        ("train.dtype", "bf16"): "keeps fp32 parameters",
    }
    for (key, value), words in refused.items():
        with pytest.raises(ConfigError) as err:
            _skippipe({key: value})
        assert err.value.field_name == key and words in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="no other parallelism inside it") as err:
        _skippipe({"parallel.tp": "2"}, world=8)
    assert err.value.field_name == "parallel.tp"
    with pytest.raises(ConfigError, match="needs parallel.schedule") as err:
        _skippipe({"parallel.schedule": "gpipe", "parallel.skip_ratio": "0.25"})
    assert err.value.field_name == "parallel.skip_ratio"
