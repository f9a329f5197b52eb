"""The path scheduler (SkipPipe, issue 18): choose every microbatch's path so the iteration's
makespan on a cluster is short and microbatches do not queue up on the same nodes.

The paper casts this as multi-agent path finding over nodes and time: each microbatch is an agent
that must go from the first stage to the last and back, visiting a prescribed number of stages,
and conflict-based search (CBS) over per-agent A* removes collisions (two microbatches on one
node at once) and broken constraints. Loom uses the other classic MAPF family, *prioritized
planning* (cooperative A*), plus a repair loop, with the same objective:

1. Microbatches are planned one at a time, in order. For microbatch i every stage order the rules
   allow (``loom.schedule.paths.stage_orders``: skip sets, swaps) that keeps the skips balanced
   is a candidate; for each, the replica of every visit is chosen by a shortest-path search over
   (visit, replica) on the time axis: the forward may only start in a gap of the node's
   reservation table (the visits already planned, replayed), a hop costs its link's latency and
   transfer time, and the backward's compute and hops are added. This is A* with a zero
   heuristic on a layered graph, exact for the forward against the reservations.
2. The few best candidates (by that estimate) are replayed in full with the planned ones
   (``loom.schedule.path_replay``: contention on links, backward-first nodes, the replicas'
   gradient averaging) and the one with the smallest makespan wins.
3. Repair (local search): each microbatch in turn is taken out and planned again against all
   the others, and every pair of microbatches trades stage orders (which keeps the skips
   balanced) with both re-routed; a change is kept only if the whole set's makespan falls. The
   repair runs from the prioritized plan and from a few random valid sets (restarts), and the
   best result wins.

Why not CBS: its branching over conflicts is exponential in the worst case and the paper's own
implementation caps it with hand-tuned limits; prioritized planning is polynomial
(m x orders x S x R^2 plus m x K replays), never fails to return a valid set, and the repair
loop recovers most of what a fixed priority order loses. The node memory limit of the paper's
throughput constraint (at most ``memory`` microbatches visit one node per iteration) is honoured
in step 1. Torch-free, floor 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loom.cluster import Cluster
from loom.schedule.path_replay import BACKWARD, PathCosts, Replay, replay_paths
from loom.schedule.paths import (Path, PathRules, PathSet, _fits, balance_bounds, check_paths,
                                 first_replica, full_paths, random_paths, stage_orders)


class _DeadEnd(ValueError):
    """Prioritized planning found no path for a microbatch."""


_RESTART_SEED = 1_000_003  # restarts draw other random sets than ``compare``'s baseline


@dataclass(frozen=True)
class _Plan:
    """A partial plan: the paths of some microbatches (None: not planned yet)."""

    paths: tuple[Path | None, ...]

    def with_path(self, microbatch: int, path: Path | None) -> _Plan:
        paths = list(self.paths)
        paths[microbatch] = path
        return _Plan(tuple(paths))


def _subset(plan: _Plan, num_stages: int, num_replicas: int) -> tuple[PathSet, list[int]]:
    """The planned paths as a PathSet (in microbatch order, which keeps the replay's priority
    order) and the microbatch each of its entries is."""
    index = [m for m, p in enumerate(plan.paths) if p is not None]
    return PathSet(num_stages, num_replicas, tuple(plan.paths[m] for m in index)), index


def _earliest_start(busy: Sequence[tuple[float, float]], ready: float, duration: float) -> float:
    """The first time >= ``ready`` when ``duration`` fits between the sorted ``busy`` intervals."""
    start = ready
    for begin, end in busy:
        if end <= start:
            continue
        if begin >= start + duration:
            break
        start = end
    return start


class PathScheduler:
    """Plans paths for ``rules`` on ``cluster`` with ``allocation[(stage, replica)] = node``."""

    def __init__(self, rules: PathRules, num_replicas: int, cluster: Cluster,
                 allocation: Mapping[tuple[int, int], int], costs: PathCosts, *,
                 memory: int | None = None, candidates: int = 3) -> None:
        self.rules, self.num_replicas = rules, num_replicas
        self.cluster, self.allocation, self.costs = cluster, dict(allocation), costs
        self.memory, self.candidates = memory, candidates
        self.orders = stage_orders(rules)

    # -- evaluation --------------------------------------------------------------------------------
    def replay(self, paths: PathSet) -> Replay:
        return replay_paths(paths, self.cluster, self.allocation, self.costs)

    def _score(self, plan: _Plan) -> tuple[float, float]:
        subset, _ = _subset(plan, self.rules.num_stages, self.num_replicas)
        replay = self.replay(subset)
        finishes = sum(replay.finish(m) for m in range(subset.num_microbatches))
        return replay.makespan, finishes

    # -- one microbatch ----------------------------------------------------------------------------
    def _hop(self, src: int, dst: int) -> float:
        return 0.0 if src == dst else self.cluster.link(src, dst).time(self.costs.activation_bytes)

    def _route(self, microbatch: int, order: Sequence[int],
               busy: Mapping[int, list[tuple[float, float]]], visits: Counter
               ) -> tuple[float, tuple[int, ...]] | None:
        """The replicas for ``order`` minimising (forward end against the reservations + the
        backward's compute and hops), or None when the memory limit leaves no node."""
        costs, nodes = self.costs, self.cluster.nodes
        first = first_replica(microbatch, self.num_replicas)
        layer: dict[int, tuple[float, float, tuple[int, ...]]] = {}
        for k, stage in enumerate(order):
            nxt: dict[int, tuple[float, float, tuple[int, ...]]] = {}
            for r in ([first] if k == 0 else range(self.num_replicas)):
                node = self.allocation[stage, r]
                if self.memory is not None and visits[node] >= self.memory:
                    continue
                forward = costs.forward_s[stage] / nodes[node].compute
                backward = forward * costs.backward_factor
                best = None
                for prev_r, (fwd_end, back, chosen) in (layer.items() if k else
                                                        [(r, (0.0, 0.0, ()))]):
                    prev = self.allocation[order[k - 1], prev_r] if k else node
                    hop = self._hop(prev, node)
                    start = _earliest_start(busy.get(node, ()), fwd_end + hop, forward)
                    entry = (start + forward, back + hop + backward, chosen + (r,))
                    if best is None or entry[0] + entry[1] < best[0] + best[1]:
                        best = entry
                if best is not None:
                    nxt[r] = best
            if not nxt:
                return None
            layer = nxt
        fwd_end, back, chosen = min(layer.values(), key=lambda e: (e[0] + e[1], e[2]))
        return fwd_end + back, chosen

    def _occupancy(self, plan: _Plan) -> tuple[Counter, dict[int, list[tuple[float, float]]]]:
        """What ``plan``'s paths so far take: visits per node, and per node the sorted
        (start, end) spans of their forwards in a replay (the backwards come later)."""
        visits: Counter = Counter(self.allocation[v.stage, v.replica]
                                  for p in plan.paths if p is not None for v in p.visits)
        subset, _ = _subset(plan, self.rules.num_stages, self.num_replicas)
        busy: dict[int, list[tuple[float, float]]] = {}
        if subset.num_microbatches:
            for task, (node, start, end) in self.replay(subset).spans.items():
                if task.op != BACKWARD:
                    busy.setdefault(node, []).append((start, end))
            for intervals in busy.values():
                intervals.sort()
        return visits, busy

    def _options(self, plan: _Plan, microbatch: int, left: int
                 ) -> list[tuple[float, tuple[int, ...], tuple[int, ...]]]:
        """(estimate, stage order, replicas) of every order the rules and the balance still
        allow ``microbatch`` (unplanned in ``plan``), best estimate first."""
        num_microbatches = len(plan.paths)
        low, high = balance_bounds(self.rules, num_microbatches)
        counts: Counter = Counter(s for p in plan.paths if p is not None for s in p.stages)
        visits, busy = self._occupancy(plan)
        options = []
        for order in self.orders:
            if not _fits(sorted(order), counts, self.rules, low, high, left):
                continue
            routed = self._route(microbatch, order, busy, visits)
            if routed is not None:
                options.append((routed[0], order, routed[1]))
        options.sort()
        return options

    def _best_of(self, plan: _Plan, microbatch: int, options, limit: int
                 ) -> tuple[tuple[float, float], _Plan] | None:
        """The best of the first ``limit`` options for ``microbatch`` by full replay."""
        best = None
        for _, order, replicas in options[:limit]:
            trial = plan.with_path(microbatch, Path.of(order, replicas))
            score = self._score(trial)
            if best is None or score < best[0]:
                best = (score, trial)
        return best

    def _prioritized(self, num_microbatches: int, orders, skip_sets=None) -> _Plan:
        """Step 1 and 2 for every microbatch in turn; ``skip_sets[m]``, when given, is the set
        of stages microbatch m must visit (any allowed order of them)."""
        plan = _Plan((None,) * num_microbatches)
        for m in range(num_microbatches):
            options = self._options(plan, m, left=num_microbatches - m - 1)
            if skip_sets is not None:
                options = [o for o in options if sorted(o[1]) == skip_sets[m]]
            best = self._best_of(plan, m, options, self.candidates)
            if best is None:
                limit = ("" if self.memory is None
                         else f" and the memory limit ({self.memory} microbatches per node)")
                raise _DeadEnd(f"microbatch {m}: no path fits the balanced skips{limit}")
            plan = best[1]
        return plan

    def _repair(self, plan: _Plan, rounds: int) -> tuple[tuple[float, float], _Plan]:
        """Local search from ``plan``: re-plan one microbatch against all the others, or trade
        the stage orders of two (which keeps the skips balanced) and re-route both; keep a
        change only when the makespan (then the sum of finish times) falls."""
        score = self._score(plan)
        count = len(plan.paths)
        for _ in range(rounds):
            improved = False
            for m in range(count):
                found = self._best_of(plan.with_path(m, None), m,
                                      self._options(plan.with_path(m, None), m, left=0),
                                      2 * self.candidates)
                if found is not None and found[0] < score:
                    score, plan, improved = found[0], found[1], True
            for a in range(count):
                for b in range(a + 1, count):
                    pa, pb = plan.paths[a], plan.paths[b]
                    if pa is None or pb is None or sorted(pa.stages) == sorted(pb.stages):
                        continue
                    trial = plan.with_path(a, None).with_path(b, None)
                    trial = self._route_fixed(trial, a, pb.stages)
                    trial = self._route_fixed(trial, b, pa.stages) if trial else None
                    if trial is None:
                        continue
                    trial_score = self._score(trial)
                    if trial_score < score:
                        score, plan, improved = trial_score, trial, True
            if not improved:
                break
        return score, plan

    def _route_fixed(self, plan: _Plan, microbatch: int, order: Sequence[int]) -> _Plan | None:
        """``plan`` with ``microbatch`` on ``order``, its replicas chosen by ``_route``."""
        visits, busy = self._occupancy(plan)
        routed = self._route(microbatch, order, busy, visits)
        return None if routed is None else plan.with_path(microbatch, Path.of(order, routed[1]))

    # -- the whole set -----------------------------------------------------------------------------
    def schedule(self, num_microbatches: int, rounds: int = 3, restarts: int = 6,
                 seed: int = 0) -> PathSet:
        """Prioritized planning, and ``restarts`` random valid path sets, each repaired for up
        to ``rounds`` rounds; the set with the smallest makespan (module docstring)."""
        starts = []
        try:
            starts.append(self._prioritized(num_microbatches, self.orders))
        except _DeadEnd:
            # The greedy balance check can corner the last microbatches; plan again with each
            # microbatch's skip set fixed by a balanced draw (the scheduler then chooses the
            # swaps and every replica), which always completes without a memory limit.
            drawn = random_paths(self.rules, self.num_replicas, num_microbatches, seed=seed)
            starts.append(self._prioritized(num_microbatches, self.orders,
                                            [sorted(p.stages) for p in drawn.paths]))
        for i in range(restarts if self.memory is None else 0):  # random sets ignore memory
            start = random_paths(self.rules, self.num_replicas, num_microbatches,
                                 seed=_RESTART_SEED + seed + i)
            starts.append(_Plan(start.paths))
        best = min((self._repair(start, rounds) for start in starts), key=lambda e: e[0])
        result = PathSet(self.rules.num_stages, self.num_replicas, best[1].paths)  # type: ignore
        check_paths(result, self.rules)
        return result


def schedule_paths(rules: PathRules, num_replicas: int, num_microbatches: int,
                   cluster: Cluster, allocation: Mapping[tuple[int, int], int],
                   costs: PathCosts, *, memory: int | None = None, rounds: int = 3,
                   restarts: int = 6, seed: int = 0) -> PathSet:
    """The scheduled paths (``PathScheduler``) of ``num_microbatches`` microbatches."""
    return PathScheduler(rules, num_replicas, cluster, allocation, costs,
                         memory=memory).schedule(num_microbatches, rounds, restarts, seed)


@dataclass(frozen=True)
class Comparison:
    """Makespans (seconds) of the same cluster, allocation and costs: the ordinary pipeline
    (``full_paths``: microbatch m on replica m % R of every stage), the best full paths the
    scheduler finds at skip 0, random valid paths at the skip ratio (mean and best of
    ``samples``) and the scheduled ones."""

    full: float
    full_scheduled: float
    random_mean: float
    random_best: float
    scheduled: float

    def rows(self) -> list[tuple[str, float]]:
        return [("full pipeline (replica m % R)", self.full),
                ("full pipeline, scheduled replicas", self.full_scheduled),
                ("random valid paths (mean)", self.random_mean),
                ("random valid paths (best)", self.random_best),
                ("scheduled paths", self.scheduled)]


def compare(rules: PathRules, num_replicas: int, num_microbatches: int, cluster: Cluster,
            allocation: Mapping[tuple[int, int], int], costs: PathCosts, *,
            samples: int = 10, seed: int = 0) -> Comparison:
    """``Comparison`` of scheduled paths with random ones and the full pipeline."""
    def makespan(paths: PathSet) -> float:
        return replay_paths(paths, cluster, allocation, costs).makespan

    stages = rules.num_stages
    full = makespan(full_paths(stages, num_microbatches, num_replicas))
    full_rules = PathRules(stages, 0, rules.max_consecutive_skips, 0)
    full_scheduled = makespan(schedule_paths(full_rules, num_replicas, num_microbatches, cluster,
                                             allocation, costs))
    randoms = [makespan(random_paths(rules, num_replicas, num_microbatches, seed=seed + i))
               for i in range(samples)]
    scheduled = makespan(schedule_paths(rules, num_replicas, num_microbatches, cluster,
                                        allocation, costs))
    return Comparison(full, full_scheduled, sum(randoms) / len(randoms), min(randoms), scheduled)


__all__ = ["Comparison", "PathScheduler", "compare", "schedule_paths"]
