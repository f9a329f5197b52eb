"""Rank every layout of a workload on a cluster by predicted step time, within memory.

Three passes, each cheaper per layout than the next:

1. **Screen** every layout of ``loom.plan.space`` with ``CostModel.evaluate``: memory from the
   estimator's formulas, the pipelined part from the family's closed-form bubble. Layouts over
   the memory budget are dropped; of a group that differs only in recomputation the first that
   fits is kept (more recomputation is never faster). Branch and bound: groups whose model
   state alone exceeds the budget are dropped unpriced (``memory_floor``), the others are priced
   in order of their compute floor (``CostModel.compute_floor``: the busiest rank's passes, a
   lower bound of the step), and the screen stops at the first group whose floor is slower than
   every layout kept. The answer equals pricing every group (``exhaustive``; tested), and the
   1T-on-3,072-GPU plan prices about 2,500 layouts instead of 7,400.
2. **Simulate** the best ``finalists`` with Loom's own schedule generator and event simulator
   (``loom.schedule.simulate``) on the per-stage F / I / W costs, so the ranking rests on the schedule
   the runtime would execute. Long pipelines are simulated for ``2p`` and ``3p`` microbatches and
   extended linearly: past the warm-up every family settles into a steady state that adds the
   same time per microbatch (the busiest rank's work, or more for V-Half and V-Min, whose
   steady state keeps a bubble when F, I and W differ); checked against full simulations in
   the tests. A searched schedule (``schedule = "search"``) is given the activation units the
   memory budget leaves on its worst rank (at most 2p), and its simulation runs the very search
   ``loom train`` runs for the config written (the same limit, per-rank relative costs and
   placement; deterministic), over all m; the best ``SEARCH_FINALISTS`` of them are simulated
   beside the finalists unless their estimate, a rough one, is ``SEARCH_MARGIN`` behind.
3. **Check runnability** with Loom's own config rules (``loom.config.resolve``): combinations this
   version of Loom still refuses are reported with the rule, not proposed.
"""

from __future__ import annotations

import functools
import heapq
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from loom.config import Config, ConfigError, load_config, resolve, with_layout
from loom.config_rules import validate_batch
from loom.config_rules.pipeline import validate_step_size, validate_vocab_pp
from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import Cluster
from loom.plan.space import LayoutGroup, Workload, layouts, vocab_pp_fits
from loom.schedule import families as schedules
from loom.schedule.select import SEARCH, schedule_of
from loom.schedule.paths import SKIPPIPE
from loom.schedule.ir import Schedule
from loom.schedule.replay import encode
from loom.schedule.simulate import makespan as replayed_makespan, replay_shared, simulate
from loom.schedule.validate import peak_memory
from loom.sim.cost_memory import memory_floor, search_units_left
from loom.sim.cost_model import CostModel, StepCost
from loom.sim.cost_model import search_costs
from loom.sim.frameworks import LOOM


@dataclass
class Plan:
    """The ranked answer of ``plan``."""

    workload: Workload
    cluster: Cluster
    memory_budget: float
    ranked: list[StepCost]
    considered: int  # the whole space
    fitting: int  # examined and within the memory budget (the screen bounds the rest out)
    refused: Counter = field(default_factory=Counter)  # rule -> layouts refused by Loom's rules
    seconds: float = 0.0
    best_refused: StepCost | None = None  # faster than the first ranked, but Loom refuses it

    def tokens_per_second_per_gpu(self, cost: StepCost) -> float:
        return self.workload.tokens_per_step / cost.step_time / self.cluster.gpus

    def mfu(self, cost: StepCost) -> float:
        return cost.model_flops / cost.step_time / (self.cluster.gpus * self.cluster.gpu.peak_flops)


def simulate_step(model: CostModel, cost: StepCost, *, max_simulated: int | None = None) -> StepCost:
    """``cost`` with its pipelined part replaced by the simulated makespan of the real schedule."""
    lay = cost.layout
    if lay.pp == 1 or cost.stage_costs is None:
        return replace(cost, simulated=True)
    p, m = lay.pp, lay.microbatches
    stage_costs = cost.stage_costs.build()
    cores = model.shared_cores(lay)
    if lay.schedule == SEARCH:
        return _simulate_searched(model, cost, stage_costs, cores)

    # SkipPipe's paths are priced as GPipe over one replica's microbatches (``schedule_of``)
    family = "gpipe" if lay.schedule == SKIPPIPE else lay.schedule
    chunks = lay.chunks if family == "interleaved_1f1b" else None
    pipeline = family_makespan(family, p, m, chunks, stage_costs, cores, max_simulated)
    if lay.vocab_parallel_pp:  # the split embedding's messages at the step's edges
        pipeline += model.vocab_pass_times(lay)[4] * m
    return replace(cost, pipeline=pipeline, simulated=True)


