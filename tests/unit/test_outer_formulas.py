"""The replica-link cost of sync data parallelism and the outer loops (``loom.formulas.outer``):
numbers worked out by hand, the relations between the modes, refusals by name, and no torch."""

import subprocess
import sys

import pytest

from loom.formulas.outer import replica_link_cost, ring_all_reduce_time_s

MB = 10**6
LINK = {"bandwidth_bytes_per_s": 12.5 * MB, "latency_s": 0.01}  # 100 Mbit/s, 10 ms


def test_sync_is_a_ring_all_reduce_every_step():
    # 4 replicas, 100 MB of gradients: each sends 2 * 3/4 * 100 MB = 150 MB per step, in
    # 6 hops * 10 ms + 150 MB / 12.5 MB/s = 0.06 + 12 s.
    cost = replica_link_cost("sync", message_bytes=100 * MB, replicas=4, **LINK)
    assert cost.bytes_per_step == 150 * MB
    assert cost.comm_time_per_step_s == pytest.approx(12.06)
    assert cost.exposed_time_per_step_s == cost.comm_time_per_step_s
    assert cost.syncs_per_step == 1.0


def test_diloco_moves_sync_volume_once_per_window():
    sync = replica_link_cost("sync", message_bytes=100 * MB, replicas=4, **LINK)
    diloco = replica_link_cost("diloco", message_bytes=100 * MB, replicas=4, outer_steps=8,
                               **LINK)
    assert diloco.bytes_per_step == sync.bytes_per_step / 8
    assert diloco.comm_time_per_step_s == pytest.approx(12.06 / 8)
    assert diloco.bytes_per_sync == 150 * MB
    assert diloco.syncs_per_step == 1 / 8


def test_streaming_keeps_the_bytes_and_divides_the_peak_message():
    whole = replica_link_cost("diloco", message_bytes=100 * MB, replicas=4, outer_steps=8,
                              **LINK)
    streamed = replica_link_cost("diloco", message_bytes=100 * MB, replicas=4, outer_steps=8,
                                 fragments=4, **LINK)
    assert streamed.bytes_per_step == pytest.approx(whole.bytes_per_step)
    assert streamed.bytes_per_sync == pytest.approx(whole.bytes_per_sync / 4)
    assert streamed.syncs_per_step == 4 / 8
    # four all-reduces pay four times the ring latency: 4 * 6 hops * 10 ms more per window
    # than the bandwidth term (12 s), i.e. (0.24 + 12) / 8 per step.
    assert streamed.comm_time_per_step_s == pytest.approx((0.24 + 12) / 8)


def test_noloco_sends_the_model_once_to_one_peer_whatever_the_replica_count():
    costs = [replica_link_cost("noloco", message_bytes=100 * MB, replicas=r, outer_steps=10,
                               **LINK) for r in (2, 3, 16, 1000)]
    assert {c.bytes_per_step for c in costs} == {10 * MB}
    # one hop: 10 ms + 100 MB / 12.5 MB/s = 8.01 s per window
    assert costs[-1].comm_time_per_step_s == pytest.approx(8.01 / 10)
    diloco = replica_link_cost("diloco", message_bytes=100 * MB, replicas=1000, outer_steps=10,
                               **LINK)
    assert diloco.comm_time_per_step_s > 2 * costs[-1].comm_time_per_step_s


def test_co2_hides_the_all_reduce_behind_the_window_compute():
    args = dict(message_bytes=100 * MB, replicas=4, outer_steps=8, **LINK)
    diloco = replica_link_cost("diloco", **args)
    hidden = replica_link_cost("co2", compute_time_per_step_s=2.0, **args)  # 16 s > 12.06 s
    partly = replica_link_cost("co2", compute_time_per_step_s=1.0, **args)  # 8 s < 12.06 s
    assert hidden.bytes_per_step == diloco.bytes_per_step
    assert hidden.comm_time_per_step_s == diloco.comm_time_per_step_s
    assert hidden.exposed_time_per_step_s == 0.0
    assert partly.exposed_time_per_step_s == pytest.approx((12.06 - 8.0) / 8)
    assert diloco.exposed_time_per_step_s == diloco.comm_time_per_step_s


def test_ring_time_of_two_replicas_is_one_send_each_way():
    # R = 2: 2 hops, each half the message: latency * 2 + M / B.
    assert ring_all_reduce_time_s(10 * MB, 2, 12.5 * MB, 0.01) == pytest.approx(0.02 + 0.8)


@pytest.mark.parametrize("kwargs, name", [
    (dict(mode="gossip"), "mode"),
    (dict(message_bytes=0), "message_bytes"),
    (dict(replicas=1), "replicas"),
    (dict(bandwidth_bytes_per_s=0), "bandwidth_bytes_per_s"),
    (dict(latency_s=-1), "latency_s"),
    (dict(outer_steps=0), "outer_steps"),
    (dict(fragments=2, mode="noloco"), "fragments"),
    (dict(fragments=9), "fragments"),
    (dict(compute_time_per_step_s=-1.0), "compute_time_per_step_s"),
])
def test_bad_input_is_refused_by_name(kwargs, name):
    args = dict(mode="diloco", message_bytes=MB, replicas=4, outer_steps=8, **LINK)
    with pytest.raises(ValueError, match=name):
        replica_link_cost(**{**args, **kwargs})


def test_imports_without_torch():
    code = "import sys, loom.formulas.outer; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
