"""The planner's shortcuts give the answers of the work they skip.

``loom plan`` skips or shares work to answer the 1T-on-3,072-GPU plan well within 2 s: each
shortcut is checked here against the long way round, exactly (the same floats), on small
problems: the space's cheap layout construction and shared drop verdicts, the cost model's
caches (a model shared by many layouts prices each as a fresh one does), the step bound that
skips pricing the data-parallel part, the busiest rank found among one rank of each kind, and
the makespan read from the replay instead of the simulator's timeline. (That the bounds
leave the ranking as pricing every group does: ``test_plan_search``'s branch-and-bound test.)
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import Cluster, Gpu, Link, GB, make_cluster
from loom.plan.space import Workload, layouts
from loom.schedule import families as schedules
from loom.schedule.cost import OpCosts, StageCosts
from loom.schedule.simulate import makespan, simulate
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS

WORK = Workload("llama3-8b", PRESETS["llama3-8b"], 4096, 32)
MOE = Workload("deepseek-moe-16b", PRESETS["deepseek-moe-16b"], 4096, 32)
SMALL = {"micro_batches": (1, 2), "max_cp": 2}


def _sample(work: Workload, gpus: int, every: int) -> list[Layout]:
    """Every ``every``-th layout of the space (all recomputation policies of a group)."""
    return [lay for n, group in enumerate(layouts(work, gpus, 8, **SMALL)) if n % every == 0
            for lay in group]


def test_the_space_builds_the_layouts_the_constructor_builds():
    """``space._layout`` skips the frozen dataclass's ``__init__``: every layout equals (and
    hashes as) the one ``Layout(**fields)`` builds, a searched schedule's placement too."""
    seen = searched = 0
    for group in layouts(WORK, 16, 8, **SMALL):
        for lay in group:
            fields = {name: getattr(lay, name) for name in Layout.__dataclass_fields__}
            if lay.schedule == "search":
                fields["schedule_placement"] = "auto"  # what __post_init__ pins by the chunks
                searched += 1
            built = Layout(**fields)
            assert built == lay and hash(built) == hash(lay) and vars(built) == vars(lay)
            seen += 1
    assert seen > 1000 and searched > 10


def test_drop_is_asked_once_per_microbatch_count_above_one_and_skips_the_same_groups():
    """A drop test that looks at whether there is more than one microbatch, not at how many,
    is asked once for the microbatch sizes that share that: the groups yielded and the
    layouts counted as skipped are those of asking it of every group."""
    def state_test(lay: Layout) -> bool:  # looks at the ZeRO stage, the schedule and m > 1
        return lay.zero_stage == 2 or (lay.schedule == "zb_h1" and lay.microbatches > 1)

    asked: list[Layout] = []

    def drop(lay: Layout) -> bool:
        asked.append(lay)
        return state_test(lay)

    space = dict(micro_batches=(1, 2, 4, 8), max_cp=2)
    skipped: list[int] = []
    kept = [group.first for group in layouts(WORK, 16, 8, drop=drop, skipped=skipped.append,
                                             **space)]
    every = [group for group in layouts(WORK, 16, 8, **space)]
    assert kept == [group.first for group in every if not state_test(group.first)]
    assert sum(skipped) == sum(len(group) for group in every if state_test(group.first))
    # asked once per (axes, ZeRO stage, schedule, chunks, m > 1), not per microbatch size
    shapes = {(lay.pp, lay.dp_shard, lay.cp, lay.tp, lay.zero_stage, lay.schedule, lay.chunks,
               lay.microbatches > 1) for lay in asked}
    assert len(asked) == len(shapes) < len({group.first for group in every})