def family_makespan(family: str, p: int, m: int, chunks: int | None, stage_costs: Any,
                    cores: float = 0.0, first: int | None = None) -> float:
    """The makespan of ``family``'s schedule of ``m`` microbatches over ``p`` ranks on
    ``stage_costs`` (``cores``: ranks sharing processors, 0 for none): simulated for ``first``
    microbatches (default 2p) and one pipeline length more, then extended by the steady
    state's slope (the module docstring)."""
    def makespan(microbatches: int) -> float:
        # the families' generators are validated for these sizes by their tests; the runtime's
        # schedule_for would validate again, which costs more than the simulation itself
        if cores:
            return _replay(_family(family, p, microbatches, chunks)[0], stage_costs, cores)
        schedule, rows = _family(family, p, microbatches, chunks)
        return replayed_makespan(schedule, stage_costs, rows)  # no timeline needed

    first = min(m, first or 2 * p)
    pipeline = makespan(first)
    if m > first:  # extend by the steady state's slope, measured one pipeline length later
        second = min(m, first + p)
        later = makespan(second)
        pipeline = later + (m - second) * (later - pipeline) / (second - first)
    return pipeline


@functools.lru_cache(maxsize=4)  # (a 64-rank V of 192 microbatches: ~10 MB)
def _family(name: str, pp: int, microbatches: int, chunks: int | None
            ) -> tuple[Schedule, list]:
    """A family's schedule (``chunks`` None: not passed, the family's own) and its rows as the
    replay's integer triples, cached: finalists that differ only in their data parallelism
    share them, and a 64-rank V's generation costs more than its replay."""
    generator = schedules.get(name)
    schedule = generator(pp, microbatches) if chunks is None \
        else generator(pp, microbatches, chunks=chunks)
    return schedule, encode(schedule)


def _replay(schedule: Any, stage_costs: Any, cores: float) -> float:
    """The makespan of ``schedule`` on ``stage_costs``; ranks sharing ``cores`` (0: none)."""
    if cores:  # ranks share processors (a CPU profile): the same replay, cores shared
        work = {a: float(stage_costs.duration(a)) for row in schedule.actions for a in row}
        return replay_shared(schedule, work, float(stage_costs.latency), cores)

    return float(simulate(schedule, stage_costs, memory=False).makespan)


def _simulate_searched(model: CostModel, cost: StepCost, stage_costs: Any,
                       cores: float) -> StepCost:
    """A searched layout's step: the very schedule ``loom train`` would search for (the same
    call, limit, relative costs and placement, so the same deterministic answer) replayed on the
    real per-stage costs, over all its microbatches (a searched schedule has no fixed steady
    state to extend); its activations at the peak the schedule reaches, not at the limit."""
    lay = cost.layout
    if not lay.schedule_costs:  # what ``plan`` fills in from the cost model
        lay = replace(lay, schedule_costs=search_costs(model, lay))
    schedule = schedule_of(lay, max_stages=model.model.n_layers)
    return replace(cost, layout=lay, pipeline=_replay(schedule, stage_costs, cores),
                   simulated=True, memory=model.memory(lay, peak_memory(schedule)))


def workload_config(work: Workload) -> Config:
    """The Loom config of ``work`` before any layout: its config file or model preset, its
    sequence length, bf16 compute (the global batch comes with the layout)."""
    preset = work.name if work.config_path is None and work.name in PRESETS else None
    # a shape from elsewhere (a Hugging Face config.json) is written in field by field
    shape = () if work.config_path or preset else tuple(
        (f"model.{k}", tuple(v) if isinstance(v, list) else v)
        for k, v in asdict(work.model).items())
    return _parsed(work.config_path, preset, shape, work.seq_len, work.fp8)


@functools.lru_cache(maxsize=8)
def _parsed(config_path: str | None, preset: str | None, shape: tuple[tuple[str, Any], ...],
            seq_len: int, fp8: str) -> Config:
    """Parsed once per workload (parsing TOML and presets per layout dominated the planner's
    time); ``with_layout`` copies the sections it changes, and nothing mutates the rest."""
    values: dict[str, Any] = {"data.seq_len": seq_len, "train.dtype": "bf16"}
    if fp8 != "none":
        values["train.fp8"] = fp8
    if preset:
        values["model.preset"] = preset
    values.update(shape)  # (hashable: the cache's key)
    return load_config(config_path, values)


