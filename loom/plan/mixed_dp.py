"""Data parallelism across unlike accelerators: the replicas half of ``loom plan --mixed``.

``loom.plan.mixed`` puts pipeline stages on the parts of a mixed cluster. The other family the
published systems use keeps each replica of the model inside one part and gives the parts
unequal shares of the batch: Cephalo (Guo et al. 2025: "decoupling compute distribution from
training state assignment"), Hetu's HSPMD (non-uniform data-parallel splits over H800s and
H20s), HAPMoE, Whale. A part of fast accelerators runs more microbatches per step than a part
of slow ones, so every part finishes its share at about the same time, and only the gradients
cross the link between the parts, once per step.

* **Each part runs replicas of one shape of its own**: ``tp`` inside a node, ring context
  parallelism ``cp``, a ``1f1b`` pipeline of ``pp`` stages, plain replicas or ZeRO-1 over
  the part's replicas, no or full recomputation, a micro batch shared by all parts. Part i
  holds ``r_i = gpus_i / (tp_i x cp_i x pp_i)`` replicas, each running ``m_i`` microbatches.
* **The batch**: ``sum_i r_i x m_i x micro = global batch`` exactly. Each part's step is
  nearly linear in its microbatches (``a_i + b_i m``: exact without a pipeline, the 1F1B fill
  and drain with one), fitted from the homogeneous cost model at two counts; ``balance``
  finds the integer split whose slowest part is shortest, exactly (a bisection over the lines'
  values with a reachable-sums check). Every m_i is at least ``pp_i`` (a full 1F1B).
* **Each part is priced by the homogeneous cost model** on that part alone
  (``CostModel.evaluate``, the pipelined part simulated by ``search.simulate_step``): its
  compute, its bubble, memory, its own data-parallel reduction over its replicas and its
  optimizer step. Memory is therefore exact per part, unlike a mixed pipeline's bound.
* **The gradients cross the parts** after every part has reduced over its own replicas: each
  GPU of part i then holds 1/gpus_i of the gradient, and the parts all-reduce those shards over
  the ``between`` link, at the bandwidth of the smallest part's GPUs (their shards are the
  largest), then each part gathers its own again (inside its own reduction's price). Not
  overlapped with anything: an upper bound where a stack overlaps it with the backward.
* **The shapes searched** are, per part and micro batch, the ``KEEP`` fastest per sequence
  that fit its memory; every combination of them over the parts is balanced and priced.

Written here rather than taken from Cephalo or Hetu: both are research runtimes with their own
cost profiles; Loom's value is pricing each part with the same cost model and schedule replay
as a homogeneous plan. Torch-free, communicates nothing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from loom.layout import Layout
from loom.models.presets import parameter_count
from loom.plan.hardware import Cluster
from loom.plan.search import simulate_step
from loom.plan.space import Workload, ring_shapes
from loom.sim.collectives import allreduce_time
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import LOOM, Framework

MICRO_BATCHES = (1, 2, 4)
PIPELINES = (1, 2, 4, 8)
RECOMPUTE = ("none", "full")
KEEP = 3  # shapes kept per part and micro batch: 3^4 = 81 combinations for four parts


@dataclass(frozen=True)
class PartShare:
    """One part's replicas: their layout (with its microbatches), the part's step on its own
    (pipeline, its own data-parallel reduction, optimizer) and its worst rank's bytes."""

    part: int
    layout: Layout
    step: float
    memory: float

    @property
    def replicas(self) -> int:
        return self.layout.dp

    @property
    def sequences(self) -> int:
        return self.layout.dp * self.layout.micro_batch * self.layout.microbatches


@dataclass(frozen=True)
class MixedReplicas:
    """Data parallelism across the parts: each part's share (in the file's order) and the
    exposed all-reduce of the gradients across the parts."""

    shares: tuple[PartShare, ...]
    cross: float

    @property
    def step_time(self) -> float:
        return max(s.step for s in self.shares) + self.cross

    def label(self) -> str:
        return "dp across parts: " + " | ".join(s.layout.label() for s in self.shares)