@pytest.mark.parametrize("framework", ["loom", "megatron", "deepspeed"])
def test_a_model_shared_by_many_layouts_prices_each_as_a_fresh_one(framework):
    """The cost model's caches (the end ranks' parameters and instants, the busiest rank's
    passes, the compute floor) are keyed by what the answers depend on: a model that priced
    many layouts before gives each the step, memory and floor a fresh model gives it."""
    cluster = make_cluster("H100-SXM", 16, 8)
    stack = FRAMEWORKS[framework]
    for work in (WORK, MOE):
        shared = CostModel(work.model, work.seq_len, work.global_batch, cluster, framework=stack)
        lays = _sample(work, 16, 13)
        for lay in lays:  # warm every cache with the whole sample first
            shared.memory_total(lay)
            shared.compute_floor(lay)
        for lay in lays[::11]:
            fresh = CostModel(work.model, work.seq_len, work.global_batch, cluster,
                              framework=stack)
            a, b = shared.evaluate(lay), fresh.evaluate(lay)
            assert (a.step_time, a.memory, a.comm) == (b.step_time, b.memory, b.comm), lay
            assert shared.memory_total(lay) == fresh.memory_total(lay)
            assert shared.compute_floor(lay) == fresh.compute_floor(lay)


def test_framework_work_by_wrapper_still_splits_the_cached_layer_times():
    """On a profile that charges framework work per wrapper (a CPU calibration), layouts
    that differ only in their ZeRO stage get their own layer times from a shared model."""
    gpu = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
              framework=(("base", 1e-3, 0.1, 1e-6), ("zero3", 5e-3, 0.5)))
    link = Link("fast", 100 * GB, 1e-6)
    model = CostModel(PRESETS["debug"], 32, 8, Cluster(gpu, 4, 4, link, link))
    one, three = (Layout(pp=2, dp_shard=2, zero_stage=z, schedule="1f1b", microbatches=4)
                  for z in (1, 3))
    assert model.compute_floor(one) < model.compute_floor(three)
    assert model.evaluate(one).compute < model.evaluate(three).compute


def test_the_step_bound_never_exceeds_the_priced_step():
    """``CostModel.step_floor`` (the pipelined part and optimizer, no data-parallel part) is
    at most ``evaluate``'s step, exactly, so the search may skip pricing a layout on it."""
    cluster = make_cluster("A100-80GB", 16, 8)
    for work in (WORK, MOE):
        model = CostModel(work.model, work.seq_len, work.global_batch, cluster)
        for lay in _sample(work, 16, 7):
            assert model.step_floor(lay) <= model.evaluate(lay).step_time, lay.label()


def test_the_busiest_rank_is_found_among_one_rank_of_each_kind():
    """The busiest rank's F+I+W per microbatch equals the maximum over every rank's stages,
    for looped and V placements, with dense and MoE layers unevenly split."""
    cluster = make_cluster("H100-SXM", 64, 8)
    for work in (WORK, MOE):
        model = CostModel(work.model, work.seq_len, work.global_batch, cluster)
        for pp, schedule, chunks in ((4, "1f1b", 1), (8, "interleaved_1f1b", 3),
                                     (4, "zbv", 2), (8, "v_min", 2), (3, "zb_h1", 1)):
            lay = Layout(pp=pp, tp=2, schedule=schedule, chunks=chunks, microbatches=2 * pp)
            ops, busiest = model._ops_and_busiest(lay)
            owned = model.ranks.geometry(pp, chunks, lay.v_shaped)[2]
            assert busiest == max(sum(f + i + w for f, i, w in (ops[s] for s in own))
                                  for own in owned)


@pytest.mark.parametrize("name,chunks", [("1f1b", None), ("interleaved_1f1b", 2),
                                         ("zb_h1", None), ("zb_h2", None), ("zbv", None),
                                         ("v_half", None), ("v_min", None)])
def test_the_makespan_from_the_replay_is_the_simulators(name, chunks):
    """The finalists' makespan is read off the replay (no timeline built): the simulator's,
    exactly, on float costs and on Fractions (scaled to ints and back)."""
    p, m = 4, 12
    generator = schedules.get(name)
    schedule = generator(p, m) if chunks is None else generator(p, m, chunks=chunks)
    stages = schedule.num_stages
    for costs in (StageCosts(tuple(OpCosts(1.0 + 0.1 * s, 1.3 - 0.05 * s, 0.7) for s in
                                   range(stages)), latency=0.03),
                  StageCosts(tuple(OpCosts(Fraction(3 + s, 7), Fraction(5, 3), Fraction(2, 5))
                                   for s in range(stages)), latency=Fraction(1, 11))):
        expected = float(simulate(schedule, costs, memory=False).makespan)
        assert makespan(schedule, costs) == expected