def to_config(layout: Layout, work: Workload) -> Config:
    """The resolved Loom ``Config`` that trains ``work`` under ``layout`` (raises ConfigError):
    the workload's config with the layout written in by value (``loom.config.with_layout``),
    compiled as the workload says, and FSDP2's float8 all-gather where the workload asks for it
    and the layout is one the trainer builds it for (ZeRO-3 over dp_shard > 1, tp = 1)."""
    config = with_layout(workload_config(work), layout)
    gather = work.fp8_all_gather and layout.zero_stage == 3 and layout.dp_shard > 1 \
        and layout.tp == 1
    compiled = config.train.compile if work.compile is None else work.compile
    if gather or compiled != config.train.compile:
        config = replace(config, train=replace(config.train, compile=compiled,
                                               fp8_all_gather=gather))
    return resolve(config, layout.world)


def runnable(layout: Layout, work: Workload, *, exact: bool = True,
             representative: bool = False) -> str | None:
    """None when Loom's config rules accept ``layout`` for ``work``; else the refusal.

    ``exact=False`` checks the same layout with the fewest microbatches the space allows
    (m = pp): the rules then see the same combination of axes, schedule and knobs, while the
    schedule they generate and validate is small (a 64-stage pipeline with 512 microbatches takes
    seconds to validate; the space only yields m >= pp, which every family accepts).
    ``representative=True`` goes further for the screening's per-structure verdicts: a pipeline
    of two ranks and two microbatches with the same axes, schedule and knobs."""
    if (not exact or representative) and layout.pp > 1 and layout.microbatches > 2:
        # the batch and step-size rules at the real microbatch count, which the smaller
        # pipeline below hides
        try:
            config = with_layout(workload_config(work), layout)
            validate_batch(config)
            validate_step_size(config)
        except ConfigError as err:
            return f"{err.field_name}: {err.rule}"
    if not exact and layout.pp > 1 and layout.microbatches > layout.pp:
        layout = replace(layout, microbatches=layout.pp)
    # vocabulary parallelism over the pipeline needs V divisible by pp x tp, a size the space
    # checked at the real pp: the structure is checked there when two ranks would not divide it
    split_vocab = layout.vocab_parallel_pp and work.model.vocab_size % (2 * layout.tp)
    if representative and layout.pp > 2 and not split_vocab:  # the same structure, smallest pp
        layout = replace(layout, pp=2, microbatches=2, schedule_costs="",  # (costs: per rank)
                         schedule_memory_limit=min(layout.schedule_memory_limit, 2.0))
    try:
        to_config(layout, work)
    except ConfigError as err:
        return f"{err.field_name}: {err.rule}"
    return None


def check_vocab_pp(layout: Layout, work: Workload) -> None:
    """Raise the trainer's ``ConfigError`` (the field and the rule) when ``layout`` splits the
    vocabulary over its pipeline and the rules for that (``parallel.vocab_parallel_pp``: its
    axes, and the workload config's data packing, data-parallel mode, model and schedule) refuse
    it. Only these rules: ``--layout`` prices what-if layouts the other rules may refuse."""
    if layout.vocab_parallel_pp:
        validate_vocab_pp(with_layout(workload_config(work), layout))


# A finalist whose screening estimate exceeds the best simulated step by more than this is not
# simulated: the estimate is within 10% of the simulation for every family (tests/unit/plan).
SIMULATION_MARGIN = 1.15
# Wall-time budget for simulating pipelined finalists: a 64-rank V-Min schedule alone takes
# seconds to generate, and the issue asks for an answer within 10 s on a 2-core machine.
SIMULATION_SECONDS = 3.0
# A first guess of the simulator's cost per action (schedule generation and replay), so that one
# long simulation cannot overrun the budget; the slowest rate this call measures replaces it.
SECONDS_PER_ACTION = 5e-5
# The schedule search's time in those units: it replays many candidates (measured here: 0.2 s at
# p = 4, m = 8 and 0.9 s at p = 8, m = 32, about 70 actions' worth per rank and microbatch)
SEARCH_ACTIONS_PER_PASS = 72
# Searched layouts simulated beside the finalists whatever their screening estimate: it is a
# rough one (``loom.sim.pipeline_estimate.search_estimate``), and only the search finds out
SEARCH_FINALISTS = 2
SEARCH_MARGIN = 1.3  # ... unless even that estimate is this far behind the best simulated
# Pipeline layouts (the best kept, family schedules) whose twin with the vocabulary split over
# the pipeline (``Layout.vocab_parallel_pp``) is priced after the screen. Not every layout's:
# its memory replays the runtime's vocabulary schedule, 2 s per layout at pp = 64 here (the
# 1T plan took 533 s instead of 10 s with every twin in the space)
VOCAB_PP_TWINS = 3
# ... and of pipelines of at most this many p·m actions per pass (the replay's cost grows with
# them: p = 8, m = 64 takes about 0.1 s here), like the schedule search's ``SEARCH_MAX_WORK``
VOCAB_PP_MAX_WORK = 512