def replica_shapes(workload: Workload, cluster: Cluster, micro: int) -> Iterator[Layout]:
    """Every replica shape a part holds at ``micro``: tp within its node dividing the heads,
    the vocabulary and the sequence, ring context parallelism of 1-8 where it splits the
    sequence (``space.ring_shapes``, as ``mixed.stage_shapes``), pp of 1-8 stages (at
    most the layers), the part's GPUs split into whole replicas, ZeRO-1 where there are
    replicas to shard over, no or full recomputation. Its microbatches are its pipeline's
    depth (the least a 1F1B runs)."""
    m, seq = workload.model, workload.seq_len
    for tp, cp in ring_shapes(m, seq, cluster.gpus_per_node, cluster.gpus):
        for pp in PIPELINES:
            if pp > m.n_layers or (cluster.gpus // (tp * cp)) % pp:
                continue
            replicas = cluster.gpus // (tp * cp * pp)
            for zero, recompute in itertools.product((0, 1) if replicas > 1 else (0,),
                                                     RECOMPUTE):
                yield Layout(pp=pp, dp_replicate=1 if zero else replicas,
                             dp_shard=replicas if zero else 1, zero_stage=zero, cp=cp,
                             cp_mode="ring", tp=tp, sequence_parallel=tp > 1,
                             schedule="1f1b" if pp > 1 else "none", micro_batch=micro,
                             microbatches=pp, recompute=recompute)


class PartModel:
    """One part's cost model and its step at any microbatch count (cached)."""

    def __init__(self, workload: Workload, cluster: Cluster, framework: Framework,
                 fp8: bool | str, budget: float):
        self.cluster, self.budget = cluster, budget
        self.model = CostModel(workload.model, workload.seq_len, workload.global_batch, cluster,
                               framework=framework, fp8=fp8)
        self._steps: dict[Layout, float] = {}

    def step(self, lay: Layout, microbatches: int) -> float:
        """The part's estimated step (the pipeline's closed form) at ``microbatches``."""
        lay = replace(lay, microbatches=microbatches)
        step = self._steps.get(lay)
        if step is None:
            step = self._steps[lay] = self.model.evaluate(lay).step_time
        return step

    def line(self, lay: Layout) -> tuple[float, float]:
        """(a, b) of the part's step a + b m, from its steps at pp and pp + 64 microbatches."""
        low, high = lay.pp, lay.pp + 64
        # a microbatch always adds work; the floor keeps the balance's division defined
        slope = max(1e-12, (self.step(lay, high) - self.step(lay, low)) / (high - low))
        return self.step(lay, low) - slope * low, slope

    def fits(self, lay: Layout) -> bool:
        """Whether the part holds ``lay`` at any microbatch count: its peak is the same from
        two microbatches on (a 1F1B keeps at most pp in flight; one microbatch's gradients
        are not held through a second's backward)."""
        lay = replace(lay, microbatches=max(lay.pp, 2))
        return sum(self.model.memory(lay).values()) <= self.budget

    def priced(self, part: int, lay: Layout, microbatches: int) -> PartShare:
        """The part's share at ``microbatches``, its pipeline simulated."""
        lay = replace(lay, microbatches=microbatches)
        cost = simulate_step(self.model, self.model.evaluate(lay))
        return PartShare(part, lay, cost.step_time, cost.memory_total)


def _shifted_or(reach: int, step: int, count: int) -> int:
    """``reach | reach << step | ... | reach << step * (count - 1)`` in O(log count) shifts:
    the sums reachable after adding ``step`` times any of ``count`` consecutive counts."""
    out, offset, block, size = 0, 0, reach, 1
    while count:
        if count & 1:
            out |= block << (step * offset)
            offset += size
        block |= block << (step * size)
        size *= 2
        count >>= 1
    return out


def balance(lines: Sequence[tuple[float, float]], replicas: Sequence[int],
            least: Sequence[int], units: int) -> list[int] | None:
    """Microbatches per replica of each part, ``sum(replicas[i] * m[i]) == units`` and
    ``m[i] >= least[i]``, minimising the slowest part's ``a_i + b_i m_i`` (``lines``); None
    when no split sums exactly. Exact: the slowest part's time is one of the lines' values,
    so those are searched by bisection, each tried by whether some split with every part
    within it reaches ``units`` (the reachable sums kept as the bits of an integer, a part's
    range of counts added by doubling), and the split is read back from the sums."""
    parts = range(len(lines))
    top = [units // r for r in replicas]
    if any(top[i] < least[i] for i in parts):
        return None
    mask = (1 << (units + 1)) - 1

    def caps(limit: float) -> list[int]:
        return [min(top[i], math.floor((limit - lines[i][0]) / lines[i][1] + 1e-9))
                for i in parts]

    def reachable(cap: list[int]) -> list[int] | None:
        sums = [1]  # sums[i]: the totals parts 0..i-1 reach within their caps
        for i in parts:
            if cap[i] < least[i]:
                return None
            span = _shifted_or(sums[-1], replicas[i], cap[i] - least[i] + 1)
            sums.append((span << (replicas[i] * least[i])) & mask)
        return sums if sums[-1] >> units & 1 else None

    limits = sorted({a + b * m for (a, b), lo, hi in zip(lines, least, top)
                     for m in range(lo, hi + 1)})
    low, high = 0, len(limits) - 1
    if reachable(caps(limits[high])) is None:
        return None
    while low < high:
        mid = (low + high) // 2
        if reachable(caps(limits[mid])) is None:
            low = mid + 1
        else:
            high = mid
    cap = caps(limits[low])
    sums, left, split = reachable(cap), units, [0] * len(lines)
    for i in reversed(parts):  # a count for part i that leaves a total the parts before reach
        split[i] = next(m for m in range(least[i], cap[i] + 1)
                        if left - replicas[i] * m >= 0
                        and sums[i] >> (left - replicas[i] * m) & 1)
        left -= replicas[i] * split[i]
    return split


def cross_part_reduction(workload: Workload, parts: Sequence[Cluster], between, grad_bytes: int
                         ) -> float:
    """Seconds of the all-reduce of the gradients' shards across the parts over ``between``
    (each GPU of the smallest part holds the largest shard: the gradient over its GPUs)."""
    gradient = parameter_count(workload.model) * grad_bytes
    return allreduce_time(gradient / min(c.gpus for c in parts), len(parts), between)


def plan_replicas(workload: Workload, parts: Sequence[Cluster], between, *,
                  framework: Framework = LOOM, fp8: bool | str = False,
                  memory_fraction: float = 0.9, top: int = 5) -> list[MixedReplicas]:
    """The ``top`` fastest data-parallel layouts across ``parts`` that fit, fastest first."""
    fraction = min(memory_fraction, 1.0 - framework.allocator_reserve)
    models = [PartModel(workload, c, framework, fp8, c.gpu.memory_bytes * fraction)
              for c in parts]
    cross = cross_part_reduction(workload, parts, between, models[0].model.grad_bytes)
    found: list[MixedReplicas] = []
    for micro in MICRO_BATCHES:
        if workload.global_batch % micro:
            continue
        units = workload.global_batch // micro
        kept = []
        for model in models:
            shapes = [lay for lay in replica_shapes(workload, model.cluster, micro)
                      if model.fits(lay)]
            # fastest per sequence at a share of the batch in proportion to the part's GPUs
            share = max(1, units * model.cluster.gpus // sum(c.gpus for c in parts))
            shapes.sort(key=lambda lay: model.step(lay, max(lay.pp, share // lay.dp))
                        / (lay.dp * max(lay.pp, share // lay.dp)))
            kept.append(shapes[:KEEP])
        for combo in itertools.product(*kept):
            lines = [model.line(lay) for model, lay in zip(models, combo)]
            split = balance(lines, [lay.dp for lay in combo], [lay.pp for lay in combo], units)
            if split is None:
                continue
            shares = tuple(model.priced(i, lay, m)
                           for i, (model, lay, m) in enumerate(zip(models, combo, split)))
            found.append(MixedReplicas(shares, cross))
    found.sort(key=lambda r: (r.step_time, r.label()))
    return found[:top]


def describe(parts: Sequence[Cluster], priced: MixedReplicas) -> str:
    """One line: each part's replicas, their shape and their share of the batch."""
    return " | ".join(
        f"{parts[s.part].gpu.name} x {parts[s.part].gpus}: {s.replicas} replica(s) of"
        f" {s.layout.microbatches} x {s.layout.micro_batch} sequences"
        for s in priced.shares)


__all__ = ["MixedReplicas", "PartShare", "balance", "cross_part_reduction", "describe",
           "plan_replicas", "replica_shapes"]
