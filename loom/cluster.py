"""A cluster description: devices of unequal speed and memory joined by links of unequal latency
and bandwidth, from a TOML file or a generator (issue 18 item 1; issues 19 and 21 read it too).

One ``Node`` is one device, so one rank: the emulation (``loom.emulate``) puts each rank in its
own network namespace, and a simulator pricing a pipeline over the cluster asks ``link(i, j)``
for the hop between the devices of two stages. Ground floor: no torch, nothing of Loom's above
``loom.errors``.

The file::

    [defaults]                 # every pair of nodes no [[link]] names
    latency_ms = 0.01
    bandwidth_gbit = 100

    [[node]]                   # once per device, in rank order
    name = "us-0"
    compute = 1.0              # relative speed: 0.5 is twice as slow as 1.0 (the reference)
    memory_gb = 80             # 0: unknown
    region = "us"              # optional; the generator's links follow it

    [[link]]                   # both directions, unless "from"/"to" name one direction
    between = ["us-0", "eu-0"]
    latency_ms = 40
    bandwidth_gbit = 0.1       # 100 Mbit/s

``regions([2, 2], intra=..., inter=...)`` writes the common shape directly: groups of devices
with fast links inside a region and slow ones between regions. Every bad value is a
``ConfigError`` naming the field (``cluster.node[1].compute``) and the rule.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from loom.errors import ConfigError, InputFileError, loads_toml, read_input_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Link:
    """One direction of a link: a message of b bytes takes ``latency_s + b / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    @property
    def gbit(self) -> float:
        return self.bytes_per_s * 8 / 1e9

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class Node:
    name: str
    compute: float = 1.0  # relative speed; a step's compute takes 1/compute of the reference's
    memory_gb: float = 0.0  # 0: unknown
    region: str = ""


@dataclass(frozen=True)
class Cluster:
    """Nodes in rank order and the link of every ordered pair (``default`` where none is set)."""

    nodes: tuple[Node, ...]
    default: Link
    links: dict[tuple[int, int], Link] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.nodes)

    def link(self, src: int, dst: int) -> Link:
        """The link a message from rank ``src`` to rank ``dst`` crosses."""
        if src == dst:
            raise ValueError(f"no link from rank {src} to itself")
        return self.links.get((src, dst), self.default)

    def slowest_link(self, ranks: Sequence[int]) -> Link:
        """The pair of ``ranks`` with the least bandwidth (a ring collective's pace)."""
        pairs = [self.link(a, b) for a in ranks for b in ranks if a != b]
        return min(pairs, key=lambda link: (link.bytes_per_s, -link.latency_s))

    def check_world(self, world_size: int, field_name: str = "cluster") -> None:
        if self.size != world_size:
            raise ConfigError(field_name, f"{self.size} nodes",
                              f"must describe one node per rank: the world has {world_size}")

    def to_toml(self) -> str:
        """The file that ``load`` reads back to this cluster (every non-default link written)."""
        lines = ["[defaults]", f"latency_ms = {self.default.latency_s * 1e3!r}",
                 f"bandwidth_gbit = {self.default.gbit!r}", ""]
        for node in self.nodes:
            lines += ["[[node]]", f'name = "{node.name}"', f"compute = {node.compute!r}",
                      f"memory_gb = {node.memory_gb!r}"]
            if node.region:
                lines.append(f'region = "{node.region}"')
            lines.append("")
        for (src, dst), link in sorted(self.links.items()):
            lines += ["[[link]]", f'from = "{self.nodes[src].name}"',
                      f'to = "{self.nodes[dst].name}"', f"latency_ms = {link.latency_s * 1e3!r}",
                      f"bandwidth_gbit = {link.gbit!r}", ""]
        return "\n".join(lines)


