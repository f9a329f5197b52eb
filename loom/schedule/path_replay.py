"""Replay a set of microbatch paths on a cluster: when each forward and backward runs, and the
iteration's makespan (SkipPipe, issue 18).

Every (stage, replica) runs on one node of a ``loom.cluster.Cluster`` (``allocation``). A path's
forward visits run in path order, its backward visits in reverse; a node runs one visit at a time
and a message crosses a link. The model:

* a visit of stage s takes ``forward_s[s] / compute`` forward and ``backward_factor`` times that
  backward, ``compute`` the node's relative speed;
* each hop between two different nodes carries ``activation_bytes`` (the activation forward, its
  gradient backward): the directed link is busy for ``bytes / bandwidth`` (messages on one link
  queue behind each other) and the message lands ``latency`` after it leaves; on one node there
  is no message;
* a free node starts, among the visits whose input has arrived, a backward before a forward,
  then the lowest microbatch (non-preemptive list scheduling; nothing waits for a visit that
  has not arrived);
* after its last backward, each stage's replicas average their gradients: a ring all-reduce of
  ``gradient_bytes[s]`` over the replicas' nodes, paced by the slowest link among them. The
  iteration ends when every reduction has.

It is an event simulation, not the list-scheduling IR of ``loom.schedule.simulate``: a path set
has no per-rank action order to replay, the order is what the nodes decide as messages arrive.
Torch-free, floor 1.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loom.cluster import Cluster, Link, Node
from loom.schedule.paths import PathSet

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class PathCosts:
    """Per-microbatch costs at compute factor 1.0: forward seconds per stage, the backward as a
    multiple of it, bytes per hop, and each stage's gradient bytes (0: no replica reduction)."""

    forward_s: tuple[float, ...]
    activation_bytes: float
    backward_factor: float = 2.0
    gradient_bytes: tuple[float, ...] = ()

    @classmethod
    def uniform(cls, num_stages: int, forward_s: float, activation_bytes: float,
                gradient_bytes: float = 0.0, backward_factor: float = 2.0) -> PathCosts:
        return cls((forward_s,) * num_stages, activation_bytes, backward_factor,
                   (gradient_bytes,) * num_stages)


@dataclass(frozen=True)
class Task:
    """One visit's forward or backward: microbatch, index of the visit in its path, op."""

    microbatch: int
    index: int
    op: str


@dataclass
class Replay:
    """When every task ran: ``spans[task] = (node, start, end)``; ``makespan`` includes the
    replicas' gradient averaging."""

    spans: dict[Task, tuple[int, float, float]] = field(default_factory=dict)
    makespan: float = 0.0
    backward_end: float = 0.0
    finishes: list[float] = field(default_factory=list)  # per microbatch: its last backward

    def busy(self, node: int) -> list[tuple[float, float]]:
        """The intervals ``node`` computes, sorted."""
        return sorted((s, e) for n, s, e in self.spans.values() if n == node)

    def finish(self, microbatch: int) -> float:
        return self.finishes[microbatch]


