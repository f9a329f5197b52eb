"""The time of a variable-length step under four balances: none, tokens, static cp, Zeppelin.

``CostModel`` prices steps of equal sequences (``seq_len`` each); a variable-length step's work
depends on the lengths: attention ~ Σ s² (per rank: the squares of what it holds), linear
modules ~ Σ s. This module prices one step of given lengths on ``ranks`` data-parallel ranks
(cp x dp, tp = pp = 1, as Zeppelin's setting) from the cost model's own per-token FLOPs
(``CostModel.layer_flops``: projections and MLP, and the causal attention core per token²; the
output head per token), times forward + backward (3x), at the catalog GPU's matmul rate:

* **none / tokens / static cp**: every rank runs attention and linear modules on what the
  partition gave it; the step is the busiest rank's ``attention + linear`` (static cp's and
  Zeppelin's rings include their exposed K/V communication: ``zeppelin.group_time``);
* **zeppelin**: the attention stage on the planner's layout, the linear stage on the equal split
  (``loom.parallel.remap``), each stage synchronised by the remapping's all-to-alls, so the
  step is max(attention) + max(linear) + the remapping's exposed time (q, k, v into the
  attention layout and its output back, forward and backward, per layer; not overlapped);
* **zeppelin-noremap** (ablation): the planner's sizing and placing with a rank's attention and
  linear work balanced together and no remapping; priced like none (optimistic: it ignores
  the waits of a ring's ranks for each other inside a layer).

Communication is the cost model's alpha-beta at the links' effective bandwidth, with the
**routing layer** as a model only: a ring that crosses nodes sends, at each node boundary and
ring step, one rank's K/V chunk to the next node. Without routing that goes out through the one
NIC of the boundary GPU (static NIC-GPU affinity); with routing (Zeppelin's) it is spread over
all ``nics_per_node`` NICs of the node, relayed over the intra-node link, so the boundary moves
at min(the node's whole inter-node bandwidth, the GPU's intra-node bandwidth). One crossing per
node at a time is assumed (the routing gain's upper bound). The remapping's all-to-all uses
every GPU's own share of the NICs (no routing gain). The gradient reduction and the optimizer
step are the same for every balance and are left out.

A length distribution (``load_length_distribution``; ``loom plan --length-dist FILE``) is a
text or JSON file: a list of lengths (a sample; each once), or a histogram::

    [512, 2048, 700, 31000]                   # JSON: lengths
    {"histogram": [[512, 10], [4096, 3]]}     # JSON: [length, count] pairs
    512                                       # text: one length per line, or
    4096 3                                    #       "length count"; '#' starts a comment

A step draws lengths from it (seeded) until the next would exceed the step's token budget.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from loom.data.zeppelin import (Partition, Ranks, TokenCosts, partition_none, partition_static_cp,
                                partition_tokens, plan_zeppelin)
from loom.errors import ConfigError, InputFileError, loads_json, read_input_text
from loom.sim.cost_model import CostModel

BALANCES = ("none", "tokens", "static-cp", "zeppelin", "zeppelin-noremap")


@dataclass(frozen=True)
class Fabric:
    """Bandwidths (bytes/s, effective) a variable-length step's communication sees: per GPU
    inside a node, per NIC between nodes; ``routing`` the routing layer (module docstring)."""

    gpus_per_node: int
    nics_per_node: int
    intra: float
    nic: float
    routing: bool = True

    @classmethod
    def of(cls, cluster: Any, routing: bool = True) -> "Fabric":
        """From the planner's cluster (``plan.hardware.Cluster``): its inter-node bandwidth is
        per accelerator, so a node has ``gpus_per_node`` x that, over ``nics_per_node`` NICs
        (0 or absent: one per GPU)."""
        per_node = cluster.gpus_per_node
        nics = getattr(cluster, "nics_per_node", 0) or per_node
        node_total = cluster.inter.effective_bandwidth * per_node
        return cls(per_node, nics, cluster.intra.effective_bandwidth, node_total / nics, routing)

    @property
    def ring_crossing(self) -> float:
        """Bytes/s of one ring's node-boundary transfer."""
        if not self.routing:
            return self.nic
        return min(self.nic * self.nics_per_node, self.intra)

    @property
    def per_gpu_inter(self) -> float:
        """Bytes/s between nodes when every GPU of a node sends at once (an all-to-all)."""
        return self.nic * self.nics_per_node / self.gpus_per_node