def _finite(value: float) -> bool:
    """Whether ``value`` is a finite float, or an int that converts to one (TOML's integers
    have no bound: 1 followed by 400 zeros overflows the conversion)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(table: dict[str, Any], key: str, where: str, *, positive: bool,
            default: float | None = None) -> float:
    if key not in table:
        if default is None:
            raise ConfigError(f"{where}.{key}", None, "is required")
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ConfigError(f"{where}.{key}", value, "must be a finite number")
    if positive and value <= 0:
        raise ConfigError(f"{where}.{key}", value, "must be > 0")
    if value < 0:
        raise ConfigError(f"{where}.{key}", value, "must be >= 0")
    return float(value)


def _link(table: dict[str, Any], where: str, fallback: Link | None = None) -> Link:
    latency = _number(table, "latency_ms", where, positive=False,
                      default=None if fallback is None else fallback.latency_s * 1e3)
    gbit = _number(table, "bandwidth_gbit", where, positive=True,
                   default=None if fallback is None else fallback.gbit)
    return Link(latency / 1e3, gbit * 1e9 / 8)


def _unknown_keys(table: dict[str, Any], known: set[str], where: str) -> None:
    for key in table:
        if key not in known:
            raise ConfigError(f"{where}.{key}", table[key],
                              f"unknown key; known: {', '.join(sorted(known))}")


def parse(data: dict[str, Any]) -> Cluster:
    """A cluster from the parsed TOML tables (module docstring), every rule checked."""
    _unknown_keys(data, {"defaults", "node", "link"}, "cluster")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise ConfigError("cluster.defaults", defaults, "must be a table")
    _unknown_keys(defaults, {"latency_ms", "bandwidth_gbit"}, "cluster.defaults")
    default = _link(defaults, "cluster.defaults")
    raw_nodes = data.get("node", [])
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ConfigError("cluster.node", raw_nodes, "must be one or more [[node]] tables")
    nodes, index = [], {}
    for i, table in enumerate(raw_nodes):
        where = f"cluster.node[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(where, table, "must be a table")
        _unknown_keys(table, {"name", "compute", "memory_gb", "region"}, where)
        name = table.get("name", f"node{i}")
        if not isinstance(name, str) or not name.isprintable() or not name:
            raise ConfigError(f"{where}.name", name, "must be a non-empty printable string")
        if name in index:
            raise ConfigError(f"{where}.name", name, f"repeats node {index[name]}'s name")
        region = table.get("region", "")
        if not isinstance(region, str):
            raise ConfigError(f"{where}.region", region, "must be a string")
        index[name] = i
        nodes.append(Node(name, _number(table, "compute", where, positive=True, default=1.0),
                          _number(table, "memory_gb", where, positive=False, default=0.0),
                          region))
    links: dict[tuple[int, int], Link] = {}
    raw_links = data.get("link", [])
    if not isinstance(raw_links, list):
        raise ConfigError("cluster.link", raw_links, "must be [[link]] tables")
    for i, table in enumerate(raw_links):
        where = f"cluster.link[{i}]"
        if not isinstance(table, dict):
            raise ConfigError(where, table, "must be a table")
        _unknown_keys(table, {"between", "from", "to", "latency_ms", "bandwidth_gbit"}, where)
        if "between" in table:
            pair = table["between"]
            if "from" in table or "to" in table:
                raise ConfigError(where, table, "takes between = [a, b] or from/to, not both")
            if not isinstance(pair, list) or len(pair) != 2:
                raise ConfigError(f"{where}.between", pair, "must be two node names")
            ends, both = pair, True
        else:
            ends, both = [table.get("from"), table.get("to")], False
        ranks = []
        for end in ends:
            if not isinstance(end, str) or end not in index:
                raise ConfigError(where, end, f"names no node; nodes: {', '.join(index)}")
            ranks.append(index[end])
        if ranks[0] == ranks[1]:
            raise ConfigError(where, ends, "joins a node to itself")
        link = _link(table, where, fallback=default)
        links[(ranks[0], ranks[1])] = link
        if both:
            links[(ranks[1], ranks[0])] = link
    return Cluster(tuple(nodes), default, links)


def load(path: str | Path) -> Cluster:
    """Read and check a cluster file (``ConfigError`` names what is wrong, the file included)."""
    path = Path(path)
    try:
        text = read_input_text(path)
    except InputFileError as err:
        raise ConfigError("cluster", str(path), err.rule) from None
    try:
        data = loads_toml(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("cluster", str(path), f"is not valid TOML: {err}") from None
    return parse(data)


def regions(sizes: Sequence[int], *, intra: Link, inter: Link,
            compute: Sequence[float] | None = None, memory_gb: float = 0.0) -> Cluster:
    """Regions of ``sizes[r]`` nodes each (named ``r<r>-<i>``): ``intra`` links inside a region,
    ``inter`` between regions; ``compute`` gives each region's relative speed (default 1)."""
    if not sizes or any(n < 1 for n in sizes):
        raise ConfigError("cluster.regions", list(sizes), "must be one or more positive sizes")
    speeds = list(compute) if compute is not None else [1.0] * len(sizes)
    if len(speeds) != len(sizes) or any(not s > 0 for s in speeds):
        raise ConfigError("cluster.compute", speeds, "must give one positive speed per region")
    nodes = [Node(f"r{r}-{i}", speeds[r], memory_gb, f"r{r}")
             for r, n in enumerate(sizes) for i in range(n)]
    links = {(a, b): inter for a in range(len(nodes)) for b in range(len(nodes))
             if a != b and nodes[a].region != nodes[b].region}
    return Cluster(tuple(nodes), intra, links)


__all__ = ["Cluster", "Link", "Node", "load", "parse", "regions"]
