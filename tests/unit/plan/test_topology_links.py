"""Network topology in the link model: racks, pods and their oversubscription (``Cluster``).

A group inside a node uses the intra-node link; one that spans nodes the inter-node link; one
that spans racks gets that bandwidth divided by the rack's downlink : uplink ratio, one that
spans pods by the spine's too. The defaults are non-blocking: today's link model unchanged.
"""

from __future__ import annotations

import pytest

from loom.layout import Layout
from loom.models.presets import PRESETS, parameter_count
from loom.plan.hardware import GB, Cluster, HardwareError, Link, load_catalog, make_cluster
from loom.sim.cost_model import CostModel, allreduce_time

FAST = Link("fast", 100 * GB, 1e-6, efficiency=1.0)
SLOW = Link("slow", 10 * GB, 1e-5, efficiency=1.0)


def topology(**kwargs: float) -> Cluster:
    # 64 GPUs: 8 nodes of 8, 2 nodes per rack (16 GPUs), 2 racks per pod (32 GPUs)
    return Cluster(make_cluster("H100-SXM", 1).gpu, 64, 8, FAST, SLOW, **kwargs)


def test_defaults_are_non_blocking():
    c = topology()
    for size, stride in ((8, 1), (16, 1), (64, 1), (4, 16), (2, 32)):
        assert c.link_for(size, stride) is (FAST if size * stride <= 8 else SLOW)


def test_a_group_spanning_racks_gets_the_uplink_share():
    c = topology(nodes_per_rack=2, rack_oversubscription=4, racks_per_pod=2,
                 spine_oversubscription=7)
    assert c.link_for(8, 1) is FAST
    assert c.link_for(16, 1) is SLOW  # two nodes, one rack
    assert c.link_for(2, 8) is SLOW
    rack = c.link_for(32, 1)  # two racks, one pod
    assert rack.bandwidth == 10 * GB / 4 and rack.latency == SLOW.latency
    assert c.link_for(4, 8).bandwidth == 10 * GB / 4  # strided: ranks 0, 8, 16, 24
    pods = c.link_for(64, 1)  # two pods: both ratios
    assert pods.bandwidth == pytest.approx(10 * GB / 28)
    assert c.link_for(2, 32).bandwidth == pytest.approx(10 * GB / 28)


def test_rack_ratio_without_pods_applies_to_every_rack_crossing():
    c = topology(nodes_per_rack=2, rack_oversubscription=3)
    assert c.link_for(64, 1).bandwidth == pytest.approx(10 * GB / 3)
    assert c.link_for(16, 1) is SLOW


@pytest.mark.parametrize("kwargs, field", [
    ({"nodes_per_rack": -1}, "nodes_per_rack"),
    ({"rack_oversubscription": 0.5}, "rack_oversubscription"),
    ({"spine_oversubscription": 0}, "spine_oversubscription"),
    ({"racks_per_pod": 2}, "racks_per_pod"),  # a pod of racks of unknown size
])
def test_bad_topology_is_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        topology(**kwargs)


def test_data_parallel_reduction_across_racks_is_priced_on_the_oversubscribed_link():
    """llama3-8b, 64-way data parallel on 8 nodes: the gradient all-reduce spans every rack,
    so with 2 nodes per rack at 1:7 it costs the all-reduce at 1/7 of the bandwidth."""
    m = PRESETS["llama3-8b"]
    flat = make_cluster("H100-SXM", 64, 8)
    racked = Cluster(flat.gpu, 64, 8, flat.intra, flat.inter, nodes_per_rack=2,
                     rack_oversubscription=7)
    lay = Layout(dp_replicate=64, micro_batch=1, microbatches=1)
    costs = {}
    for name, cluster in (("flat", flat), ("racked", racked)):
        costs[name] = CostModel(m, seq_len=4096, global_batch=64, cluster=cluster).evaluate(lay)
    slow = Link("x", flat.inter.bandwidth / 7, flat.inter.latency, flat.inter.efficiency)
    assert costs["racked"].comm["dp"] == pytest.approx(
        allreduce_time(parameter_count(m) * 4, 64, slow))
    assert costs["racked"].comm["dp"] > 6 * costs["flat"].comm["dp"]
    assert costs["racked"].step_time > costs["flat"].step_time


def test_a_hardware_file_describes_the_topology(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text('[cluster]\nnodes_per_rack = 2\nrack_oversubscription = 1\n'
                    'racks_per_pod = 24\nspine_oversubscription = 7\n')
    c = make_cluster("H100-SXM", 1024, 8, catalog=load_catalog(path))
    assert (c.nodes_per_rack, c.racks_per_pod, c.spine_oversubscription) == (2, 24, 7.0)
    assert c.link_for(384, 1) is c.inter  # one pod of 24 racks of 2 nodes: non-blocking
    assert c.link_for(768, 1).bandwidth == pytest.approx(c.inter.bandwidth / 7)
    path.write_text('[cluster]\nnodes_per_rack = "two"\n')
    with pytest.raises(HardwareError, match="cluster.nodes_per_rack"):
        make_cluster("H100-SXM", 64, 8, catalog=load_catalog(path))
    path.write_text('[cluster]\nrack_oversubscription = 0.5\n')
    with pytest.raises(HardwareError, match="rack_oversubscription"):
        make_cluster("H100-SXM", 64, 8, catalog=load_catalog(path))