def allreduce_time(cluster: Cluster, nodes: Sequence[int], nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``nodes``: 2(n-1) steps of nbytes/n over the
    slowest link among them (0 for one node)."""
    n = len(set(nodes))
    if n < 2 or nbytes <= 0:
        return 0.0
    link = cluster.slowest_link(sorted(set(nodes)))
    return 2 * (n - 1) * link.time(nbytes / n)


def replay_paths(paths: PathSet, cluster: Cluster, allocation: Mapping[tuple[int, int], int],
                 costs: PathCosts) -> Replay:
    """Simulate ``paths`` (module docstring); ``allocation[(stage, replica)]`` is the node."""
    num_stages = paths.num_stages
    if len(costs.forward_s) != num_stages:
        raise ValueError(f"{len(costs.forward_s)} stage costs for {num_stages} stages")
    for s in range(num_stages):
        for r in range(paths.num_replicas):
            if (s, r) not in allocation or not 0 <= allocation[s, r] < cluster.size:
                raise ValueError(f"stage {s} replica {r} has no node of the cluster's "
                                 f"{cluster.size}")

    where = [[allocation[v.stage, v.replica] for v in p.visits] for p in paths.paths]
    forward = [[costs.forward_s[v.stage] / cluster.nodes[where[m][k]].compute
                for k, v in enumerate(p.visits)] for m, p in enumerate(paths.paths)]

    def node_of(task: Task) -> int:
        return where[task.microbatch][task.index]

    def duration(task: Task, node: int) -> float:
        base = forward[task.microbatch][task.index]
        return base if task.op == FORWARD else base * costs.backward_factor

    result = Replay()
    link_free: dict[tuple[int, int], float] = {}
    node_free = [0.0] * cluster.size
    ready: list[list[tuple[int, int, int, Task]]] = [[] for _ in range(cluster.size)]
    events: list[tuple[float, int, int, object]] = []  # (time, kind, seq, payload)
    seq = 0
    ARRIVE, KICK = 0, 1  # arrivals at a time are all seen before a node picks

    def push(time: float, kind: int, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (time, kind, seq, payload))
        seq += 1

    def arrive(task: Task, src: int, time: float) -> None:
        dst = node_of(task)
        if src != dst and src >= 0:
            link = cluster.link(src, dst)
            start = max(time, link_free.get((src, dst), 0.0))
            link_free[src, dst] = start + costs.activation_bytes / link.bytes_per_s
            time = start + link.time(costs.activation_bytes)
        push(time, ARRIVE, task)

    result.finishes = [0.0] * paths.num_microbatches
    stage_done = [0.0] * num_stages  # each stage's last backward, on any replica
    for m in range(paths.num_microbatches):
        arrive(Task(m, 0, FORWARD), -1, 0.0)
    while events:
        time, kind, _, payload = heapq.heappop(events)
        if kind == ARRIVE:
            task = payload  # type: ignore[assignment]
            node = node_of(task)
            heapq.heappush(ready[node], (0 if task.op == BACKWARD else 1, task.microbatch,
                                         task.index, task))
            if node_free[node] <= time:  # a busy node picks when it frees (its own KICK)
                push(time, KICK, node)
            continue
        node = payload  # type: ignore[assignment]
        if node_free[node] > time or not ready[node]:
            continue
        *_, task = heapq.heappop(ready[node])
        end = time + duration(task, node)
        node_free[node] = end
        result.spans[task] = (node, time, end)
        push(end, KICK, node)
        length = len(paths.paths[task.microbatch].visits)
        if task.op == FORWARD:
            nxt = (Task(task.microbatch, task.index + 1, FORWARD) if task.index + 1 < length
                   else Task(task.microbatch, task.index, BACKWARD))
        else:
            nxt = Task(task.microbatch, task.index - 1, BACKWARD) if task.index else None
            stage = paths.paths[task.microbatch].visits[task.index].stage
            stage_done[stage] = max(stage_done[stage], end)
            result.finishes[task.microbatch] = max(result.finishes[task.microbatch], end)
        if nxt is not None:
            arrive(nxt, node, end)
    expected = 2 * sum(len(p) for p in paths.paths)
    if len(result.spans) != expected:  # cannot happen: every task's input eventually arrives
        raise AssertionError(f"replayed {len(result.spans)} of {expected} tasks")
    result.backward_end = max((e for _, _, e in result.spans.values()), default=0.0)
    makespan = result.backward_end
    grads = costs.gradient_bytes or (0.0,) * num_stages
    for s in range(num_stages):
        nodes = [allocation[s, r] for r in range(paths.num_replicas)]
        makespan = max(makespan, stage_done[s] + allreduce_time(cluster, nodes, grads[s]))
    result.makespan = makespan
    return result


def execution_orders(paths: PathSet, replay: Replay | None = None
                     ) -> dict[tuple[int, int], list[Task]]:
    """(stage, replica) -> the forwards and backwards it runs, in the order ``replay`` ran them
    (default: a replay with one node per replica, equal speeds and free links).

    A runtime that runs each replica's list in this order, sending asynchronously and receiving
    just before use, cannot deadlock: the replay is one execution that respects every
    dependency, so every receive's message was sent earlier in it."""
    if replay is None:
        replicas = paths.num_replicas
        cluster = Cluster(tuple(Node(f"n{i}") for i in range(paths.num_stages * replicas)),
                          Link(0.0, 1e30))
        replay = replay_paths(paths, cluster, {(s, r): s * replicas + r
                                               for s in range(paths.num_stages)
                                               for r in range(replicas)},
                              PathCosts.uniform(paths.num_stages, 1.0, 0.0))
    orders: dict[tuple[int, int], list[tuple[float, Task]]] = {
        (s, r): [] for s in range(paths.num_stages) for r in range(paths.num_replicas)}
    for task, (_, start, _) in replay.spans.items():
        visit = paths.paths[task.microbatch].visits[task.index]
        orders[visit.stage, visit.replica].append((start, task))
    return {key: [task for _, task in sorted(rows, key=lambda e: (e[0], e[1].op != BACKWARD,
                                                                   e[1].microbatch))]
            for key, rows in orders.items()}


__all__ = ["BACKWARD", "FORWARD", "PathCosts", "Replay", "Task", "allreduce_time",
           "execution_orders", "replay_paths"]