def _search_cap(lay: Layout) -> float:
    """The most activation units a searched schedule is given: 2p (ZB-H2's level, where the
    search's bubble is below 1% in Benchmark A) or every microbatch."""
    return float(min(2 * lay.pp, lay.microbatches))


def _with_memory_left(model: CostModel, lay: Layout, budget: float) -> Layout | None:
    """``lay`` (a searched schedule) with its limit set to the activation units the memory
    budget leaves on its worst rank and the search's relative costs; None if none are left."""
    units = search_units_left(model, lay, budget, _search_cap(lay))
    if units < 1:
        return None
    return replace(lay, schedule_memory_limit=units, schedule_costs=search_costs(model, lay))


def _simulated_actions(lay: Layout) -> int:
    """Actions ``simulate_step`` replays for ``lay`` (two schedule lengths, F, I and W each; a
    searched schedule's search counted as ``SEARCH_ACTIONS_PER_PASS`` per rank and microbatch)."""
    if lay.pp == 1:
        return 0
    if lay.schedule == "search":
        return SEARCH_ACTIONS_PER_PASS * lay.pp * lay.microbatches
    first = min(lay.microbatches, 2 * lay.pp)
    second = min(lay.microbatches, first + lay.pp)
    return 3 * lay.pp * max(1, lay.chunks) * (first + (second if second > first else 0))


def _structure(lay: Layout) -> tuple:
    """What Loom's "not implemented yet" rules look at: which axes are > 1 and the knobs. Sizes
    themselves are the space's business (it only yields divisible ones)."""
    return (lay.pp > 1, lay.dp_replicate > 1, lay.dp_shard > 1, lay.zero_stage, lay.ep > 1,
            lay.cp > 1, lay.cp_mode if lay.cp > 1 else "", lay.tp > 1, lay.sequence_parallel,
            lay.schedule, lay.recompute != "none", lay.vocab_parallel_pp)


def _keep_best(heap: list, entry: tuple, size: int) -> None:
    """Keep ``entry`` if it is among the ``size`` best of ``heap`` (a min-heap on
    (-step time, rank): the slowest kept on top)."""
    if len(heap) < size:
        heapq.heappush(heap, entry)
    elif entry[:2] > heap[0][:2]:
        heapq.heapreplace(heap, entry)


