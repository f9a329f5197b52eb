"""The planner's search: what it ranks, what it refuses, how it simulates, and its CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loom.cli import main
from loom.config import load_config, resolve
from loom.models.presets import PRESETS
from loom.schedule import families as schedules
from loom.schedule.select import schedule_for
from loom.plan.hardware import make_cluster
from loom.plan.search import plan, runnable, simulate_step, to_config
from loom.plan.space import SCHEDULES, Workload, layouts
from loom.layout import Layout
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import LOOM
from loom.schedule.validate import peak_memory
from loom.sim.cost_memory import search_units_left
from loom.schedule.simulate import simulate
from tests.conftest import matrix

WORK = Workload("llama3-8b", PRESETS["llama3-8b"], 4096, 64)
# every finalist simulated whatever the machine's load: the planner's wall-time budget for
# simulations would otherwise decide which layouts keep their closed-form estimate
UNBOUNDED = float("inf")


def test_every_layout_of_the_space_multiplies_to_the_world_and_divides_the_batch():
    seen = 0
    for group in layouts(WORK, 16, 8):
        assert [lay.recompute for lay in group] == ["none", "selective", "full"]
        for lay in group:
            seen += 1
            assert lay.world == 16
            assert WORK.global_batch == lay.dp * lay.micro_batch * lay.microbatches
            assert lay.tp <= 8 and WORK.model.n_heads % lay.tp == 0
            assert lay.pp == 1 or lay.microbatches >= lay.pp
            assert lay.zero_stage == 0 if lay.dp_shard == 1 else lay.zero_stage in (1, 2, 3)
    assert seen > 1000


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"search"}))  # searched: all m
def test_simulating_2p_microbatches_and_extending_equals_the_full_simulation(name):
    """Past the warm-up every further microbatch adds the busiest rank's work: the planner's
    shortcut for long pipelines is checked against simulating all m microbatches."""
    model = CostModel(WORK.model, WORK.seq_len, 128, make_cluster("H100-SXM", 32, 8))
    chunks = SCHEDULES[name][0]
    lay = Layout(pp=4, dp_replicate=8, schedule=name, chunks=chunks, micro_batch=1,
                 microbatches=16)
    cost = model.evaluate(lay)
    short = simulate_step(model, cost, max_simulated=8)
    generator = schedules.get(name)
    full_schedule = generator(4, 16, chunks=chunks) if name == "interleaved_1f1b" \
        else generator(4, 16)
    full = float(simulate(full_schedule, cost.stage_costs.build()).makespan)
    assert short.pipeline == pytest.approx(full, rel=0.01)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_screening_estimate_is_close_to_the_simulation(name):
    model = CostModel(WORK.model, WORK.seq_len, 128, make_cluster("H100-SXM", 32, 8),
                      framework=LOOM.compiled_as(True))  # eager v_half: 11%
    lay = Layout(pp=4, dp_replicate=8, schedule=name, chunks=SCHEDULES[name][0],
                 micro_batch=1, microbatches=16)
    cost = model.evaluate(lay)
    assert simulate_step(model, cost).pipeline == pytest.approx(cost.pipeline, rel=0.1)


def test_plan_ranks_fitting_runnable_layouts_fastest_first():
    result = plan(WORK, make_cluster("H100-SXM", 8, 8), top=5, simulation_seconds=UNBOUNDED)
    assert len(result.ranked) == 5
    times = [cost.step_time for cost in result.ranked]
    assert times == sorted(times)
    for cost in result.ranked:
        assert cost.memory_total <= result.memory_budget
        assert runnable(cost.layout, WORK) is None
        assert cost.simulated
    assert result.considered > result.fitting > 0


def test_a_pipeline_with_more_microbatches_per_rank_than_the_trainer_runs_is_refused():
    """The quick checks validate a pipeline's rules with a few microbatches, but the batch rule
    (at most a million microbatches per rank and step) is checked at the layout's own count: a
    pp = 2 layout of 40 million sequences was ranked first and then refused by ``-o``."""
    huge = Workload("llama3-8b", PRESETS["llama3-8b"], 2048, 40_000_000)
    result = plan(huge, make_cluster("H100-SXM", 16, 8))
    assert result.ranked and all(cost.layout.microbatches <= 1_000_000 for cost in result.ranked)
    for cost in result.ranked:
        assert runnable(cost.layout, huge) is None
    layout = Layout(pp=2, dp_shard=8, micro_batch=4, microbatches=1_250_000, zero_stage=3,
                    schedule="zb_h1")
    for quick in ({"exact": False}, {"exact": False, "representative": True}):
        assert "at most 1,000,000" in runnable(layout, huge, **quick)
        # within the batch rule, past the step size the trainer builds (pp x m x 1 <= 2^20)
        fewer = dataclasses.replace(layout, microbatches=1_000_000, micro_batch=5)
        assert "at most 1,048,576" in runnable(fewer, huge, **quick)


def test_a_model_too_large_for_the_cluster_has_no_layout():
    result = plan(Workload("gpt-1t", PRESETS["gpt-1t"], 2048, 64), make_cluster("A100-80GB", 8, 8))
    assert result.ranked == [] and result.fitting == 0


def test_refused_combinations_are_reported_not_proposed(monkeypatch):
    """Layouts Loom's config rules refuse are counted by rule and never ranked. The rules move as
    parallelisms land, so this stands one in: pipelines refused, as tied embeddings once were."""
    import loom.plan.search as search

    real = search.runnable

    def no_pipelines(layout, work, **how):
        return "parallel.pp: refused for this test" if layout.pp > 1 else real(layout, work, **how)

    monkeypatch.setattr(search, "runnable", no_pipelines)
    # 16 sequences: one microbatch per rank, so pp = 1 layouts fit without accumulated gradients
    work = Workload("gpt3-175b", PRESETS["gpt3-175b"], 2048, 16)
    small = {"schedules": {"1f1b": (1,)}, "micro_batches": (1,)}  # a smaller space
    result = plan(work, make_cluster("A100-80GB", 128, 8), top=3, space=small)
    assert result.ranked and all(cost.layout.pp == 1 for cost in result.ranked)
    assert result.refused["parallel.pp: refused for this test"] > 0
    anything = plan(work, make_cluster("A100-80GB", 128, 8), top=3, runnable_only=False,
                    space=small)
    assert anything.ranked[0].layout.pp > 1  # the fastest layout is a refused pipeline
    assert anything.ranked[0].step_time <= result.ranked[0].step_time
    assert result.best_refused is not None and result.best_refused.layout.pp > 1


def test_the_chosen_layout_becomes_a_loom_config():
    result = plan(WORK, make_cluster("H100-SXM", 8, 8), top=1)
    lay = result.ranked[0].layout
    config = to_config(lay, WORK)
    par = config.parallel
    assert (par.pp, par.dp_replicate, par.dp_shard, par.cp, par.tp) == \
        (lay.pp, lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp)
    assert config.train.micro_batch_size == lay.micro_batch
    assert config.train.global_batch_size == WORK.global_batch


def test_cli_plans_explains_and_writes_a_config(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    code = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "H100-SXM", "--seq",
                 "4096", "--global-batch-tokens", str(64 * 4096), "--top", "3", "--explain",
                 "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "tok/s/GPU" in text and "memory per GPU" in text and "loom train --config" in text
    config = resolve(load_config(out), 8)  # what loom train would read
    assert config.model.dim == PRESETS["llama3-8b"].dim and config.data.seq_len == 4096


def test_cli_json_and_a_given_layout(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096",
                 "--global-batch-tokens", str(64 * 4096), "--json", "--top", "2"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert len(ranked) == 2 and ranked[0]["step_time_s"] <= ranked[1]["step_time_s"]
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096",
                 "--global-batch-tokens", str(64 * 4096),
                 "--layout", "pp=2,dp_replicate=4,schedule=1f1b,microbatches=16"]) == 0
    assert "step" in capsys.readouterr().out


@pytest.mark.parametrize("args, named", [
    (["--model", "nope", "--gpus", "8", "--global-batch-tokens", "8192"], "--model"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "Z80", "--global-batch-tokens", "8192"],
     "--gpu"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch-tokens", "5000"],
     "--global-batch-tokens"),
    (["--model", "llama3-8b", "--gpus", "12", "--gpus-per-node", "8", "--seq", "4096",
      "--global-batch-tokens", "8192"], "gpus_per_node"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch-tokens", "8192",
      "--layout", "pp=2,warp=9"], "--layout"),
    (["--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch-tokens", "8192",
      "--layout", "pp=4"], "--layout"),
])
def test_cli_bad_input_names_the_argument(args, named, tmp_path, capsys):
    out = tmp_path / "never.toml"
    assert main(["plan", *args, "-o", str(out)]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_a_given_layout_holds_the_global_batch(capsys):
    """``--layout`` without microbatches takes them from the global batch (64 sequences over
    dp 8 at micro batch 1: 8); a layout whose dp x micro_batch x microbatches is another batch
    is refused by field (it was priced as the smaller step: an MFU of 810%), as is a
    micro batch that does not divide the batch."""
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096",
            "--global-batch-tokens", str(64 * 4096), "--layout"]
    assert main([*base, "dp_shard=8,zero_stage=3,micro_batch=1"]) == 0
    assert "mb1x8" in capsys.readouterr().out
    assert main([*base, "dp_shard=8,zero_stage=3,micro_batch=1,microbatches=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layout microbatches=1" in err[0] and "64" in err[0]
    assert main([*base, "dp_shard=8,zero_stage=3,micro_batch=3"]) == 2
    assert "--layout micro_batch=3" in capsys.readouterr().err


# ----- the schedule search's own output, under the memory left ----------------------------------
# llama3-8b with one KV head (so no tensor parallelism) and a 32k vocabulary on 4 H100s without
# context parallelism: every layout is a pipeline or data parallelism. (With the 128k
# vocabulary, since the loss's backward is priced, the last rank's head decides the memory
# levels and ZB-H1 fits wherever the search's levels do.)
NO_TP_SPACE = {"max_cp": 1, "micro_batches": (1,)}


@pytest.fixture
def no_tp(tmp_path) -> Workload:
    path = tmp_path / "kv1.toml"
    path.write_text('[model]\npreset = "llama3-8b"\nn_kv_heads = 1\nvocab_size = 32000\n')
    return Workload("kv1", dataclasses.replace(PRESETS["llama3-8b"], n_kv_heads=1,
                                               vocab_size=32000), 4096, 16,
                    config_path=str(path), compile=True)  # (eager: ZB-H1 + selective wins)


def test_a_searched_schedule_is_given_the_activation_units_the_memory_budget_leaves(no_tp):
    model = CostModel(no_tp.model, no_tp.seq_len, no_tp.global_batch,
                      make_cluster("H100-SXM", 4, 8))
    lay = Layout(pp=4, schedule="search", chunks=1, micro_batch=1, microbatches=16)

    def total(units):
        return sum(model.memory(dataclasses.replace(lay, schedule_memory_limit=units)).values())

    budget = (total(5) + total(6)) / 2  # room for 5 units, not 6
    assert search_units_left(model, lay, budget, cap=8) == 5
    assert search_units_left(model, lay, total(8) * 2, cap=8) == 8  # the cap binds
    assert search_units_left(model, lay, total(1) * 0.99, cap=8) == 0  # not even one


def test_between_the_families_memory_levels_the_plan_ranks_a_searched_schedule_first(no_tp):
    """At 72% of an H100 the search, given the activation units the memory leaves a 4-rank
    pipeline, finds a schedule faster than every family that fits (ZB-V, interleaved, ZB-H1),
    and the plan ranks it first."""
    result = plan(no_tp, make_cluster("H100-SXM", 4, 8), top=10, memory_fraction=0.72,
                  space=NO_TP_SPACE, vocab_pp=False, simulation_seconds=UNBOUNDED)
    best = result.ranked[0]
    assert best.layout.schedule == "search" and best.simulated
    assert best.layout.schedule_memory_limit >= 3 and best.memory_total <= result.memory_budget
    families = [c for c in result.ranked if c.layout.pp > 1 and c.layout.schedule != "search"]
    assert families and all(best.step_time < c.step_time for c in families)


def test_the_planner_simulates_the_schedule_loom_train_would_search(no_tp):
    """What the planner replays for a searched layout is the schedule the config it writes
    makes every rank search for (the same limit, relative costs and placement)."""
    work = no_tp
    result = plan(work, make_cluster("H100-SXM", 4, 8), top=1, memory_fraction=0.72,
                  space=NO_TP_SPACE, vocab_pp=False, simulation_seconds=UNBOUNDED)
    cost = result.ranked[0]
    assert cost.layout.schedule == "search"
    config = to_config(cost.layout, work)
    par = config.parallel
    assert (par.schedule, par.schedule_placement) == ("search", cost.layout.schedule_placement)
    assert par.schedule_memory_limit == cost.layout.schedule_memory_limit
    assert par.schedule_costs == cost.layout.schedule_costs
    trained = schedule_for(
        par.schedule, par.pp, config.train.global_batch_size // (par.dp * config.train.
                                                                micro_batch_size),
        par.chunks, memory_limit=par.schedule_memory_limit, costs=par.schedule_costs,
        max_stages=config.model.n_layers, placement=par.schedule_placement)
    assert max(peak_memory(trained)) <= par.schedule_memory_limit
    model = CostModel(work.model, work.seq_len, work.global_batch, make_cluster("H100-SXM", 4, 8),
                      framework=LOOM.compiled_as(True))  # as work compiles
    replayed = simulate(trained, model.evaluate(cost.layout).stage_costs.build()).makespan
    assert cost.pipeline == pytest.approx(float(replayed), rel=1e-9)


def test_the_memory_floor_never_exceeds_a_layouts_memory():
    """The screening drops a whole group when its model state alone does not fit: the floor
    must be a lower bound of every layout's total (whatever the activations), and the total's
    own non-activation part at its worst instant."""
    from loom.sim.cost_memory import memory_floor

    model = CostModel(WORK.model, WORK.seq_len, WORK.global_batch, make_cluster("H100-SXM", 16, 8))
    checked = 0
    for group in layouts(WORK, 16, 8):
        for lay in group:
            if lay.schedule == "search":
                lay = dataclasses.replace(lay, schedule_memory_limit=1.0)
            assert memory_floor(model, lay) <= model.memory_total(lay) + 1e-6, lay.label()
            assert model.memory_total(lay) == pytest.approx(sum(model.memory(lay).values()))
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("preset", ["llama3-8b", "mixtral-8x7b"])
def test_the_compute_floor_never_exceeds_a_layouts_step(preset):
    """The screening prices groups in order of their compute floor and stops at the first one
    slower than every layout kept: the floor must be a lower bound of every layout's step."""
    work = dataclasses.replace(WORK, name=preset, model=PRESETS[preset])
    model = CostModel(work.model, work.seq_len, work.global_batch, make_cluster("H100-SXM", 16, 8))
    checked = 0
    for group in layouts(work, 16, 8):
        for lay in group:
            if lay.schedule != "search":
                assert model.compute_floor(lay) <= model.evaluate(lay).step_time, lay.label()
                checked += 1
    assert checked > 1000


