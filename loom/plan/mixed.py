"""Pipelines over unlike accelerators: ``loom plan --mixed FILE`` (issue 21 item 3), ranked
together with data parallelism across them (``loom.plan.mixed_dp``, ``rank_mixed``).

A mixed cluster is two to four *parts*. Each part is a homogeneous group of nodes: one
accelerator type, its node size and its links. A *between* link joins the parts. The systems
published for such clusters keep data and tensor parallelism inside a part, where the links
are alike, and put pipeline stages on the different node types: Holmes (Yang et al. 2023,
clusters with unlike NICs), Metis (Um et al. 2024, unlike GPUs), Pipette, Cephalo. Loom's
planner does the same.

* **One stage shape for the whole pipeline.** Each stage has tp x cp x dp ranks (ring context
  parallelism; plain replicas, or ZeRO-1 over dp) and the same micro batch, recomputation and
  1F1B schedule. Every microbatch crosses every stage, so the stages share the data
  parallelism and the batch.
* **Part i holds gpus_i / (tp x cp x dp) consecutive stages.** The order of the parts along
  the pipeline is searched: the first stage holds the most microbatches in flight. A pipeline
  whose busiest stage's work over the microbatches is already slower than the table's last
  is not simulated.
* **The layers are split unevenly** (``split_layers``). Each layer goes to the stage that would
  finish it soonest: a stage of part i with n layers costs n times that part's per-layer F + I
  + W, and the last stage the head too. This greedy is optimal for identical jobs on machines
  of unequal speed. No stage gets more layers than fit its accelerator.
* **Priced with the homogeneous planner's pieces.** The stages' F / I / W go through the same
  schedule replay (``search.family_makespan``). Every hop is priced at the slowest hop's send,
  the between link's: an upper bound, since the hops inside a part are faster. Each part's
  data-parallel reduction and ZeRO gathers run on its own links, and the step pays the slowest
  part's, as it does the optimizer step.
* **Memory.** A stage of n layers on part i is priced by that part's cost model on a virtual
  pipeline of the same shape whose every stage holds n layers (a model of n x pp layers). That
  model reports its worst rank: the first stage, with the embedding and pp microbatches in
  flight. So a later stage is over-counted and never under-counted: the planner may turn down a
  layout that would fit, but it does not propose one that runs out of memory. The same virtual
  pipeline gives the part's data-parallel and optimizer time.

Written here rather than taken from Metis or Holmes: both are research code tied to their own
runtimes and cost profiles, and the planner's value is pricing with Loom's own cost model and
schedule replay, which a port could not reuse. Torch-free, communicates nothing.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loom.errors import InputFileError, loads_toml, read_input_text
from loom.layout import Layout
from loom.plan.hardware import TOPOLOGY_KEYS, Cluster, HardwareError, Link, make_cluster
from loom.plan.mixed_dp import MixedReplicas, plan_replicas
from loom.plan.mixed_dp import describe as describe_replicas
from loom.plan.search import family_makespan
from loom.plan.space import Workload, ring_shapes
from loom.schedule.cost import OpCosts, StageCosts
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import LOOM, Framework

MAX_PARTS = 4  # the parts' orders are all tried: 4! = 24
PART_KEYS = {"gpu", "gpus", "gpus_per_node", "intra", "inter", *TOPOLOGY_KEYS}
MICRO_BATCHES = (1, 2, 4)
RECOMPUTE = ("none", "full")


class MixedClusterError(ValueError):
    """A ``--mixed`` file breaks a rule; ``str()`` names the field and the rule."""


@dataclass(frozen=True)
class MixedCluster:
    """The parts (homogeneous clusters, in the file's order) and the link joining them."""

    parts: tuple[Cluster, ...]
    between: Link

    @property
    def gpus(self) -> int:
        return sum(part.gpus for part in self.parts)

    def describe(self) -> str:
        return " + ".join(f"{p.gpus} x {p.gpu.name}" for p in self.parts) + \
            f", joined by {self.between.name} ({self.between.bandwidth / 1e9:g} GB/s)"


def load_mixed(path: str | Path, catalog: tuple[dict, dict, dict]) -> MixedCluster:
    """The mixed cluster described by the TOML file at ``path`` (``[[part]]`` tables of
    ``gpu``, ``gpus`` and optionally ``gpus_per_node``, ``intra``, ``inter`` and the topology
    keys of ``hardware.TOPOLOGY_KEYS``, e.g. ``nodes_per_rack``; an optional
    ``[between]`` table with ``link``), its names looked up in ``catalog``
    (``hardware.load_catalog``). Raises ``MixedClusterError`` naming the field."""
    try:
        data = loads_toml(read_input_text(path))
    except InputFileError as err:
        raise MixedClusterError(f"--mixed {path}: {err}") from None
    except ValueError as err:  # a TOML decode error
        raise MixedClusterError(f"--mixed {path}: not valid TOML ({err})") from None
    unknown = set(data) - {"part", "between"}
    if unknown:
        raise MixedClusterError(f"--mixed {sorted(unknown)[0]}: unknown table (part, between)")
    parts = data.get("part")
    if not isinstance(parts, list) or not 2 <= len(parts) <= MAX_PARTS:
        raise MixedClusterError(f"--mixed part: needs 2 to {MAX_PARTS} [[part]] tables")
    clusters = []
    for k, part in enumerate(parts):
        where = f"--mixed part[{k}]"
        if not isinstance(part, dict):
            raise MixedClusterError(f"{where}: must be a table")
        extra = set(part) - PART_KEYS
        if extra:
            raise MixedClusterError(f"{where}.{sorted(extra)[0]}: unknown key"
                                    f" ({', '.join(sorted(PART_KEYS))})")
        for key in ("gpu", "gpus"):
            if key not in part:
                raise MixedClusterError(f"{where}.{key}: required")
        gpus = part["gpus"]
        if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 10**6:
            raise MixedClusterError(f"{where}.gpus: {gpus!r} must be a whole number in"
                                    " [1, 1000000]")
        for key in ("gpu", "intra", "inter"):
            if key in part and not isinstance(part[key], str):
                raise MixedClusterError(f"{where}.{key}: {part[key]!r} must be a name")
        try:
            network = {key: part[key] for key in TOPOLOGY_KEYS if key in part}
            clusters.append(make_cluster(part["gpu"], gpus, part.get("gpus_per_node"),
                                         intra=part.get("intra"), inter=part.get("inter"),
                                         catalog=catalog, network=network or None))
        except HardwareError as err:  # its "--gpu Z80: ..." becomes "part[0].gpu Z80: ..."
            text = str(err)
            raise MixedClusterError(f"{where}.{text[2:]}" if text.startswith("--")
                                    else f"{where}: {text}") from None
    between = data.get("between", {})
    if not isinstance(between, dict) or set(between) - {"link"}:
        raise MixedClusterError("--mixed between: a table with one key, link")
    if "link" in between:
        name = between["link"]
        if not isinstance(name, str) or name not in catalog[1]:
            raise MixedClusterError(f"--mixed between.link {name!r}: unknown link; known:"
                                    f" {', '.join(catalog[1])}")
        link = catalog[1][name]
    else:  # the slowest of the parts' own network links
        link = min((c.inter for c in clusters), key=lambda lk: lk.effective_bandwidth)
    return MixedCluster(tuple(clusters), link)


def split_layers(n_layers: int, per_layer: Sequence[float], head: float,
                 caps: Sequence[int]) -> list[int] | None:
    """Layers per stage (one or more each, at most ``caps[s]``) minimizing the slowest stage,
    where stage s costs ``per_layer[s]`` per layer and the last one ``head`` more: each layer
    goes to the stage that would finish it soonest (optimal for identical jobs on machines of
    unequal speed). None when the layers cannot be placed within the caps."""
    stages = len(per_layer)
    if n_layers < stages or min(caps) < 1 or sum(caps) < n_layers:
        return None
    layers = [1] * stages
    load = [per_layer[s] + (head if s == stages - 1 else 0.0) for s in range(stages)]
    heap = [(load[s] + per_layer[s], s) for s in range(stages) if caps[s] > 1]
    heapq.heapify(heap)
    for _ in range(n_layers - stages):
        finish, s = heapq.heappop(heap)
        layers[s] += 1
        load[s] = finish
        if layers[s] < caps[s]:
            heapq.heappush(heap, (finish + per_layer[s], s))
    return layers


@dataclass(frozen=True)
class MixedLayout:
    """One priced pipeline over the parts: the stage shape (``layout``, pp = every stage), the
    parts along the pipeline (indices into ``MixedCluster.parts``), each part's stage count,
    every stage's layers, and the step's seconds."""

    layout: Layout
    order: tuple[int, ...]
    stages: tuple[int, ...]  # per part, in ``order``
    layers: tuple[int, ...]  # per stage, along the pipeline
    pipeline: float
    dp_exposed: float
    optimizer: float
    memory: tuple[float, ...]  # per part, in ``order``: its worst stage's bytes (upper bound)

    @property
    def step_time(self) -> float:
        return self.pipeline + self.dp_exposed + self.optimizer


def stage_shapes(workload: Workload, mixed: MixedCluster) -> Iterator[tuple[Layout,
                                                                           tuple[int, ...]]]:
    """Every stage shape the parts can all hold, with each part's stage count: tp within the
    smallest node and dividing the heads, the vocabulary and the sequence (sequence
    parallelism's split), ring cp of 1 to 8 where it splits the sequence, dp dividing every
    part's GPUs over tp x cp, ZeRO-1 (over dp) or plain replicas, a micro batch that divides
    the batch into at least one microbatch per stage, no or full recomputation."""
    m = workload.model
    per_node = min(part.gpus_per_node for part in mixed.parts)
    common = math.gcd(*(part.gpus for part in mixed.parts))
    seq = workload.seq_len
    for tp, cp in ring_shapes(m, seq, per_node, common):  # the homogeneous space's rules
        rest = common // (tp * cp)
        for dp in (d for d in range(1, rest + 1) if rest % d == 0):
            stages = tuple(part.gpus // (tp * cp * dp) for part in mixed.parts)
            pp = sum(stages)
            if pp < 2 or pp > m.n_layers:
                continue
            for zero, micro, recompute in itertools.product(
                    (0, 1) if dp * cp > 1 else (0,), MICRO_BATCHES, RECOMPUTE):
                if workload.global_batch % (dp * micro) or (zero and dp == 1):
                    continue
                microbatches = workload.global_batch // (dp * micro)
                if microbatches < pp:
                    continue
                yield Layout(pp=pp, dp_replicate=1 if zero else dp,
                             dp_shard=dp if zero else 1, zero_stage=zero, cp=cp,
                             cp_mode="ring", tp=tp, sequence_parallel=tp > 1,
                             schedule="1f1b", micro_batch=micro, microbatches=microbatches,
                             recompute=recompute), stages


class PartCosts:
    """A part's cost models for one stage shape: per-layer and head times, and the virtual
    pipelines (every stage n layers) that price a stage of n layers' memory, data-parallel and
    optimizer time, cached by n."""

    def __init__(self, workload: Workload, cluster: Cluster, lay: Layout, framework: Framework,
                 fp8: bool | str, budget: float):
        self.workload, self.cluster, self.lay, self.framework = workload, cluster, lay, framework
        self.fp8, self.budget = fp8, budget
        self.model = self._model(workload.model.n_layers)
        self.per_layer = self.model.layer_pass_times(lay)
        self.head = self.model.head_pass_times(lay)
        self._virtual: dict[int, Any] = {}

    def _model(self, n_layers: int) -> CostModel:
        args = replace(self.workload.model, n_layers=n_layers)
        return CostModel(args, self.workload.seq_len, self.workload.global_batch, self.cluster,
                         framework=self.framework, fp8=self.fp8)

    def virtual(self, layers: int) -> Any:
        """The step cost of a pipeline of this shape whose every stage holds ``layers``."""
        cost = self._virtual.get(layers)
        if cost is None:
            model = self._model(layers * self.lay.pp)
            cost = self._virtual[layers] = model.evaluate(self.lay)
        return cost

    @functools.cached_property
    def cap(self) -> int:
        """The most layers a stage of this part holds within the budget (0: not one)."""
        low, high = 0, self.workload.model.n_layers
        while low < high:  # memory grows with the layers
            mid = (low + high + 1) // 2
            if self.virtual(mid).memory_total <= self.budget:
                low = mid
            else:
                high = mid - 1
        return low


def price_mixed(workload: Workload, mixed: MixedCluster, lay: Layout,
                stages: tuple[int, ...], order: tuple[int, ...], parts: dict[int, PartCosts],
                ceiling: float = math.inf) -> MixedLayout | None:
    """``lay`` over the parts in ``order`` (``parts``: each part's ``PartCosts`` for this shape);
    None when the layers do not fit, or when the busiest stage's work over the microbatches,
    a lower bound of the step, is already above ``ceiling`` (the planner's bound: the slowest
    layout it keeps)."""
    along = [i for i in order for _ in range(stages[i])]  # the part of each stage
    per_layer = [sum(parts[i].per_layer) for i in along]
    head = parts[along[-1]].head
    caps = {i: parts[i].cap for i in order}
    layers = split_layers(workload.model.n_layers, per_layer, sum(head),
                          [caps[i] for i in along])
    if layers is None:
        return None
    ops = []
    for s, (i, n) in enumerate(zip(along, layers)):
        f, b, w = (n * x for x in parts[i].per_layer)
        if s == len(along) - 1:
            f, b, w = f + head[0], b + head[1], w + head[2]
        ops.append(OpCosts(f, b, w))
    if lay.microbatches * max(op.f + op.i + op.w for op in ops) > ceiling:
        return None  # (one equal to it may still tie into the table)
    hops = [parts[along[s]].model.send_time(lay) if along[s] == along[s + 1]
            else parts[along[s]].model.send_time(lay, mixed.between)
            for s in range(len(along) - 1)]
    stage_costs = StageCosts(tuple(ops), latency=max(hops))
    pipeline = family_makespan("1f1b", lay.pp, lay.microbatches, None, stage_costs)
    most = {i: max(n for j, n in zip(along, layers) if j == i) for i in order}
    worst = {i: parts[i].virtual(most[i]) for i in order}
    return MixedLayout(lay, order, tuple(stages[i] for i in order), tuple(layers), pipeline,
                       max(worst[i].dp_exposed for i in order),
                       max(worst[i].optimizer for i in order),
                       tuple(worst[i].memory_total for i in order))


def plan_mixed(workload: Workload, mixed: MixedCluster, *, framework: Framework = LOOM,
               fp8: bool | str = False, memory_fraction: float = 0.9, top: int = 5
               ) -> list[MixedLayout]:
    """The ``top`` fastest pipelines over ``mixed`` that fit, fastest first."""
    found = []
    for lay, stages in stage_shapes(workload, mixed):
        parts = {i: PartCosts(workload, cluster, lay, framework, fp8,
                          cluster.gpu.memory_bytes * min(memory_fraction,
                                                         1.0 - framework.allocator_reserve))
                 for i, cluster in enumerate(mixed.parts)}
        for order in itertools.permutations(range(len(mixed.parts))):
            # the top-th fastest kept so far bounds the rest (a floor above it cannot enter
            # the table)
            ceiling = found[top - 1].step_time if len(found) >= top else math.inf
            priced = price_mixed(workload, mixed, lay, stages, order, parts, ceiling)
            if priced is not None:
                found.append(priced)
                found.sort(key=lambda p: (p.step_time, p.layout.label(), p.order))
                del found[top:]
    return found


def rank_mixed(workload: Workload, mixed: MixedCluster, *, framework: Framework = LOOM,
               fp8: bool | str = False, memory_fraction: float = 0.9, top: int = 5
               ) -> list[MixedLayout | MixedReplicas]:
    """``loom plan --mixed``'s ranking: the ``top`` fastest of the pipelines over the parts
    (``plan_mixed``) and the data-parallel layouts across them (``mixed_dp.plan_replicas``)."""
    options = dict(framework=framework, fp8=fp8, memory_fraction=memory_fraction, top=top)
    ranked: list[MixedLayout | MixedReplicas] = [
        *plan_mixed(workload, mixed, **options),
        *plan_replicas(workload, mixed.parts, mixed.between, **options)]
    ranked.sort(key=lambda p: p.step_time)
    return ranked[:top]


def describe(mixed: MixedCluster, priced: MixedLayout) -> str:
    """One line: the parts along the pipeline with their stages and layers per stage."""
    out, s = [], 0
    for i, count in zip(priced.order, priced.stages):
        layers = priced.layers[s:s + count]
        span = f"{min(layers)}" if min(layers) == max(layers) else f"{min(layers)}-{max(layers)}"
        out.append(f"{mixed.parts[i].gpu.name} x {mixed.parts[i].gpus}: {count} stage(s) of"
                   f" {span} layers")
        s += count
    return " | ".join(out)


def _as_data(mixed: MixedCluster, p: MixedLayout | MixedReplicas, tokens: int) -> dict:
    per_gpu = tokens / p.step_time / mixed.gpus
    if isinstance(p, MixedReplicas):
        return {"kind": "data_parallel", "layout": p.label(), "step_time_s": p.step_time,
                "cross_part_reduction_s": p.cross, "tokens_per_s_per_gpu": per_gpu, "parts": [
                    {"gpu": mixed.parts[s.part].gpu.name, "layout": s.layout.label(),
                     "replicas": s.replicas, "sequences": s.sequences, "step_time_s": s.step,
                     "memory_gib": s.memory / 2**30} for s in p.shares]}
    return {"kind": "pipeline", "layout": p.layout.label(), "parts_along_pipeline": [
        mixed.parts[i].gpu.name for i in p.order], "stages_per_part": list(p.stages),
        "layers_per_stage": list(p.layers), "step_time_s": p.step_time,
        "pipeline_s": p.pipeline, "dp_exposed_s": p.dp_exposed, "optimizer_s": p.optimizer,
        "tokens_per_s_per_gpu": per_gpu, "memory_gib_per_part": [m / 2**30 for m in p.memory]}


def report(workload: Workload, mixed: MixedCluster,
           ranked: Sequence[MixedLayout | MixedReplicas], as_json: bool = False) -> str:
    """``loom plan --mixed``'s answer: the ranked pipelines over the parts (each with its
    parts' stages and layers and their worst stage's memory) and data-parallel layouts across
    them (each part's replicas and share of the batch), as a table or as JSON; with none, why."""
    tokens = workload.global_batch * workload.seq_len
    if as_json:
        return json.dumps({"cluster": mixed.describe(),
                           "ranked": [_as_data(mixed, p, tokens) for p in ranked]})
    lines = [f"{workload.name} on {mixed.describe()}: pipelines over the parts (1F1B; stage"
             " memory an upper bound) and data parallelism across them (each part's replicas"
             " on a share of the batch)"]
    if not ranked:
        shaped = next(stage_shapes(workload, mixed), None) is not None
        lines.append("no layout over these parts fits in memory" if shaped else
                     "no stage shape fits these parts and this batch: each part must split into"
                     " whole stages of tp x cp x dp ranks, and the batch must give every stage"
                     " a microbatch (and, across the parts, every replica one)")
    for k, p in enumerate(ranked, 1):
        rate = f"step {p.step_time:8.3f} s  {tokens / p.step_time / mixed.gpus:10,.0f}" \
            " tokens/s/GPU"
        if isinstance(p, MixedReplicas):
            lines += [f"{k}. data parallel across the parts{'':<14} {rate}",
                      f"   {describe_replicas(mixed.parts, p)}",
                      "   replicas: " + ", ".join(f"{mixed.parts[s.part].gpu.name}"
                                                  f" {s.layout.label()}" for s in p.shares),
                      f"   gradients across the parts {p.cross:.3f} s; memory (GiB): "
                      + ", ".join(f"{mixed.parts[s.part].gpu.name} {s.memory / 2**30:.1f}"
                                  for s in p.shares)]
            continue
        lines += [f"{k}. {p.layout.label():<44} {rate}",
                  f"   {describe(mixed, p)}",
                  "   memory (worst stage, GiB): " + ", ".join(
                      f"{mixed.parts[i].gpu.name} {m / 2**30:.1f}"
                      for i, m in zip(p.order, p.memory))]
    return "\n".join(lines)


__all__ = ["MixedCluster", "MixedClusterError", "MixedLayout", "PartCosts", "load_mixed",
           "plan_mixed", "price_mixed", "rank_mixed", "split_layers", "stage_shapes", "describe",
           "report"]