def unit_costs(model: CostModel, fabric: Fabric) -> TokenCosts:
    """Per-token and per-token² seconds from ``model``'s FLOP counts (module docstring)."""
    m, gpu = model.model, model.cluster.gpu
    mat, core = model.layer_flops(1, 1, False)  # one token's forward; core ~ one token x seq
    layers, e = m.n_layers, model.e
    linear = 3 * layers * mat / gpu.matmul_rate(min(m.dim, m.ffn_dim)) \
        + 3 * 2 * m.dim * m.vocab_size / gpu.matmul_rate(min(m.dim, m.vocab_size))
    attention = (1 + model.core_backward) * layers * core / model.seq \
        / gpu.matmul_rate(m.head_dim)
    kv = 2 * m.n_kv_heads * m.head_dim * e  # bytes of one token's K and V in one layer
    ring = 3 * layers * kv  # forward once, backward twice (the cost model's cp ring)
    remap = 2 * layers * (2 * m.dim * e + kv)  # q, k, v in and the output back; and backward
    return TokenCosts(linear, attention, ring / fabric.intra, ring / fabric.ring_crossing,
                      remap / fabric.intra, remap / fabric.per_gpu_inter)


@dataclass(frozen=True)
class VarlenStep:
    """One balance's predicted step (seconds) and its imbalances (max / mean)."""

    balance: str
    seconds: float
    attention: float  # the busiest rank's attention (with exposed ring communication)
    linear: float  # the busiest rank's linear work (after remapping for zeppelin)
    remap: float
    imbalance: dict[str, float]
    max_group: int


def price(part: Partition) -> VarlenStep:
    """``part``'s step (``Partition.step_seconds``) and its imbalances; without remapping the
    linear stage stays as the attention layout left it."""
    ratio = part.imbalance()
    if not part.remapped:
        ratio["linear_after"] = ratio["linear_before"]
    return VarlenStep(part.name, part.step_seconds(), float(part.rank_attention().max()),
                      float(part.rank_linear().max()), part.remap_seconds(), ratio,
                      max(part.size))


def price_step(lengths: Sequence[int], ranks: Ranks, balance: str, costs: TokenCosts,
               cp: int = 0) -> VarlenStep:
    """``balance`` (one of ``BALANCES``) of one step's ``lengths``; ``cp`` static cp's ring
    (0: one node)."""
    if balance == "none":
        part = partition_none(lengths, ranks, costs)
    elif balance == "tokens":
        part = partition_tokens(lengths, ranks, costs)
    elif balance == "static-cp":
        part = partition_static_cp(lengths, ranks, cp or min(ranks.per_node, ranks.count), costs)
    elif balance in ("zeppelin", "zeppelin-noremap"):
        part = replace(plan_zeppelin(lengths, ranks, costs, balance == "zeppelin"), name=balance)
    else:
        raise ValueError(f"balance {balance!r}: one of {', '.join(BALANCES)}")
    return price(part)


# ----- length distributions ------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDistribution:
    """Sequence lengths and their weights (counts)."""

    lengths: np.ndarray
    weights: np.ndarray

    @property
    def median(self) -> float:
        order = np.argsort(self.lengths, kind="stable")
        cum = np.cumsum(self.weights[order])
        return float(self.lengths[order][np.searchsorted(cum, cum[-1] / 2)])

    def sample_step(self, tokens: int, seed: int) -> list[int]:
        """Lengths drawn (seeded) until the next would push the step past ``tokens`` (at least
        one)."""
        rng = np.random.default_rng(seed)
        p = self.weights / self.weights.sum()
        out: list[int] = []
        total = 0
        while True:
            draws = self.lengths[rng.choice(len(self.lengths), size=256, p=p)]
            for n in draws.tolist():
                if out and total + n > tokens:
                    return out
                out.append(int(n))
                total += n


# A length or count beyond any corpus (the arrays below are int64; sums of them must stay inside)
MAX_LENGTH = 10 ** 12


def _positive_int(value: Any, where: str, path: str, minimum: int = 1) -> int:
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or value >= MAX_LENGTH):
        raise ConfigError("--length-dist", path, f"{where}: {value!r} is not an integer >= "
                          f"{minimum} and < {MAX_LENGTH:.0e}")
    return value


