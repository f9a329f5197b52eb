"""Emulated links on one machine: each rank in its own network namespace, its traffic to every
other rank shaped to the cluster description's bandwidth (issue 18 item 2, issue 19 item 3).

The network, made by ``EmulatedNetwork`` (root only; ``ip`` and ``tc`` from iproute2):

* one namespace per rank (``<prefix><rank>``) holding ``eth0`` with address ``10.213.0.<rank+1>``,
  and one *switch* namespace holding a bridge that every rank's veth pair plugs into. A bridge
  rather than a veth pair per rank pair, because gloo binds one interface
  (``GLOO_SOCKET_IFNAME=eth0``) and gives its peers that one address.
* on each ``eth0``, an HTB qdisc with one class per destination rank at the rate of the link
  ``cluster.link(src, dst)`` (a u32 filter on the destination address picks it): every directed
  link is shaped at its sender. HTB, not a TBF per interface as the issue first suggested: TBF
  shapes the whole interface, which gives every destination the same rate, and a cluster of two
  regions needs fast links inside a region and slow ones across on the same interface.
* Latency is not emulated by the kernel: it has no ``netem``, and the ring collectives run
  inside gloo, where no software delay can be added per message. SkipPipe's pipeline messages
  get it in software instead (``loom.pipeline.paths_runtime.emulated_link_time``: delivered
  no earlier than the link's latency + bytes / bandwidth after they were sent, the send time
  travelling with the message; the stage replicas' gradient all-reduce waits 2(R-1) latencies),
  from the cluster the workers read from ``CLUSTER_ENV``. Other collectives and the ordinary
  pipeline run without it; the emulation says so when it starts (``describe``).

Compute: a node's ``compute`` factor (its speed relative to the others) becomes a slowdown of
that rank's forward and backward pieces: after each one it sleeps ``(1/speed - 1)`` times what the
piece took, speeds taken relative to the fastest node (a device cannot be made faster).
``compute_speeds`` writes them for ``COMPUTE_ENV``; ``loom.train.distributed`` reads this rank's.

A worker joins its namespace with ``enter_namespace`` *after* connecting to the launcher's TCP
store in the root namespace (a connected socket keeps its namespace) and *before* creating its
gloo group, whose sockets then live in the namespace. Namespaces are removed on exit, also after
an error; ``EmulationUnavailable`` says why none could be made (not root, no ``ip``, no netns).
Ground floor: no torch.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import uuid
from typing import Sequence

from loom.cluster import Cluster, parse

NAMESPACE_ENV = "LOOM_EMULATED_NETNS"  # the launcher's namespace prefix, read by each worker
COMPUTE_ENV = "LOOM_EMULATED_COMPUTE"  # every rank's relative speed, comma-separated
CLUSTER_ENV = "LOOM_EMULATED_CLUSTER"  # the emulated cluster's description (TOML text)
INTERFACE = "eth0"
SUBNET = "10.213.0"
_CLONE_NEWNET = 0x40000000


class EmulationUnavailable(RuntimeError):
    """Network namespaces cannot be made here; the message says why."""


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise EmulationUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


class EmulatedNetwork:
    """The namespaces, bridge and shaped links of ``cluster`` (one node per rank); a context
    manager that removes them on exit."""

    def __init__(self, cluster: Cluster, prefix: str | None = None) -> None:
        if cluster.size > 250:
            raise ValueError(f"at most 250 emulated ranks ({SUBNET}.0/24), not {cluster.size}")
        self.cluster = cluster
        self.prefix = prefix or f"loom{uuid.uuid4().hex[:6]}-"
        self.switch = f"{self.prefix}sw"
        self._made: list[str] = []

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    @staticmethod
    def address(rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self) -> EmulatedNetwork:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        if os.geteuid() != 0:
            raise EmulationUnavailable("network namespaces need root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise EmulationUnavailable(f"`{tool}` (iproute2) is not installed")
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for rank in range(self.cluster.size):
            ns = self.namespace(rank)
            self._add_namespace(ns)
            port = f"p{rank}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", INTERFACE,
                "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", INTERFACE)
            _ip("-n", ns, "link", "set", INTERFACE, "up")
            self._shape(rank)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, src: int) -> None:
        """HTB on ``src``'s eth0: one class per destination at that link's rate."""
        ns = self.namespace(src)
        tc = ["ip", "netns", "exec", ns, "tc"]
        fastest = max(self.cluster.link(src, dst).bytes_per_s
                      for dst in range(self.cluster.size) if dst != src) \
            if self.cluster.size > 1 else self.cluster.default.bytes_per_s
        _run([*tc, "qdisc", "add", "dev", INTERFACE, "root", "handle", "1:", "htb", "default",
              "1"])
        _run([*tc, "class", "add", "dev", INTERFACE, "parent", "1:", "classid", "1:1", "htb",
              *_rate(fastest)])  # anything unmatched (ARP): the fastest link's rate
        for dst in range(self.cluster.size):
            if dst == src:
                continue
            classid = f"1:{dst + 10}"
            _run([*tc, "class", "add", "dev", INTERFACE, "parent", "1:", "classid", classid,
                  "htb", *_rate(self.cluster.link(src, dst).bytes_per_s)])
            _run([*tc, "filter", "add", "dev", INTERFACE, "parent", "1:", "protocol", "ip",
                  "prio", "1", "u32", "match", "ip", "dst", f"{self.address(dst)}/32",
                  "flowid", classid])

    def destroy(self) -> None:
        """Remove every namespace made (their veths and qdiscs go with them)."""
        while self._made:
            subprocess.run(["ip", "netns", "del", self._made.pop()], capture_output=True)

    def describe(self) -> str:
        """One line for the log: what is emulated and what is not."""
        rates = sorted({round(self.cluster.link(a, b).gbit, 6) for a in range(self.cluster.size)
                        for b in range(self.cluster.size) if a != b})
        shown = ", ".join(f"{r:g}" for r in rates) or f"{self.cluster.default.gbit:g}"
        speeds = compute_speeds(self.cluster)
        slowed = "" if set(speeds.split(",")) == {"1.0"} else f"; rank speeds {speeds}"
        return (f"emulated network: {self.cluster.size} ranks in namespaces {self.prefix}*, links"
                f" shaped to {shown} Gbit/s (HTB per destination){slowed}; link latencies"
                " emulated only for skippipe's pipeline messages and stage all-reduce (in"
                " software; no netem, and gloo's collectives cannot be delayed from outside)")


def _rate(bytes_per_s: float) -> list[str]:
    """HTB rate and bursts for ``bytes_per_s``: a burst of at least 1 ms at that rate (and 64 KB),
    so that segmentation offload's large packets do not starve a fast class."""
    bits = max(8, int(bytes_per_s * 8))
    burst = max(64 * 1024, int(bytes_per_s / 1000))
    return ["rate", f"{bits}bit", "ceil", f"{bits}bit", "burst", str(burst), "cburst", str(burst)]