def test_a_group_builds_its_layouts_lazily_and_equal_to_the_first_with_each_policy():
    group = next(iter(layouts(WORK, 16, 8)))
    assert len(group._built) == 1  # only the first until asked
    assert list(group) == [dataclasses.replace(group.first, recompute=rc)
                           for rc in ("none", "selective", "full")]
    assert group[-1] == group[2] and group[1:] == list(group)[1:]


BOUND_CASES = [("llama3-8b", 16, "H100-SXM", 4096, 64), ("llama3-70b", 64, "H100-SXM", 8192, 512),
               ("mixtral-8x7b", 32, "H100-SXM", 4096, 256),
               ("gpt3-175b", 256, "A100-80GB", 2048, 512)]


# CI: a dense model at two sizes (the MoE and the 256-GPU cases take 9-14 s each: the matrix)
@pytest.mark.parametrize("preset,gpus,gpu,seq,batch", matrix(BOUND_CASES, BOUND_CASES[:2]))
def test_branch_and_bound_ranks_exactly_as_pricing_every_group(preset, gpus, gpu, seq, batch):
    """Skipping groups by their memory and compute floors changes how many layouts are priced,
    never the answer: the ranking (layouts, step times, order) equals the exhaustive pass's."""
    work = Workload(preset, PRESETS[preset], seq, batch)
    cluster = make_cluster(gpu, gpus, 8)
    answers = []
    for exhaustive in (False, True):
        result = plan(work, cluster, top=5, simulation_seconds=float("inf"),
                      exhaustive=exhaustive)
        answers.append(([(c.layout, c.step_time, c.simulated) for c in result.ranked],
                        result.fitting))
    (fast, fast_priced), (slow, slow_priced) = answers
    assert fast and fast == slow
    assert fast_priced <= slow_priced
