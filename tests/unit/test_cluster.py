"""The cluster description (``loom.cluster``): what a file means, the generator, and every bad
value refused by name."""

from __future__ import annotations

import pytest

from loom.cluster import Cluster, Link, load, parse, regions
from loom.errors import ConfigError

GBIT = 1e9 / 8

TWO_REGIONS = """
[defaults]
latency_ms = 0.05
bandwidth_gbit = 10

[[node]]
name = "us-0"
region = "us"

[[node]]
name = "us-1"
compute = 0.5
memory_gb = 24
region = "us"

[[node]]
name = "eu-0"
region = "eu"

[[link]]
between = ["us-0", "eu-0"]
latency_ms = 40
bandwidth_gbit = 0.1

[[link]]
from = "us-1"
to = "eu-0"
bandwidth_gbit = 1
"""


def test_a_file_gives_nodes_in_rank_order_and_every_directed_link(tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(TWO_REGIONS)
    cluster = load(path)
    assert [n.name for n in cluster.nodes] == ["us-0", "us-1", "eu-0"]
    assert cluster.nodes[1].compute == 0.5 and cluster.nodes[1].memory_gb == 24
    assert cluster.link(0, 2) == cluster.link(2, 0) == Link(0.040, 0.1 * GBIT)  # between: both ways
    assert cluster.link(1, 2) == Link(0.05e-3, 1 * GBIT)  # from/to: one way, default latency
    assert cluster.link(2, 1) == cluster.link(0, 1) == Link(0.05e-3, 10 * GBIT)  # the default
    assert cluster.slowest_link([0, 1, 2]) == Link(0.040, 0.1 * GBIT)
    assert cluster.link(0, 2).time(12_500_000) == pytest.approx(0.040 + 1.0)
    (tmp_path / "again.toml").write_text(cluster.to_toml())
    assert load(tmp_path / "again.toml") == cluster  # written, read back


def test_the_regions_generator_joins_regions_by_their_slow_links():
    cluster = regions([2, 2], intra=Link(1e-5, 100 * GBIT), inter=Link(0.03, 0.1 * GBIT),
                      compute=[1.0, 0.5])
    assert cluster.size == 4
    assert [n.region for n in cluster.nodes] == ["r0", "r0", "r1", "r1"]
    assert [n.compute for n in cluster.nodes] == [1.0, 1.0, 0.5, 0.5]
    assert cluster.link(0, 1).gbit == pytest.approx(100)
    assert cluster.link(1, 2).gbit == pytest.approx(0.1) and cluster.link(3, 0).latency_s == 0.03


def test_the_world_must_have_one_rank_per_node():
    cluster = regions([2], intra=Link(0.0, GBIT), inter=Link(0.0, GBIT))
    cluster.check_world(2)
    with pytest.raises(ConfigError, match="one node per rank: the world has 4"):
        cluster.check_world(4)


MINIMAL = {"defaults": {"latency_ms": 0, "bandwidth_gbit": 1}, "node": [{"name": "a"},
                                                                         {"name": "b"}]}


@pytest.mark.parametrize("change, field, words", [
    ({"nodes": []}, "cluster.nodes", "unknown key"),
    ({"node": []}, "cluster.node", "one or more"),
    ({"defaults": {"latency_ms": 0}}, "cluster.defaults.bandwidth_gbit", "is required"),
    ({"defaults": {"latency_ms": -1, "bandwidth_gbit": 1}}, "cluster.defaults.latency_ms",
     ">= 0"),
    ({"defaults": {"latency_ms": 0, "bandwidth_gbit": 0}}, "cluster.defaults.bandwidth_gbit",
     "> 0"),
    ({"defaults": {"latency_ms": 0, "bandwidth_gbit": float("inf")}},
     "cluster.defaults.bandwidth_gbit", "finite"),
    ({"node": [{"name": "a"}, {"name": "a"}]}, "cluster.node[1].name", "repeats"),
    ({"node": [{"name": "a", "compute": 0}]}, "cluster.node[0].compute", "> 0"),
    ({"node": [{"name": "a", "speed": 2}]}, "cluster.node[0].speed", "unknown key"),
    ({"node": [{"name": ""}]}, "cluster.node[0].name", "non-empty"),
    ({"link": [{"between": ["a", "c"], "bandwidth_gbit": 1}]}, "cluster.link[0]", "names no node"),
    ({"link": [{"between": ["a", "a"]}]}, "cluster.link[0]", "to itself"),
    ({"link": [{"between": ["a"]}]}, "cluster.link[0].between", "two node names"),
    ({"link": [{"between": ["a", "b"], "from": "a"}]}, "cluster.link[0]", "not both"),
    ({"link": [{"from": "a", "to": "b", "bandwidth_gbit": "fast"}]},
     "cluster.link[0].bandwidth_gbit", "finite number"),
])
def test_bad_values_are_refused_by_name(change, field, words):
    with pytest.raises(ConfigError) as refused:
        parse({**MINIMAL, **change})
    assert refused.value.field_name == field
    assert words in str(refused.value)


def test_an_unreadable_or_broken_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="file does not exist"):
        load(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        load(tmp_path)
    (tmp_path / "bad.toml").write_text("[[node]\nname=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(tmp_path / "bad.toml")


def test_a_cluster_is_a_value():
    a = regions([1, 1], intra=Link(0.0, GBIT), inter=Link(0.01, GBIT))
    assert a == regions([1, 1], intra=Link(0.0, GBIT), inter=Link(0.01, GBIT))
    assert isinstance(a, Cluster)
