"""Data parallelism across unlike accelerators (``loom.plan.mixed_dp``, the replicas half of
``loom plan --mixed``): the batch split by hand, every part priced exactly as the homogeneous
planner prices its replicas on that part alone, the faster part given the larger share, the
gradients' exchange across the parts by hand, and the whole batch always accounted for."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.cli import main
from loom.models.presets import PRESETS, parameter_count
from loom.plan.hardware import load_catalog
from loom.plan.mixed import load_mixed, rank_mixed
from loom.plan.mixed_dp import balance, cross_part_reduction, plan_replicas, replica_shapes
from loom.plan.search import simulate_step
from loom.plan.space import Workload
from loom.sim.collectives import allreduce_time
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import LOOM

WORK = Workload("llama3-8b", PRESETS["llama3-8b"], 4096, 256)


def load_mixed_text(tmp_path: Path, text: str):
    path = tmp_path / "mixed.toml"
    path.write_text(text)
    return load_mixed(path, load_catalog(None))


def mixed_of(tmp_path: Path, first: str, second: str, gpus: int = 16, between: str = ""):
    text = "".join(f'[[part]]\ngpu = "{gpu}"\ngpus = {gpus}\n' for gpu in (first, second))
    if between:
        text += f'[between]\nlink = "{between}"\n'
    return load_mixed_text(tmp_path, text)


def test_the_batch_is_split_so_the_slowest_part_finishes_first():
    """Parts whose step is m and 2m seconds for m microbatches per replica: 9 microbatches of
    one replica each go 6 and 3 (both 6 s). Two replicas on the first part: 2 m1 + m2 = 9 is
    best at m1 = 4, m2 = 1 (4 s and 2 s; 3 and 3 give 6 s). A part held at its least: the
    100 s part keeps the one microbatch it must run. No exact split: None."""
    assert balance([(0, 1), (0, 2)], [1, 1], [1, 1], 9) == [6, 3]
    assert balance([(0, 1), (0, 2)], [2, 1], [1, 1], 9) == [4, 1]
    assert balance([(0, 1), (0, 100)], [1, 1], [1, 1], 10) == [9, 1]
    assert balance([(5, 1), (0, 1)], [1, 1], [1, 1], 11) == [3, 8]  # a fixed cost of 5 s
    assert balance([(0, 1), (0, 1)], [2, 2], [1, 1], 9) is None  # 9 is odd


def test_every_plan_runs_the_whole_batch_and_fits_each_part(tmp_path):
    mixed = mixed_of(tmp_path, "A100-40GB", "H100-SXM")
    ranked = plan_replicas(WORK, mixed.parts, mixed.between, top=10)
    assert ranked
    for plan in ranked:
        assert sum(s.sequences for s in plan.shares) == WORK.global_batch
        for share, part in zip(plan.shares, mixed.parts):
            assert share.layout.world == part.gpus
            assert share.layout.microbatches >= share.layout.pp
            assert share.memory <= part.gpu.memory_bytes * 0.9


def test_each_part_is_priced_as_the_homogeneous_planner_prices_its_replicas(tmp_path):
    """A share's step is the homogeneous cost model's simulated step of the same layout on
    that part alone, to the float; the plan's step is the slower part's plus the exchange."""
    mixed = mixed_of(tmp_path, "A100-80GB", "H100-SXM")
    plan = plan_replicas(WORK, mixed.parts, mixed.between, top=1)[0]
    for share, part in zip(plan.shares, mixed.parts):
        model = CostModel(WORK.model, WORK.seq_len, WORK.global_batch, part, framework=LOOM)
        cost = simulate_step(model, model.evaluate(share.layout))
        assert share.step == cost.step_time and share.memory == cost.memory_total
    assert plan.step_time == max(s.step for s in plan.shares) + plan.cross


def test_the_faster_part_runs_the_larger_share(tmp_path):
    """16 A100s beside 16 H100s: in each of the five best plans the H100s run more of the
    batch."""
    mixed = mixed_of(tmp_path, "A100-80GB", "H100-SXM")
    plans = plan_replicas(WORK, mixed.parts, mixed.between, top=5)
    assert len(plans) == 5
    for plan in plans:
        a100, h100 = plan.shares
        assert h100.sequences > a100.sequences


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0, 5), st.floats(0.1, 3), st.sampled_from([1, 2, 4, 8]),
                          st.sampled_from([1, 2, 4])), min_size=2, max_size=3),
       st.integers(0, 120))
def test_the_split_is_the_best_there_is(parts, extra):
    """Against every split, by brute force: the balance's slowest part is the shortest any
    exact split of the units allows, and it says None only when no split sums exactly."""
    lines = [(a, b) for a, b, _, _ in parts]
    replicas = [r for _, _, r, _ in parts]
    least = [m for _, _, _, m in parts]
    units = sum(r * m for r, m in zip(replicas, least)) + extra
    best = math.inf
    for head in itertools.product(*(range(lo, units // r + 1)
                                     for r, lo in zip(replicas[:-1], least[:-1]))):
        rest = units - sum(r * m for r, m in zip(replicas, head))
        if rest >= 0 and rest % replicas[-1] == 0 and rest // replicas[-1] >= least[-1]:
            split = [*head, rest // replicas[-1]]
            best = min(best, max(a + b * m for (a, b), m in zip(lines, split)))
    got = balance(lines, replicas, least, units)
    if best == math.inf:
        assert got is None
    else:
        assert sum(r * m for r, m in zip(replicas, got)) == units
        assert all(m >= lo for m, lo in zip(got, least))
        assert max(a + b * m for (a, b), m in zip(lines, got)) == pytest.approx(best)


def test_two_like_parts_split_the_batch_evenly(tmp_path):
    """Two parts of 16 H100s: the best plan runs one shape on both, half the batch each, and
    the two finish together."""
    mixed = mixed_of(tmp_path, "H100-SXM", "H100-SXM")
    first, second = plan_replicas(WORK, mixed.parts, mixed.between, top=1)[0].shares
    assert first.layout == second.layout
    assert first.sequences == second.sequences == WORK.global_batch // 2
    assert first.step == second.step


def test_the_gradients_cross_the_parts_once_per_step_at_the_smallest_part_s_shard(tmp_path):
    """Each GPU of the 8-GPU part holds 1/8 of the fp32 gradient after its part's own
    reduction; the two parts all-reduce those shards over the link between them."""
    mixed = load_mixed_text(tmp_path, '[[part]]\ngpu = "A100-80GB"\ngpus = 8\n'
                            '[[part]]\ngpu = "H100-SXM"\ngpus = 16\n[between]\nlink = "hdr-ib"\n')
    shard = parameter_count(WORK.model) * 4 / 8
    expected = allreduce_time(shard, 2, mixed.between)
    assert cross_part_reduction(WORK, mixed.parts, mixed.between, 4) == pytest.approx(expected)
    slow = replace(mixed, between=load_catalog(None)[1]["wan-1gbit"])
    fast_plan = plan_replicas(WORK, mixed.parts, mixed.between, top=1)[0]
    slow_plan = plan_replicas(WORK, slow.parts, slow.between, top=1)[0]
    assert slow_plan.cross > 100 * fast_plan.cross
    assert slow_plan.step_time - slow_plan.cross == pytest.approx(
        fast_plan.step_time - fast_plan.cross)  # the parts' own steps do not depend on it



def test_replica_shapes_split_each_part_into_whole_replicas(tmp_path):
    mixed = mixed_of(tmp_path, "A100-80GB", "H100-SXM", gpus=24)
    shapes = list(replica_shapes(WORK, mixed.parts[0], micro=2))
    assert shapes and all(lay.world == 24 and lay.micro_batch == 2 for lay in shapes)
    assert {lay.pp for lay in shapes} == {1, 2, 4, 8} == {lay.cp for lay in shapes}
    assert all(lay.tp <= 8 and lay.cp_mode == "ring" for lay in shapes)


def test_a_slow_link_between_the_parts_makes_the_pipeline_the_better_plan(tmp_path):
    """Over 1 Gbit/s the whole gradient crossing once a step costs more than the
    activations crossing at each stage boundary: a pipeline ranks first; over InfiniBand
    data parallelism across the parts is among the first five."""
    fast = mixed_of(tmp_path, "A100-80GB", "H100-SXM", between="hdr-ib")
    kinds = [type(p).__name__ for p in rank_mixed(WORK, fast, top=5)]
    assert "MixedReplicas" in kinds
    slow = mixed_of(tmp_path, "A100-80GB", "H100-SXM", between="wan-1gbit")
    assert type(rank_mixed(WORK, slow, top=1)[0]).__name__ == "MixedLayout"


def test_loom_plan_mixed_reports_data_parallel_layouts(tmp_path, capsys):
    path = tmp_path / "mixed.toml"
    path.write_text('[[part]]\ngpu = "A100-80GB"\ngpus = 16\n[[part]]\ngpu = "H100-SXM"\n'
                    'gpus = 16\n')
    args = ["plan", "--model", "llama3-8b", "--seq", "4096", "--global-batch-tokens",
            str(256 * 4096), "--mixed", str(path), "--top", "8"]
    assert main(args) == 0
    assert "data parallel across the parts" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    replicas = [r for r in ranked if r["kind"] == "data_parallel"]
    assert replicas and all(sum(p["sequences"] for p in r["parts"]) == 256 for r in replicas)
    assert [r["step_time_s"] for r in ranked] == sorted(r["step_time_s"] for r in ranked)