def compute_speeds(cluster: Cluster) -> str:
    """``COMPUTE_ENV``'s value: each rank's speed relative to the fastest node."""
    fastest = max(node.compute for node in cluster.nodes)
    return ",".join(f"{node.compute / fastest!r}" for node in cluster.nodes)


def compute_speed_of(value: str, rank: int) -> float:
    """This rank's relative speed from ``COMPUTE_ENV``'s value (1.0: full speed)."""
    speeds = [float(part) for part in value.split(",")]
    if not 0 <= rank < len(speeds) or not 0 < speeds[rank] <= 1:
        raise ValueError(f"{COMPUTE_ENV}={value!r} gives no speed in (0, 1] for rank {rank}")
    return speeds[rank]


def cluster_of(value: str) -> Cluster:
    """The cluster ``CLUSTER_ENV``'s value describes (``Cluster.to_toml``'s text): workers
    read it to plan for the cluster they run on (SkipPipe's path scheduler)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return parse(tomllib.loads(value))


def enter_namespace(name: str) -> None:
    """Move the calling thread (and every thread it starts later) into network namespace
    ``name``, made by ``ip netns add``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


__all__ = ["EmulatedNetwork", "EmulationUnavailable", "enter_namespace", "compute_speeds",
           "compute_speed_of", "cluster_of", "NAMESPACE_ENV", "COMPUTE_ENV", "CLUSTER_ENV",
           "INTERFACE"]
