"""One step's sequences placed on the ranks of a cp x dp grid: whole, or on a sub-ring (Zeppelin).

Variable-length data makes a step's ranks unequal twice over: attention costs ~ s² per
sequence, the linear modules (projections, MLP) ~ s. Dealing sequences so every rank gets equal
*tokens* (``data.balance = tokens``, ``varlen.balance_tokens``) equalises the linear work and
leaves the attention work as unequal as the squares of the lengths; one long sequence alone on
a rank sets the step's time. Splitting *every* sequence over a fixed context-parallel ring
(static cp) equalises attention but pays a ring's communication for short sequences whose
compute cannot hide it. The Zeppelin plan (Chen et al. 2025, arXiv 2509.21841), as built here:

* **Sizing.** A sequence of ``s`` tokens goes to a group of ``g`` ranks, ``g`` a power of two:
  the smallest whose per-rank load (``group_time``: the s²/g² block of each ring step, and the
  ring's exposed communication, intra- or inter-node by where the group sits; plus its s/g
  tokens' linear work when the plan is not remapped) is within a target (the mean per-rank
  load of the step times a factor; a few factors are tried and the best plan kept). Short
  sequences stay whole (g = 1) on one rank.
* **Placing.** Grouped sequences, costliest first, each on the aligned block of ``g``
  contiguous ranks (start a multiple of g: a contiguous sub-ring) that lies inside one node if
  any does, then has the smallest maximum load, then the lowest start (nearest ranks first).
  Whole sequences then longest first, each to the rank with the least load (ties: the lowest
  rank). Inside a group the sequence is cut into 2g near-equal chunks and rank j of
  the group holds chunks j and 2g-1-j (Loom's zig-zag rule, ``parallel.context``), which
  balances a causal mask.
* **The baseline is a candidate.** The placements (one per target factor) and the ``tokens``
  deal (all whole, not remapped) are priced alike, and the shortest predicted step
  (``Partition.step_seconds``) wins, so a plan is never slower than ``tokens`` on the cost
  model (a property test checks it over random steps). ``remap=False`` balances each rank's
  attention and linear work together instead, with no remapping (an ablation).
* **Remapping.** The attention layout leaves each rank unequal tokens; the linear modules run
  on an equal split of the step's tokens (per-token work: which tokens does not matter), so
  the linear stage is balanced to one token. Only the surplus moves: a rank keeps what fits
  its quota and hands the rest to ranks short of theirs, inside its node first, nearest
  first (``Partition.moved_tokens``). ``Partition.token_indices`` is what each rank holds in
  attention layout, ``linear_layout`` what it holds in linear layout;
  ``loom.parallel.remap`` moves the rows between the two. Both imbalances are reported: the
  attention stage's max / mean, and the linear stage's before (attention layout's tokens) and
  after remapping (the equal split).

Every function is deterministic (no randomness; ties broken by index), so every rank computes
the same plan without communicating. Plain numpy, no torch calls (importing it still loads
torch with the data package and ``varlen``, whose ``tokens`` deal it reuses); the planner and
the simulator price it (``loom.sim.varlen_cost``) without running anything. Hand-written: no
library partitions variable-length sequences over sub-rings by a cost model.

What runs: ``data.balance = zeppelin`` (varlen, ``loom.parallel.zeppelin_cp``) places each
microbatch's documents over the cp ranks, or, with a data-parallel degree > 1, over every dp x
cp rank (cp index innermost, so an aligned block is nearest ranks first; each rank runs the dp
ranks' microbatches merged) with these candidates (``zeppelin_candidates``), priced as that
runtime runs them, and hands every rank its ``token_indices``; attention runs on sub-rings
(``zeppelin_cp.sub_ring_attention``): a document whole on one rank with no communication, a
grouped one over its group's own process group, shards unpadded. With
``data.zeppelin_remap`` the remapping layer runs too (every candidate priced remapped, the
shards the linear layout, ``loom.parallel.remap`` inside each attention layer; with tp and
pp as the placement).
Both domains run with tp (SP on or off), pp and MoE models (ep is a data axis: the dp x cp
domain spans it): one domain per (tp, pp) coordinate, every tp rank and stage of a domain rank
computing the same plan. Under an outer dp mode the domain is one replica's data ranks x cp
(each replica places its own share of the step). What it lacks is named by the config
(``loom.config_rules.data``): expert capacity, a non-ring cp mode, and an outer mode whose
replicas hold one data rank and cp = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from loom.data.budgets import balance_tokens, first_fit


@dataclass(frozen=True)
class TokenCosts:
    """Seconds of one step's work per unit (forward + backward, every layer).

    ``linear``: per token (projections, MLP, norms); ``attention``: per token² of a causal
    attention core; ``ring_intra`` / ``ring_inter``: per token's K and V passed one ring step to
    a rank in the same node / in another node (the latter with or without the routing layer:
    ``loom.sim.varlen_cost`` decides); ``remap_intra`` / ``remap_inter``: per token the
    remapping moves to a rank in the same node / another node (every all-to-all of the step)."""

    linear: float
    attention: float
    ring_intra: float = 0.0
    ring_inter: float = 0.0
    remap_intra: float = 0.0
    remap_inter: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear", "attention", "ring_intra", "ring_inter", "remap_intra",
                     "remap_inter"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ValueError(f"TokenCosts.{name}={value!r}: must be finite and >= 0")


UNIT = TokenCosts(linear=1.0, attention=1.0)  # what a partition is priced with when not told


@dataclass(frozen=True)
class Ranks:
    """``count`` ranks (cp x dp), ``per_node`` consecutive ranks to a node; or ``nodes``, the
    node of every rank (non-decreasing: a node's ranks are consecutive, e.g. an emulated
    cluster's regions, ``of_cluster``), which then overrides ``per_node``."""

    count: int
    per_node: int = 1
    nodes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 1 or self.per_node < 1:
            raise ValueError(f"Ranks(count={self.count}, per_node={self.per_node}): both >= 1")
        if self.nodes and (len(self.nodes) != self.count
                           or any(b < a for a, b in zip(self.nodes, self.nodes[1:]))):
            raise ValueError(f"Ranks.nodes={self.nodes}: one node per rank, non-decreasing")

    @classmethod
    def of_cluster(cls, cluster: Any) -> "Ranks":
        """The ranks of an emulated cluster (``loom.cluster.Cluster``): a region is a node, a
        device with no region a node of its own; a region's devices must be consecutive."""
        names = [node.region or f"#{i}" for i, node in enumerate(cluster.nodes)]
        order = list(dict.fromkeys(names))
        ids = tuple(order.index(name) for name in names)
        if any(b < a for a, b in zip(ids, ids[1:])):
            raise ValueError("cluster: a region's nodes must be consecutive ranks")
        return cls(len(ids), 1, ids)

    def node_ids(self) -> np.ndarray:
        if self.nodes:
            return np.asarray(self.nodes, dtype=np.int64)
        return np.arange(self.count, dtype=np.int64) // self.per_node

    def inside_node(self, start: int, size: int) -> bool:
        if self.nodes:
            return self.nodes[start] == self.nodes[start + size - 1]
        return start // self.per_node == (start + size - 1) // self.per_node

    def largest_in_node(self) -> int:
        """The largest power-of-two aligned block that lies inside one node."""
        g = 1
        while 2 * g <= self.count and any(self.inside_node(b, 2 * g)
                                          for b in range(0, self.count - 2 * g + 1, 2 * g)):
            g *= 2
        return g


def group_time(length: int, size: int, inside_node: bool, costs: TokenCosts) -> float:
    """One rank's attention time for a sequence of ``length`` on a ring of ``size`` ranks:
    ``size`` blocks of (length/size)² / 2-equivalent work (the causal total divided evenly by
    the zig-zag chunks), the first with nothing to wait for, each later one after its K/V
    chunk of length/size tokens has arrived (overlapped: the slower of the two per step)."""
    total = costs.attention * float(length) ** 2
    if size == 1:
        return total
    block = total / size ** 2
    per_token = costs.ring_intra if inside_node else costs.ring_inter
    transfer = per_token * length / size
    return block + (size - 1) * max(block, transfer)


def _chunks(length: int, size: int, j: int) -> list[tuple[int, int]]:
    """Rank j of a ring of ``size``: chunks j and 2·size-1-j of 2·size near-equal ones, as
    (offset, count); the whole sequence for size 1."""
    if size == 1:
        return [(0, length)]
    edges = [k * length // (2 * size) for k in range(2 * size + 1)]
    return [(edges[c], edges[c + 1] - edges[c]) for c in (j, 2 * size - 1 - j)]


@dataclass(frozen=True)
class Partition:
    """Where one step's sequences live in attention layout: sequence i on ranks
    ``[start[i], start[i] + size[i])`` (size 1: whole on one rank), whether the linear modules
    run on the equal split (``remapped``), and what it costs."""

    name: str
    lengths: tuple[int, ...]
    start: tuple[int, ...]
    size: tuple[int, ...]
    ranks: Ranks
    costs: TokenCosts
    remapped: bool = False

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    def segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(sequence, offset, count) rank ``rank`` holds in attention layout, in the order it
        holds them: sequence by sequence, a group's two zig-zag chunks in chunk order."""
        out = []
        for i, (n, b, g) in enumerate(zip(self.lengths, self.start, self.size)):
            if b <= rank < b + g:
                out += [(i, off, cnt) for off, cnt in _chunks(n, g, rank - b) if cnt]
        return out

    def token_indices(self, rank: int) -> np.ndarray:
        """The global indices (sequences concatenated in order) of the tokens ``rank`` holds in
        attention layout, in its order."""
        first = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])
        parts = [np.arange(first[i] + off, first[i] + off + cnt, dtype=np.int64)
                 for i, off, cnt in self.segments(rank)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def quotas(self) -> np.ndarray:
        """Tokens per rank in linear layout: the equal split (``T // R``, the last ``T mod R``
        ranks one more)."""
        t, r = self.total_tokens, self.ranks.count
        return np.diff(np.array([p * t // r for p in range(r + 1)], dtype=np.int64))

    def moved_tokens(self) -> np.ndarray:
        """[src, dst] tokens the remapping moves from attention to linear layout; the diagonal
        is what a rank keeps (the way back moves the transpose). A rank keeps the first
        ``min(held, quota)`` tokens it holds; the others' surplus goes to ranks short of their
        quota inside the node first, then across nodes, nearest rank first (ties: the lower)."""
        held, quota = self.rank_tokens(), self.quotas()
        r = self.ranks.count
        moved = np.diag(np.minimum(held, quota)).astype(np.int64)
        surplus, deficit = held - np.diag(moved), quota - np.diag(moved)
        node = self.ranks.node_ids()
        for same_node_only in (True, False):
            for p in range(r):
                if surplus[p] == 0:
                    continue
                takers = [q for q in range(r) if deficit[q] > 0
                          and (node[q] == node[p] or not same_node_only)]
                for q in sorted(takers, key=lambda q: (node[q] != node[p], abs(q - p), q)):
                    n = min(surplus[p], deficit[q])
                    moved[p, q] += n
                    surplus[p] -= n
                    deficit[q] -= n
                    if surplus[p] == 0:
                        break
        return moved

    def linear_layout(self) -> list[np.ndarray]:
        """Every rank's global token indices in linear layout (``moved_tokens``' plan): what it
        keeps, in its attention order, then what it receives, by sender, each sender's tokens
        in the sender's order (a sender's surplus is its tail, cut for receivers in rank
        order)."""
        moved = self.moved_tokens()
        r = self.ranks.count
        kept: list[np.ndarray] = []
        received: list[list[np.ndarray]] = [[] for _ in range(r)]  # by sender, in rank order
        for p in range(r):
            mine = self.token_indices(p)
            kept.append(mine[:moved[p, p]])
            at = int(moved[p, p])
            for q in range(r):
                if q != p and moved[p, q]:
                    received[q].append(mine[at:at + moved[p, q]])
                    at += int(moved[p, q])
        return [np.concatenate([kept[q]] + received[q]).astype(np.int64) for q in range(r)]

    # ----- costs ---------------------------------------------------------------------------
    def rank_tokens(self) -> np.ndarray:
        """Tokens per rank in attention layout."""
        tokens = np.zeros(self.ranks.count, dtype=np.int64)
        for n, b, g in zip(self.lengths, self.start, self.size):
            for j in range(g):
                tokens[b + j] += sum(cnt for _, cnt in _chunks(n, g, j))
        return tokens

    def rank_attention(self) -> np.ndarray:
        """Seconds of attention per rank (ring communication exposed included)."""
        load = np.zeros(self.ranks.count)
        for n, b, g in zip(self.lengths, self.start, self.size):
            load[b:b + g] += group_time(n, g, self.ranks.inside_node(b, g), self.costs)
        return load

    def linear_tokens_after(self) -> np.ndarray:
        """Tokens per rank in linear layout (after remapping)."""
        return self.quotas()

    def remap_seconds(self) -> float:
        """The busiest rank's remapping: the larger of what it sends or receives inside its
        node and across nodes, each at its per-token cost (the two links run side by side)."""
        if not self.remapped:
            return 0.0
        moved = self.moved_tokens()
        np.fill_diagonal(moved, 0)
        node = self.ranks.node_ids()
        same = node[:, None] == node[None, :]
        intra = np.maximum((moved * same).sum(axis=1), (moved * same).sum(axis=0))
        inter = np.maximum((moved * ~same).sum(axis=1), (moved * ~same).sum(axis=0))
        return float(np.max(np.maximum(intra * self.costs.remap_intra,
                                       inter * self.costs.remap_inter)))

    def rank_linear(self) -> np.ndarray:
        """Seconds of linear work per rank: on the equal split when remapped, else on what the
        attention layout left each rank."""
        return (self.quotas() if self.remapped else self.rank_tokens()) * self.costs.linear

    def step_seconds(self) -> float:
        """The step's predicted time: remapped, the attention and the linear stage each wait
        for their busiest rank (the all-to-alls between them synchronise), plus the
        remapping; otherwise each rank runs both on what it holds, and the busiest sets it."""
        attention, linear = self.rank_attention(), self.rank_linear()
        if self.remapped:
            return float(attention.max() + linear.max()) + self.remap_seconds()
        return float((attention + linear).max())

    def imbalance(self) -> dict[str, float]:
        """max / mean of the attention stage, and of the linear stage before and after the
        remapping (1.0 is perfect balance)."""
        def ratio(values: np.ndarray) -> float:
            mean = float(np.mean(values))
            return float(np.max(values)) / mean if mean > 0 else 1.0
        return {"attention": ratio(self.rank_attention()),
                "linear_before": ratio(self.rank_tokens().astype(float)),
                "linear_after": ratio(self.linear_tokens_after().astype(float))}


def _check(lengths: Sequence[int], ranks: Ranks) -> tuple[int, ...]:
    out = tuple(int(n) for n in lengths)
    if not out or any(n < 1 for n in out):
        raise ValueError("a step needs one or more sequences of >= 1 token")
    return out


def partition_none(lengths: Sequence[int], ranks: Ranks, costs: TokenCosts | None = None,
                   budget: int = 0) -> Partition:
    """``data.balance = none``: the sequences in their order, each whole into the first rank
    with room (``varlen.first_fit``) under ``budget`` tokens per rank (0: the smallest budget
    from max(longest, mean) up, in steps of 1/16, that takes every sequence)."""
    seqs = _check(lengths, ranks)
    arr = np.asarray(seqs, dtype=np.int64)
    budget = budget or max(max(seqs), -(-sum(seqs) // ranks.count))
    while True:
        taken, bins = first_fit(arr, ranks.count, budget)
        if taken == len(seqs):
            break
        budget += max(1, budget // 16)
    return Partition("none", seqs, tuple(bins.tolist()), (1,) * len(seqs), ranks,
                     costs or UNIT)


def partition_tokens(lengths: Sequence[int], ranks: Ranks,
                     costs: TokenCosts | None = None) -> Partition:
    """``data.balance = tokens``: ``varlen.balance_tokens``'s deal, every sequence whole."""
    seqs = _check(lengths, ranks)
    bins = balance_tokens(np.asarray(seqs, dtype=np.int64), ranks.count, sum(seqs))
    return Partition("tokens", seqs, tuple(bins.tolist()), (1,) * len(seqs), ranks,
                     costs or UNIT)


def partition_static_cp(lengths: Sequence[int], ranks: Ranks, cp: int,
                        costs: TokenCosts | None = None) -> Partition:
    """Static context parallelism: every sequence on one of ``count / cp`` fixed rings of ``cp``
    consecutive ranks, dealt to the rings by tokens (a sequence shorter than 2·cp leaves some
    ranks of its ring without a chunk)."""
    seqs = _check(lengths, ranks)
    if cp < 1 or ranks.count % cp:
        raise ValueError(f"cp={cp}: must be >= 1 and divide {ranks.count} ranks")
    rings = balance_tokens(np.asarray(seqs, dtype=np.int64), ranks.count // cp, sum(seqs))
    return Partition(f"static-cp{cp}", seqs, tuple((rings * cp).tolist()), (cp,) * len(seqs),
                     ranks, costs or UNIT)


def _place(seqs: tuple[int, ...], ranks: Ranks, costs: TokenCosts, factor: float,
           remapped: bool) -> Partition:
    """Size and place (module docstring). A rank's load is its attention time, plus, when the
    plan is not remapped (linear modules on what the rank holds), its linear time; the target
    is ``factor`` x the mean load."""
    linear = 0.0 if remapped else costs.linear

    def work(n: int, g: int, inside: bool) -> float:
        return group_time(n, g, inside, costs) + linear * n / g

    target = factor * sum(work(n, 1, True) for n in seqs) / ranks.count
    in_node = ranks.largest_in_node()
    sizes = []
    largest = 1 << (ranks.count.bit_length() - 1)  # the largest power of two <= count
    for n in seqs:
        cap, g = max(1, min(largest, n // 2)), 1  # every zig-zag chunk holds a token
        best, chosen = (work(n, 1, True), 1), 0
        while True:
            t = work(n, g, g <= in_node)
            best = min(best, (t, g))
            if t <= target:
                chosen = g
                break
            if 2 * g > cap:
                break
            g *= 2
        sizes.append(chosen or best[1])
    load = np.zeros(ranks.count)
    start = [0] * len(seqs)
    grouped = sorted((i for i, g in enumerate(sizes) if g > 1),
                     key=lambda i: (-work(seqs[i], sizes[i], True), i))
    for i in grouped:
        g = sizes[i]
        options = [(not ranks.inside_node(b, g), float(load[b:b + g].max()), b)
                   for b in range(0, ranks.count - g + 1, g)]
        _, _, b = min(options)
        start[i] = b
        load[b:b + g] += work(seqs[i], g, ranks.inside_node(b, g))
    for i in sorted((i for i, g in enumerate(sizes) if g == 1), key=lambda i: (-seqs[i], i)):
        b = int(np.argmin(load))  # first minimum: the lowest rank
        start[i] = b
        load[b] += work(seqs[i], 1, True)
    return Partition("zeppelin", seqs, tuple(start), tuple(sizes), ranks, costs, remapped)


TARGET_FACTORS = (0.5, 1.0, 2.0)


def plan_zeppelin(lengths: Sequence[int], ranks: Ranks, costs: TokenCosts,
                  remap: bool = True) -> Partition:
    """The Zeppelin partition of one step (module docstring): the candidate of the shortest
    ``step_seconds`` (ties: the earlier) of the sized-and-placed plans for each target in
    ``TARGET_FACTORS`` and the ``tokens`` deal. ``remap``: the plans balance attention alone
    and run the linear modules on the equal split (Zeppelin's); otherwise they balance a
    rank's attention and linear work together, with no remapping (an ablation: it ignores that
    a ring's ranks wait for each other in every layer, so it is optimistic)."""
    return min(zeppelin_candidates(lengths, ranks, costs, remap), key=lambda p: p.step_seconds())


def zeppelin_candidates(lengths: Sequence[int], ranks: Ranks, costs: TokenCosts,
                        remap: bool = True) -> list[Partition]:
    """What ``plan_zeppelin`` chooses from: the sized-and-placed plan of every target factor,
    then the ``tokens`` deal (all named ``zeppelin``), for a caller that prices them its own
    way (the cp runtime, ``loom.parallel.zeppelin_cp``)."""
    seqs = _check(lengths, ranks)
    candidates = [_place(seqs, ranks, costs, factor, remap) for factor in TARGET_FACTORS]
    candidates.append(replace(partition_tokens(seqs, ranks, costs), name="zeppelin"))
    return candidates


__all__ = ["Partition", "Ranks", "TokenCosts", "TARGET_FACTORS", "group_time", "partition_none",
           "partition_static_cp", "partition_tokens", "plan_zeppelin", "zeppelin_candidates"]
