"""Network topology in the link model: racks, pods and their oversubscription (``Cluster``).

A group inside a node uses the intra-node link; one that spans nodes the inter-node link; when
the groups span racks, the streams that leave a rack share its uplinks (its GPUs' bandwidth
over the rack's downlink : uplink ratio), and the inter-node bandwidth is divided by how many
times they overload them (``Cluster.uplink_overload``); groups spanning pods are checked against
the pod's uplinks too, oversubscribed by both ratios. The defaults are non-blocking.
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


def test_a_group_spanning_racks_shares_the_uplinks_among_the_streams_that_leave():
    c = topology(nodes_per_rack=2, rack_oversubscription=4, racks_per_pod=2,
                 spine_oversubscription=7)
    assert c.link_for(8, 1) is FAST
    assert c.link_for(16, 1) is SLOW  # two nodes, one rack
    assert c.link_for(2, 8) is SLOW
    # ranks 0-31, two racks: each rack's 16 members leave it on one node's 8 NICs, through
    # uplinks of 16 / 4 GPUs' bandwidth: overloaded 2x
    rack = c.link_for(32, 1)
    assert rack.bandwidth == 10 * GB / 2 and rack.latency == SLOW.latency
    # ranks 0, 8, 16, 24 (and the 7 other such groups): 2 members a rack, each group leaving
    # on one NIC, 8 groups a rack: 8 streams through 16 / 4: 2x
    assert c.link_for(4, 8).bandwidth == 10 * GB / 2
    # one member per rack (ranks 0 and 16): every GPU's stream leaves, the whole ratio
    assert c.link_for(2, 16).bandwidth == 10 * GB / 4
    # ranks 0, 16, 32, 48 across both pods: 2 members a pod, one stream each, through
    # 32 / 28: 14x
    assert c.link_for(4, 16).bandwidth == pytest.approx(10 * GB / 14)
    # all 64 ranks, two pods: a pod's 32 members leave it on 8 NICs, through uplinks of
    # 32 / (4 x 7): 7x, more than the rack's 2x
    assert c.link_for(64, 1).bandwidth == pytest.approx(10 * GB / 7)
    # ranks 0 and 32: each in a pod of its own, both ratios
    assert c.link_for(2, 32).bandwidth == pytest.approx(10 * GB / 28)


@pytest.mark.parametrize("stride, domain, ratio, overload", [
    (1, 16, 7, 3.5),       # contiguous groups, two nodes of 8 a domain: 8 of 16 GPUs' streams
    (8, 16, 7, 3.5),       # one member per node: 2 a domain, 8 groups of one stream each
    (16, 16, 7, 7),        # one member per domain: the whole ratio
    (1, 3072, 7, 1),       # a pod of 3,072 contiguous: one node's NICs leave, far below capacity
    (512, 3072, 7, 7 / 6), # a pipeline's stages of 512 GPUs: 6 of them in a pod
    (128, 3072, 7, 1),     # 24 members a pod, one stream each
    (2, 16, 1, 1),         # non-blocking: never an overload
])
def test_uplink_overload_is_the_ratio_times_streams_over_members(stride, domain, ratio,
                                                                 overload):
    c = Cluster(make_cluster("H100-SXM", 1).gpu, 8 * 3072, 8, FAST, SLOW)
    assert c.uplink_overload(stride, domain, ratio) == pytest.approx(overload)


def test_rack_ratio_without_pods_applies_to_every_rack_crossing():
    c = topology(nodes_per_rack=2, rack_oversubscription=3)
    assert c.link_for(64, 1).bandwidth == pytest.approx(10 * GB / 1.5)  # 8 of 16 streams leave
    assert c.link_for(4, 16).bandwidth == pytest.approx(10 * GB / 3)  # all leave
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


def test_data_parallel_reduction_across_racks_is_priced_on_the_overloaded_uplinks():
    """llama3-8b, 64-way data parallel on 8 nodes: the gradient all-reduce spans every rack of
    2 nodes at 1:7; each rack's ring leaves it on one node's 8 NICs, half its GPUs' streams,
    so the all-reduce runs at 2/7 of the bandwidth."""
    m = PRESETS["llama3-8b"]
    flat = make_cluster("H100-SXM", 64, 8)
    racked = Cluster(flat.gpu, 64, 8, flat.intra, flat.inter, nodes_per_rack=2,
                     rack_oversubscription=7)
    lay = Layout(dp_replicate=64, micro_batch=1, microbatches=1)
    costs = {}
    for name, cluster in (("flat", flat), ("racked", racked)):
        costs[name] = CostModel(m, seq_len=4096, global_batch=64, cluster=cluster).evaluate(lay)
    slow = Link("x", flat.inter.bandwidth / 3.5, flat.inter.latency, flat.inter.efficiency)
    assert costs["racked"].comm["dp"] == pytest.approx(
        allreduce_time(parameter_count(m) * 4, 64, slow))
    assert costs["racked"].comm["dp"] > 3 * costs["flat"].comm["dp"]
    assert costs["racked"].step_time > costs["flat"].step_time


def test_a_pipeline_spanning_pods_pays_only_for_its_stages_at_the_pod_edge():
    """Llama 3's network (16 GPUs a rack, 192 racks a pod, 1:7 above the pods), 16 stages of
    512 GPUs on 8,192: a pod holds 6 stages, so its uplinks carry 512 of its 3,072 GPUs'
    sends: 7/6 overloaded, not 7."""
    c = make_cluster("H100-SXM", 8192, 8, network={"nodes_per_rack": 2, "racks_per_pod": 192,
                                                   "spine_oversubscription": 7})
    assert c.link_for(16, 512).bandwidth == pytest.approx(c.inter.bandwidth * 6 / 7)
    assert c.link_for(64, 8) is c.inter  # a data-parallel group inside one pod


def test_a_hardware_file_describes_the_topology(tmp_path):
    path = tmp_path / "hw.toml"
    path.write_text('[cluster]\nnodes_per_rack = 2\nrack_oversubscription = 1\n'
                    'racks_per_pod = 24\nspine_oversubscription = 7\n')
    c = make_cluster("H100-SXM", 1024, 8, catalog=load_catalog(path))
    assert (c.nodes_per_rack, c.racks_per_pod, c.spine_oversubscription) == (2, 24, 7.0)
    assert c.link_for(384, 1) is c.inter  # one pod of 24 racks of 2 nodes: non-blocking
    # two pods: one node's 8 NICs leave a pod of 384 GPUs, far below its 384 / 7
    assert c.link_for(768, 1) is c.inter
    # one member per pod (stride 384): every stream leaves, the whole 1:7
    assert c.link_for(2, 384).bandwidth == pytest.approx(c.inter.bandwidth / 7)
    path.write_text('[cluster]\nnodes_per_rack = "two"\n')
    with pytest.raises(HardwareError, match="cluster.nodes_per_rack"):
        make_cluster("H100-SXM", 64, 8, catalog=load_catalog(path))
    for ratio in ("0.5", "1e308"):  # 1e308: the uplink's bandwidth underflowed to zero
        path.write_text(f'[cluster]\nnodes_per_rack = 1\nrack_oversubscription = {ratio}\n')
        with pytest.raises(HardwareError, match=r"rack_oversubscription.*in \[1, 1000\]"):
            make_cluster("H100-SXM", 64, 8, catalog=load_catalog(path))
