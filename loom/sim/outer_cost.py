"""Cross-site data parallelism in the planner: each outer mode's step on a chosen layout.

``loom plan --sites N --site-link LINK`` asks what a layout's step costs when its data-parallel
replicas (``dp_replicate``) sit on N sites joined by a slow link, under each of Loom's
``parallel.dp_mode``s (``loom.parallel.outer``): ``sync`` all-reduces the gradients across the
sites every step; ``diloco``, ``noloco`` and ``co2`` run H inner steps inside each replica and
synchronise the fp32 pseudo-gradients once per H (the link formulas of
``loom.formulas.outer``, which also give the bytes a measured run counts).

How a step is priced:

* **One replica's step** (``replica_step``): the same layout on one replica's share of the
  GPUs and of the global batch, priced by the cost model with its own (intra-site) data
  parallelism over ``dp_shard x cp``; that is every mode's inner step.
* **The cross-site part**, per rank: ranks holding the same shard in every replica form one
  group; all groups use the site's uplink at once, so each gets ``bandwidth / GPUs per site``.
  What one rank synchronises is the parameters it steps (``CostModel.stepped_parameters``: its
  ZeRO slices): gradients in the gradient dtype for ``sync``, fp32 pseudo-gradients for the
  outer modes. ``sync``'s all-reduce overlaps the backward (Loom's bucketed reducer), so only
  what the backward (taken as two thirds of the replica's compute) does not cover is exposed;
  DiLoCo's and NoLoCo's outer step blocks; CO2's hides behind the next H steps.

Memory: every outer mode keeps an fp32 snapshot and momentum of the parameters a rank steps
(co2 also its displacement and pending average: ``loom.formulas.memory.outer_loop_state_bytes``,
the trainer's estimator's formula), on top of one replica's step; ``recommend`` chooses among
the modes that fit.

``recommend`` picks the mode a user of these papers would: ``sync`` when its step is within the
tolerance of one replica's step (cross-site cost nearly free), else the outer mode and the
smallest H that brings the step within it (a larger H costs convergence, which the planner does
not price; DiLoCo reports matching sync's loss up to H = 500 at its scales), else the fastest.
Torch-free, like the rest of the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from loom.formulas.memory import outer_loop_state_bytes
from loom.formulas.outer import replica_link_cost
from loom.layout import Layout
from loom.sim.cost_model import CostModel, StepCost

OUTER_STEPS = (8, 32, 128)
RECOMMEND_TOLERANCE = 0.10  # a mode whose step is within 10% of one replica's is "free"


@dataclass(frozen=True)
class Sites:
    """``count`` sites, each with one uplink of ``bandwidth`` bytes/s (shared by its GPUs) and
    ``latency`` seconds one way."""

    count: int
    bandwidth: float
    latency: float
    name: str = ""

    def __post_init__(self) -> None:
        if self.count < 2:
            raise ValueError(f"sites: at least 2 (got {self.count})")
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError("sites: bandwidth > 0 and latency >= 0 are required")


@dataclass(frozen=True)
class ModeCost:
    """One mode's step: ``step_time`` = one replica's step + the exposed cross-site time."""

    mode: str
    outer_steps: int  # H (1 for sync)
    step_time: float
    exposed: float  # seconds per step the replicas wait for the sites' link
    link_busy: float  # seconds per step the link is busy
    bytes_per_step: float  # wire bytes one rank sends across sites per step
    memory: float = 0.0  # bytes on the worst rank: one replica's step + the outer loop's state
    fits: bool = True  # within the accelerator's memory


def replica_step(model: CostModel, lay: Layout) -> StepCost:
    """One replica's step of ``lay`` (its dp_replicate replicas priced as separate jobs)."""
    replicas = lay.dp_replicate
    cluster = replace(model.cluster, gpus=model.cluster.gpus // replicas)
    alone = CostModel(model.model, model.seq, model.batch // replicas, cluster,
                      dtype_bytes=model.e, grad_bytes=model.grad_bytes,
                      op_overhead=model.op_overhead, framework=model.framework,
                      fp8=model.fp8_recipe, fp8_all_gather=model.fp8_all_gather)
    return alone.evaluate(replace(lay, dp_replicate=1))


def price_modes(model: CostModel, lay: Layout, sites: Sites,
                outer_steps: Sequence[int] = OUTER_STEPS) -> tuple[StepCost, list[ModeCost]]:
    """One replica's step and every mode's (sync, then diloco, noloco and co2 at each H)."""
    replicas = lay.dp_replicate
    if replicas < sites.count or replicas % sites.count:
        raise ValueError(f"dp_replicate = {replicas} must be a multiple of the {sites.count}"
                         " sites (each site holds whole replicas)")
    inner = replica_step(model, lay)
    per_site = model.cluster.gpus // sites.count
    bandwidth = sites.bandwidth / per_site  # every group of ranks shares the uplink
    stepped = model.stepped_parameters(lay)
    backward = inner.compute * 2 / 3
    limit = model.cluster.gpu.memory_bytes
    costs = []
    sync = replica_link_cost("sync", message_bytes=stepped * model.grad_bytes, replicas=replicas,
                             bandwidth_bytes_per_s=bandwidth, latency_s=sites.latency)
    exposed = max(0.0, sync.comm_time_per_step_s - backward)
    costs.append(ModeCost("sync", 1, inner.step_time + exposed, exposed,
                          sync.comm_time_per_step_s, sync.bytes_per_step, inner.memory_total,
                          inner.memory_total <= limit))
    for mode in ("diloco", "noloco", "co2"):
        memory = inner.memory_total + outer_loop_state_bytes(stepped, mode)
        for h in outer_steps:
            link = replica_link_cost(mode, message_bytes=4 * stepped, replicas=replicas,
                                     bandwidth_bytes_per_s=bandwidth, latency_s=sites.latency,
                                     outer_steps=h, compute_time_per_step_s=inner.step_time)
            costs.append(ModeCost(mode, h, inner.step_time + link.exposed_time_per_step_s,
                                  link.exposed_time_per_step_s, link.comm_time_per_step_s,
                                  link.bytes_per_step, memory, memory <= limit))
    return inner, costs


def recommend(inner: StepCost, costs: Sequence[ModeCost],
              tolerance: float = RECOMMEND_TOLERANCE) -> ModeCost:
    """``sync`` if within ``tolerance`` of one replica's step; else the outer mode with the
    smallest H within it (ties: the fastest); else the fastest mode. Only modes that fit in
    memory are chosen from (an outer loop adds its fp32 snapshot and momentum, co2 twice that),
    unless none does: then the same rule over all of them."""
    fitting = [c for c in costs if c.fits] or list(costs)
    bar = inner.step_time * (1 + tolerance)
    if fitting[0].mode == "sync" and fitting[0].step_time <= bar:
        return fitting[0]
    within = [c for c in fitting if c.mode != "sync" and c.step_time <= bar]
    if within:
        return min(within, key=lambda c: (c.outer_steps, c.step_time))
    return min(fitting, key=lambda c: c.step_time)


__all__ = ["Sites", "ModeCost", "OUTER_STEPS", "replica_step", "price_modes", "recommend"]