def load_length_distribution(path: str | Path) -> LengthDistribution:
    """Read and check a length distribution file (module docstring); ``ConfigError`` names
    ``--length-dist``, the file and the rule broken."""
    shown = str(path)
    try:
        text = read_input_text(path)
    except InputFileError as err:
        raise ConfigError("--length-dist", shown, err.rule) from None
    pairs: list[tuple[int, int]] = []
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            data = loads_json(text)
        except json.JSONDecodeError as err:
            raise ConfigError("--length-dist", shown, f"is not valid JSON: {err}") from None
        if isinstance(data, list):
            pairs = [(_positive_int(n, f"length {i}", shown), 1) for i, n in enumerate(data)]
        elif isinstance(data, dict) and set(data) == {"histogram"} \
                and isinstance(data["histogram"], list):
            for i, pair in enumerate(data["histogram"]):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ConfigError("--length-dist", shown,
                                      f"histogram entry {i}: must be [length, count]")
                pairs.append((_positive_int(pair[0], f"histogram entry {i} length", shown),
                              _positive_int(pair[1], f"histogram entry {i} count", shown, 0)))
        else:
            raise ConfigError("--length-dist", shown, 'JSON must be a list of lengths or'
                              ' {"histogram": [[length, count], ...]}')
    else:
        for number, line in enumerate(text.splitlines(), 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            # ASCII digits only: str.isdigit() also takes "²", which int() refuses
            if len(fields) > 2 or not all(f.isascii() and f.isdigit() for f in fields):
                raise ConfigError("--length-dist", shown, f"line {number}: {line.strip()!r} is"
                                  " not 'length' or 'length count' (non-negative integers)")
            length = _positive_int(int(fields[0]), f"line {number} length", shown)
            count = (_positive_int(int(fields[1]), f"line {number} count", shown, 0)
                     if len(fields) == 2 else 1)
            pairs.append((length, count))
    if not pairs or sum(c for _, c in pairs) == 0:
        raise ConfigError("--length-dist", shown, "holds no lengths (or only zero counts)")
    lengths = np.array([n for n, _ in pairs], dtype=np.int64)
    weights = np.array([c for _, c in pairs], dtype=np.float64)
    return LengthDistribution(lengths, weights)


def lognormal(median: float, max_ratio: float = 32.0, sigma: float = 1.0, size: int = 20000,
              seed: int = 0) -> LengthDistribution:
    """A long-tail sample: log-normal lengths of ``median``, clipped to [1, max_ratio x
    median] (``bench/varlen_predicted.py``'s distribution)."""
    rng = np.random.default_rng(seed)
    draws = np.exp(rng.normal(math.log(median), sigma, size=size))
    lengths = np.clip(np.rint(draws), 1, max_ratio * median).astype(np.int64)
    return LengthDistribution(lengths, np.ones(size))


@dataclass(frozen=True)
class VarlenRanking:
    """``rank_balances``'s answer: one row per balance (means over the sampled steps), fastest
    first, and the sample's shape."""

    rows: list[VarlenStep]
    steps: int
    mean_sequences: float


def rank_balances(model: CostModel, cluster: Any, dist: LengthDistribution,
                  tokens_per_step: int, *, steps: int = 4, routing: bool = True,
                  cps: Sequence[int] = (), balances: Sequence[str] = BALANCES) -> VarlenRanking:
    """Each of ``balances`` (static cp at each of ``cps``; default: one node) priced on
    ``steps`` seeded steps of ``dist`` on all of ``cluster``'s GPUs (data parallel x cp),
    averaged, fastest first."""
    costs = unit_costs(model, Fabric.of(cluster, routing))
    ranks = Ranks(cluster.gpus, cluster.gpus_per_node)
    samples = [dist.sample_step(tokens_per_step, seed) for seed in range(steps)]
    cps = tuple(cps) or (min(cluster.gpus_per_node, cluster.gpus),)
    variants = [(b, cp) for b in balances for cp in (cps if b == "static-cp" else (0,))]
    rows = []
    for balance, cp in variants:
        priced = []
        for lengths in samples:
            priced.append(price_step(lengths, ranks, balance, costs, cp))
        keys = priced[0].imbalance
        name = f"static-cp{cp}" if balance == "static-cp" else balance
        rows.append(VarlenStep(
            name, float(np.mean([p.seconds for p in priced])),
            float(np.mean([p.attention for p in priced])),
            float(np.mean([p.linear for p in priced])), float(np.mean([p.remap for p in priced])),
            {k: float(np.mean([p.imbalance[k] for p in priced])) for k in keys},
            max(p.max_group for p in priced)))
    rows.sort(key=lambda row: row.seconds)
    return VarlenRanking(rows, steps, float(np.mean([len(s) for s in samples])))


__all__ = ["BALANCES", "Fabric", "LengthDistribution", "VarlenRanking", "VarlenStep",
           "load_length_distribution", "lognormal", "price", "price_step", "rank_balances",
           "unit_costs"]
