"""Emulated links (``loom.emulate``): ranks in network namespaces, each directed link shaped to
the cluster description's bandwidth, and gloo running over them.

* Shaping per destination: in a two-region cluster, rank 0 sends to rank 1 (same region, 2
  Gbit/s) and to rank 2 (other region, 0.1 Gbit/s) through the same interface; each transfer
  runs at its own link's rate (within 30%).
* gloo over the emulated network: two worker processes join their namespaces after connecting
  to a TCP store in the root namespace; an all-reduce of 4 MB over a 0.2 Gbit/s link takes at
  least 0.7x of what the link's rate allows (a ring all-reduce of two ranks sends the whole
  tensor each way), and gives the right sum.
* The namespaces are gone afterwards.

Needs root and iproute2 (skipped otherwise).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import subprocess
import threading
import time

import pytest

from loom.cluster import Cluster, Link, Node, regions
from loom.emulate import INTERFACE, EmulatedNetwork, EmulationUnavailable, enter_namespace


def _namespaces_work() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"loomprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


pytestmark = pytest.mark.skipif(not _namespaces_work(), reason="needs root and network namespaces")
GBIT = 1e9 / 8  # bytes per second


def _receive(network: EmulatedNetwork, rank: int, port: int, ready: threading.Event,
             received: list[int]) -> None:
    enter_namespace(network.namespace(rank))
    with socket.socket() as server:
        server.bind((network.address(rank), port))
        server.listen(1)
        ready.set()
        conn, _ = server.accept()
        with conn:
            total = 0
            while chunk := conn.recv(1 << 16):
                total += len(chunk)
            received.append(total)


def _send_seconds(network: EmulatedNetwork, src: int, dst: int, nbytes: int) -> float:
    """Seconds for ``nbytes`` from rank ``src`` to rank ``dst`` over one TCP connection."""
    port = 7000 + dst
    ready, received, timing = threading.Event(), [], []
    receiver = threading.Thread(target=_receive, args=(network, dst, port, ready, received))
    receiver.start()
    assert ready.wait(10)

    def send() -> None:
        enter_namespace(network.namespace(src))
        with socket.create_connection((network.address(dst), port), timeout=30) as conn:
            payload = b"x" * nbytes
            start = time.perf_counter()
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # the receiver closes once it has everything
            timing.append(time.perf_counter() - start)

    sender = threading.Thread(target=send)
    sender.start()
    sender.join(60)
    receiver.join(60)
    assert received == [nbytes]
    return timing[0]


def test_each_directed_link_runs_at_its_own_rate():
    cluster = regions([2, 1], intra=Link(0.0, 2 * GBIT), inter=Link(0.0, 0.1 * GBIT))
    with EmulatedNetwork(cluster) as network:
        nbytes = 2_000_000
        near = 10 * nbytes / _send_seconds(network, 0, 1, 10 * nbytes)
        far = nbytes / _send_seconds(network, 0, 2, nbytes)
    print(f"near {near * 8 / 1e9:.3f} Gbit/s (2), far {far * 8 / 1e9:.3f} Gbit/s (0.1)")
    assert 0.7 * 0.1 * GBIT <= far <= 1.3 * 0.1 * GBIT, f"far link ran at {far * 8 / 1e9:.3f} Gbit/s"
    assert 0.5 * 2 * GBIT <= near <= 1.3 * 2 * GBIT, f"near link ran at {near * 8 / 1e9:.3f} Gbit/s"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert network.prefix not in left


def _all_reduce_in_namespace(rank: int, prefix: str, port: int, numel: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    enter_namespace(f"{prefix}{rank}")
    os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    values = torch.full((numel,), float(rank + 1))
    dist.all_reduce(values)  # warm-up: connections made
    start = time.perf_counter()
    dist.all_reduce(values)
    seconds = time.perf_counter() - start
    out.put((rank, seconds, values[0].item()))
    dist.destroy_process_group()


def test_gloo_runs_over_the_emulated_link_at_its_rate():
    link = Link(0.0, 0.2 * GBIT)
    cluster = Cluster((Node("a"), Node("b")), link)
    numel = 1_000_000  # 4 MB of fp32
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.Queue()
    with EmulatedNetwork(cluster) as network:
        procs = [context.Process(target=_all_reduce_in_namespace,
                                 args=(rank, network.prefix, port, numel, out))
                 for rank in range(2)]
        for proc in procs:
            proc.start()
        results = sorted(out.get(timeout=120) for _ in procs)
        for proc in procs:
            proc.join(30)
    # 1 + 2 = 3 after the warm-up all-reduce, 3 + 3 = 6 after the timed one
    assert [value for _, _, value in results] == [6.0, 6.0]
    # each rank sends about the whole tensor once (reduce-scatter + all-gather, 2 ranks)
    least = 4 * numel / link.bytes_per_s
    seconds = max(s for _, s, _ in results)
    print(f"all-reduce of {4 * numel} B over {link.gbit} Gbit/s: {seconds:.3f} s (link: {least:.3f} s)")
    assert seconds >= 0.7 * least, f"{seconds:.3f} s, the link allows no less than {least:.3f} s"
    assert seconds <= 4 * least + 0.5, f"{seconds:.3f} s for a {least:.3f} s transfer"


def test_namespaces_need_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(EmulationUnavailable, match="root"):
        with EmulatedNetwork(Cluster((Node("a"), Node("b")), Link(0.0, GBIT))):
            pass