def plan(work: Workload, cluster: Cluster, *, top: int = 5, finalists: int = 10,
         memory_fraction: float = 0.9, runnable_only: bool = True,
         cost_model: CostModel | None = None,
         space: dict[str, Any] | None = None,
         simulation_seconds: float = SIMULATION_SECONDS, exhaustive: bool = False,
         vocab_pp: bool = True) -> Plan:
    """The ``top`` fastest layouts of ``work`` on ``cluster`` that fit in ``memory_fraction`` of
    the accelerator's memory (the rest is left to the allocator, the CUDA context and the
    communication buffers) and that this version of Loom runs (unless ``runnable_only`` is off).
    The fastest layout Loom refuses is kept in ``Plan.best_refused`` for comparison. Pipelined
    finalists are simulated best estimate first until ``simulation_seconds`` are spent; the rest
    keep their estimate (``StepCost.simulated`` is False), which the table marks.
    ``exhaustive``: every group that fits is priced, in the space's order, without the compute
    floor's bound: the same answer, slower (the tests compare the two).
    ``vocab_pp``: the twins of the best ``VOCAB_PP_TWINS`` kept pipeline layouts with the
    vocabulary split over the pipeline are priced too (off: the space without the split)."""
    started = time.perf_counter()
    model = cost_model
    if model is None:  # eager or compiled blocks and the FP8 recipe as the workload trains
        # them (a given cost model says it already; a workload named for no preset has no
        # config)
        compiled = workload_config(work).train.compile if work.compile is None else work.compile
        model = CostModel(work.model, work.seq_len, work.global_batch, cluster,
                          framework=LOOM.compiled_as(compiled), fp8=work.fp8,
                          fp8_all_gather=work.fp8_all_gather)
    # a stack whose allocator keeps fragments (``Framework.allocator_reserve``) leaves them out
    budget = cluster.gpu.memory_bytes * min(memory_fraction,
                                            1.0 - model.framework.allocator_reserve)
    keep = max(finalists * 2, top * 4)
    # kept entries (-step time, -ordinal, cost): a min-heap whose top is the slowest kept, ties
    # going to the later layout of the space's order, whatever order the groups are priced in
    heap: list[tuple[float, int, StepCost]] = []
    # (-memory, rank, layout): the pipeline layouts closest over the memory budget whose
    # vocabulary could be split over the pipeline
    over_budget: list[tuple[float, int, Layout]] = []
    searched_heap: list[tuple[float, int, StepCost]] = []  # the same, searched schedules only
    verdicts: dict[tuple, str | None] = {}
    refused: Counter = Counter()
    best_refused: StepCost | None = None

    def refuses(layout: Layout, cost: StepCost) -> bool:
        """Whether Loom's rules refuse ``layout``'s structure (one verdict per structure); a
        refusal is counted, and the fastest refused layout kept."""
        nonlocal best_refused
        key = _structure(layout)
        if key not in verdicts:
            verdicts[key] = runnable(layout, work, exact=False, representative=True)
        if verdicts[key]:
            refused[verdicts[key]] += 1
            if best_refused is None or cost.step_time < best_refused.step_time:
                best_refused = cost
        return bool(verdicts[key])
    considered = fitting = 0
    # Branch and bound. Groups whose model state alone does not fit are dropped first. The rest
    # are priced in order of their compute floor (no layout's step is faster than its busiest
    # rank's passes), so the kept layouts are fast early and, once the floor of the next group
    # is slower than every layout kept, so is every group after it: the answer is that of
    # pricing every layout, in a fraction of the time. Searched groups are always priced (their
    # estimate is not bounded by the floor) and first.
    searched_groups: list[tuple[int, LayoutGroup]] = []
    bounded: list[tuple[float, int, LayoutGroup]] = []
    dropped: list[int] = []  # layouts the space did not build: their state does not fit

    def vocab_twin_allowed(lay: Layout) -> bool:
        """Whether ``lay`` has a twin with the vocabulary split over its pipeline to price."""
        return (vocab_pp and lay.schedule != SEARCH and not lay.vocab_parallel_pp
                and lay.pp * lay.microbatches <= VOCAB_PP_MAX_WORK
                and vocab_pp_fits(work.model, lay))

    def state_too_large(lay: Layout) -> bool:  # its model state alone does not fit
        return memory_floor(model, lay) > budget

    for ordinal, group in enumerate(layouts(
            work, cluster.gpus, cluster.gpus_per_node, drop=state_too_large,
            skipped=dropped.append,
            **(space or {}))):
        if group.first.zero_stage not in model.framework.zero_stages:
            continue  # a ZeRO stage the planned stack does not have
        considered += len(group)
        if group.first.schedule == "search":
            searched_groups.append((ordinal, group))
        else:
            bounded.append((model.compute_floor(group.first), ordinal, group))
    considered += sum(dropped)
    bounded.sort(key=lambda entry: entry[1 if exhaustive else 0:2])
    for floor, ordinal, group in [(-1.0, o, g) for o, g in searched_groups] + bounded:
        if floor >= 0 and len(heap) == keep and floor > -heap[0][0] and not exhaustive:
            break  # this group and every later one are slower than every layout kept
        for position, layout in enumerate(group):
            rank = -(ordinal * 16 + position)  # the space's order, for ties
            # a searched schedule: more recomputation leaves more memory for a faster schedule,
            # so the group is searched on until the limit reaches the cap (next: ``settled``)
            searched = layout.schedule == "search"
            if searched:
                layout = _with_memory_left(model, layout, budget)
                if layout is None:
                    continue
            memory = model.memory_total(layout)
            if memory > budget:
                if not searched and vocab_twin_allowed(layout):  # the head's rank may be what
                    # does not fit, which the split spreads: the closest few get twins too
                    _keep_best(over_budget, (-memory, rank, layout), VOCAB_PP_TWINS)
                continue
            fitting += 1
            settled = not searched or layout.schedule_memory_limit >= _search_cap(layout)
            if (not searched and not exhaustive and len(heap) == keep
                    and model.compute_floor(layout) > -heap[0][0]):
                break  # recomputing more is slower still
            if not exhaustive and len(heap) == keep and model.step_floor(layout) > -heap[0][0]:
                # its step without the data-parallel part is already slower than every layout
                # kept: what pricing it whole would find (below), at a fifth of the price
                if settled:
                    break
                continue
            cost = model.evaluate(layout)
            entry = (-cost.step_time, rank, cost)
            if len(heap) == keep and entry[:2] < heap[0][:2]:
                if settled:
                    break  # slower than every layout kept (and recomputing more is slower still)
                continue
            if runnable_only and refuses(layout, cost):
                if settled:
                    break
                continue
            if searched:  # the best few are simulated whatever their estimate
                _keep_best(searched_heap, entry, SEARCH_FINALISTS)
            _keep_best(heap, entry, keep)
            if settled:
                break  # the rest of the group recomputes more: never faster
    # the vocabulary split over the pipeline: the twins of the best kept pipeline layouts whose
    # axes allow it, and of the closest ones over the budget (the head's rank may be what
    # does not fit), priced and ranked like the rest (a tie goes to the layout without)
    twins = [(rank, cost.layout) for _, rank, cost in sorted(heap, reverse=True)
             if vocab_twin_allowed(cost.layout)][:VOCAB_PP_TWINS]
    twins += [(rank, lay) for _, rank, lay in sorted(over_budget, reverse=True)]
    for rank, plain in twins:
        layout = replace(plain, vocab_parallel_pp=True)
        considered += 1
        if len(heap) == keep and model.compute_floor(layout) > -heap[0][0]:
            continue
        if memory_floor(model, layout) > budget or model.memory_total(layout) > budget:
            continue
        fitting += 1
        cost = model.evaluate(layout)
        entry = (-cost.step_time, rank - 0.5, cost)
        if len(heap) == keep and entry[:2] < heap[0][:2]:
            continue
        if runnable_only and refuses(layout, cost):
            continue
        _keep_best(heap, entry, keep)
    screened = [entry[2] for entry in sorted(heap, reverse=True)]  # fastest first, then order
    simulated: list[StepCost] = []
    spent = 0.0
    per_action = SECONDS_PER_ACTION  # refined by every simulation of this call
    chosen = screened[:finalists]
    picked = {c.layout for c in chosen}
    reserved = [entry[2] for entry in sorted(searched_heap, reverse=True)
                if entry[2].layout not in picked]
    late = {c.layout for c in reserved}
    # layouts without a pipeline first: their estimate is exact, so they set the bar for free;
    # the reserved searched schedules last (their estimate is a rough one: ``search_estimate``)
    for cost in sorted(chosen, key=lambda c: (c.layout.pp > 1, c.step_time)) + reserved:
        best = min((c.step_time for c in simulated if c.simulated), default=float("inf"))
        margin = SEARCH_MARGIN if cost.layout in late else SIMULATION_MARGIN
        if cost.step_time > margin * best:
            continue  # its estimate is too far behind to win once simulated
        actions = _simulated_actions(cost.layout)
        if cost.layout.pp > 1 and spent + actions * per_action > simulation_seconds:
            simulated.append(cost)  # out of time: ranked by its estimate, marked unsimulated
            continue
        clock = time.perf_counter()
        simulated.append(simulate_step(model, cost))
        took = time.perf_counter() - clock
        spent += took
        if actions:
            per_action = max(per_action, took / actions)
    finals = sorted(simulated, key=lambda c: c.step_time)
    ranked: list[StepCost] = []
    done = {c.layout for c in finals}
    for cost in finals + [c for c in screened if c.layout not in done]:
        if len(ranked) == top:
            break
        reason = runnable(cost.layout, work, exact=False) if runnable_only else None
        if reason:  # a size-dependent rule the structure check could not see
            refused[reason] += 1
            continue
        ranked.append(cost)
    if best_refused is not None and ranked and best_refused.step_time >= ranked[0].step_time:
        best_refused = None  # only worth showing when it would have won
    result = Plan(work, cluster, budget, ranked, considered, fitting, refused,
                  time.perf_counter() - started)
    if best_refused is not None and spent < simulation_seconds:
        best_refused = simulate_step(model, best_refused)
    result.best_refused = best_refused
    return result


__all__ = ["Plan", "plan", "simulate_step", "family_makespan", "runnable", "check_vocab_pp",
           "to_config", "workload_config"]
