"""Pipelines over unlike accelerators (``loom.plan.mixed``, ``loom plan --mixed``): the layer
split by hand, a cluster of two like parts priced exactly as the homogeneous planner prices the
same layout, the faster part given more layers, memory caps, and bad files refused by field."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from loom.cli import main
from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import load_catalog, make_cluster
from loom.plan.mixed import (MixedClusterError, PartCosts, load_mixed, plan_mixed, price_mixed,
                             split_layers, stage_shapes)
from loom.plan.search import simulate_step
from loom.plan.space import Workload
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import LOOM

WORK = Workload("llama3-8b", PRESETS["llama3-8b"], 4096, 256)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mixed.toml"
    path.write_text(text)
    return path


def two_parts(first: str, second: str, gpus: int = 16) -> str:
    """A ``--mixed`` file of two parts of ``gpus`` accelerators each."""
    return "".join(f'[[part]]\ngpu = "{gpu}"\ngpus = {gpus}\n' for gpu in (first, second))


TWO_KINDS = two_parts("A100-80GB", "H100-SXM")


def test_each_layer_goes_to_the_stage_that_finishes_it_soonest():
    """Stages of 1 and 2 seconds per layer, 9 layers: 6 and 3 (both 6 s), the best there is;
    capped at 4 layers the first leaves 5 to the second; a head of 3 s on the last stage
    moves a layer off it; caps that cannot hold the layers give None."""
    assert split_layers(9, [1.0, 2.0], 0.0, [99, 99]) == [6, 3]
    assert split_layers(9, [1.0, 2.0], 0.0, [4, 99]) == [4, 5]
    assert split_layers(9, [1.0, 1.0], 3.0, [99, 99]) == [6, 3]
    assert split_layers(9, [1.0, 2.0], 0.0, [4, 4]) is None
    assert split_layers(1, [1.0, 1.0], 0.0, [9, 9]) is None  # a stage needs a layer


def test_two_like_parts_price_as_one_cluster_of_both():
    """Two parts of 16 A100s joined by their own network link: a 4-stage 1F1B of the 8B's
    shape with a 1,024-token vocabulary (its head costs less than a layer, so the greedy splits
    the 32 layers 8 a stage, as the homogeneous planner does) is that planner's step for the
    same layout on 32 A100s, to the float. (With the 128k vocabulary the greedy moves layers
    off the head's stage: 9, 9, 8, 6.)"""
    work = Workload("small-vocab", replace(PRESETS["llama3-8b"], vocab_size=1024), 4096, 256)
    mixed = load_mixed_text(two_parts("A100-80GB", "A100-80GB"))
    lay = Layout(pp=4, dp_replicate=8, schedule="1f1b", micro_batch=1, microbatches=32)
    parts = {i: PartCosts(work, c, lay, LOOM, False, 1e30) for i, c in enumerate(mixed.parts)}
    priced = price_mixed(work, mixed, lay, (2, 2), (0, 1), parts)
    assert priced.layers == (8, 8, 8, 8)
    whole = CostModel(work.model, work.seq_len, work.global_batch,
                      make_cluster("A100-80GB", 32))
    expected = simulate_step(whole, whole.evaluate(lay))
    assert priced.step_time == pytest.approx(expected.step_time, rel=1e-12)
    assert priced.memory[0] == pytest.approx(expected.memory_total, rel=1e-12)


def load_mixed_text(text: str):
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.toml"
        path.write_text(text)
        return load_mixed(path, load_catalog())


def test_the_faster_part_takes_more_layers_and_the_stages_balance():
    """A100s and H100s (989 against 312 TFLOP/s of bf16 peak): in the best pipeline every
    H100 stage holds more layers than every A100 stage, and the stages hold every layer (the
    greedy's balance itself is held by the hand cases of ``split_layers``)."""
    mixed = load_mixed_text(TWO_KINDS)
    best = plan_mixed(WORK, mixed, top=1)[0]
    along = [i for i, n in zip(best.order, best.stages) for _ in range(n)]
    a100 = [n for i, n in zip(along, best.layers) if mixed.parts[i].gpu.name == "A100-80GB"]
    h100 = [n for i, n in zip(along, best.layers) if mixed.parts[i].gpu.name == "H100-SXM"]
    assert min(h100) > max(a100)
    assert sum(best.layers) == WORK.model.n_layers


def test_the_bound_keeps_the_ranking_of_pricing_everything():
    """``plan_mixed`` skips simulating a pipeline whose busiest stage's work over the
    microbatches is already slower than the top-th layout it keeps: its table equals pricing
    every shape in every order."""
    mixed = load_mixed_text(TWO_KINDS)
    everything = []
    for lay, stages in stage_shapes(WORK, mixed):
        parts = {i: PartCosts(WORK, c, lay, LOOM, False, c.gpu.memory_bytes * 0.9)
                 for i, c in enumerate(mixed.parts)}
        for order in ((0, 1), (1, 0)):
            priced = price_mixed(WORK, mixed, lay, stages, order, parts)
            if priced is not None:
                everything.append(priced)
    everything.sort(key=lambda p: (p.step_time, p.layout.label(), p.order))
    assert plan_mixed(WORK, mixed, top=4) == everything[:4]


def test_a_part_with_less_memory_gets_fewer_layers_per_stage():
    """A100-40GB beside A100-80GB, the same 4-stage shape (ZeRO-1 over 8, micro batch 1, no
    recomputation): a 40 GB stage holds at most 7 of the 8B's layers within 90% of its memory,
    so its two stages take 7 each and the 80 GB ones the rest, where like parts would split
    8, 8, 9, 7; every stage's memory stays within its part's budget."""
    mixed = load_mixed_text(two_parts("A100-40GB", "A100-80GB"))
    lay = Layout(pp=4, dp_shard=8, zero_stage=1, schedule="1f1b", micro_batch=1,
                 microbatches=32)
    budgets = [c.gpu.memory_bytes * 0.9 for c in mixed.parts]
    parts = {i: PartCosts(WORK, c, lay, LOOM, False, budgets[i]) for i, c in enumerate(mixed.parts)}
    assert (parts[0].cap, parts[1].cap) == (7, 15)
    priced = price_mixed(WORK, mixed, lay, (2, 2), (0, 1), parts)
    assert priced.layers == (7, 7, 10, 8)
    assert all(m <= b for m, b in zip(priced.memory, budgets))
    roomy = {i: PartCosts(WORK, c, lay, LOOM, False, 1e30) for i, c in enumerate(mixed.parts)}
    assert price_mixed(WORK, mixed, lay, (2, 2), (0, 1), roomy).layers == (8, 8, 9, 7)


def test_a_slow_link_between_the_parts_slows_every_hop():
    """The hops are priced at the slowest one's send, the link between the parts: joined by
    a 10 Gbit/s WAN link instead of their InfiniBand, the same pipeline's step is longer by at
    least the extra send time of the one hop that crosses."""
    text = two_parts("H100-SXM", "H100-SXM")
    lay = Layout(pp=4, dp_shard=8, zero_stage=1, schedule="1f1b", micro_batch=1,
                 microbatches=32)
    steps = {}
    for name, extra in (("ib", ""), ("wan", '[between]\nlink = "wan-10gbit"\n')):
        mixed = load_mixed_text(text + extra)
        parts = {i: PartCosts(WORK, c, lay, LOOM, False, 1e30) for i, c in enumerate(mixed.parts)}
        steps[name] = price_mixed(WORK, mixed, lay, (2, 2), (0, 1), parts).step_time
        hop = parts[0].model.send_time(lay, mixed.between)
        steps[name + "_hop"] = hop
    extra_send = steps["wan_hop"] - steps["ib_hop"]
    assert extra_send > 0
    assert steps["wan"] - steps["ib"] >= extra_send


def test_a_part_may_describe_its_racks():
    """A part's table takes the topology keys of ``--hardware``'s [cluster]: its data-parallel
    groups that span its racks share their uplinks (``Cluster.link_for``), so a part of 4 nodes
    behind racks of 2 oversubscribed 4:1 prices a pipeline's step slower than the same part
    non-blocking (its ZeRO-1 gathers and reductions over 32 ranks cross the racks)."""
    flat = load_mixed_text(two_parts("A100-80GB", "H100-SXM", 32))
    racked = load_mixed_text(two_parts("A100-80GB", "H100-SXM", 32).replace(
        "gpus = 32\n", "gpus = 32\nnodes_per_rack = 2\nrack_oversubscription = 4\n", 1))
    assert racked.parts[0].nodes_per_rack == 2 and racked.parts[0].rack_oversubscription == 4
    lay = Layout(pp=2, dp_shard=32, zero_stage=1, schedule="1f1b", micro_batch=1,
                 microbatches=8)
    steps = []
    for mixed in (flat, racked):
        parts = {i: PartCosts(WORK, c, lay, LOOM, False, 1e30) for i, c in enumerate(mixed.parts)}
        steps.append(price_mixed(WORK, mixed, lay, (1, 1), (0, 1), parts).step_time)
    assert steps[1] > steps[0]


def test_the_stage_shapes_fit_every_part():
    """Every shape divides each part's GPUs into whole stages of tp x cp x dp ranks, tp
    within the smallest node and dividing the vocabulary and the sequence, and splits the batch
    into at least a microbatch per stage; ring context parallelism is among them."""
    mixed = load_mixed_text(TWO_KINDS)
    for lay, stages in stage_shapes(WORK, mixed):
        assert all(part.gpus == n * lay.tp * lay.cp * lay.dp
                   for part, n in zip(mixed.parts, stages))
        assert WORK.model.vocab_size % lay.tp == 0 and WORK.seq_len % lay.tp == 0
        assert lay.pp == sum(stages) and lay.microbatches >= lay.pp
        assert lay.dp * lay.micro_batch * lay.microbatches == WORK.global_batch
    assert {lay.cp for lay, _ in stage_shapes(WORK, mixed)} == {1, 2, 4, 8}
    odd = Workload("odd-vocab", replace(WORK.model, vocab_size=50257), 4096, 256)
    assert {lay.tp for lay, _ in stage_shapes(odd, mixed)} == {1}


def test_the_documented_example_file_describes_its_three_parts():
    """configs/plan-inputs/mixed-a100-h100-h200.toml, docs/planner.md's example, loads as
    512 A100s, 256 H100s and 256 H200s joined by HDR InfiniBand."""
    path = Path(__file__).parents[3] / "configs" / "plan-inputs" / "mixed-a100-h100-h200.toml"
    mixed = load_mixed(path, load_catalog())
    assert [(c.gpu.name, c.gpus) for c in mixed.parts] == [
        ("A100-80GB", 512), ("H100-SXM", 256), ("H200", 256)]
    assert mixed.between.name == "hdr-ib"


ARGS = ["plan", "--model", "llama3-8b", "--seq", "4096", "--global-batch-tokens",
        str(256 * 4096)]


def test_loom_plan_mixed_ranks_pipelines_over_the_parts(tmp_path, capsys):
    path = write(tmp_path, TWO_KINDS)
    assert main([*ARGS, "--mixed", str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "16 x A100-80GB + 16 x H100-SXM" in out and "1." in out and "2." in out
    assert main([*ARGS, "--mixed", str(path), "--top", "2", "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert len(ranked) == 2 and ranked[0]["step_time_s"] <= ranked[1]["step_time_s"]
    pipelines = [r for r in ranked if r["kind"] == "pipeline"]
    assert all(sum(r["layers_per_stage"]) == 32 for r in pipelines)
    # 1 sequence cannot give each stage of any shape over 32 GPUs a microbatch: exit 1, said
    small = ["plan", "--model", "llama3-8b", "--seq", "4096", "--global-batch-tokens",
             str(1 * 4096), "--mixed", str(path)]
    assert main(small) == 1
    assert "no stage shape fits these parts and this batch" in capsys.readouterr().out


@pytest.mark.parametrize("text, extra, named", [
    ('[[part]]\ngpu = "A100-80GB"\ngpus = 8\n', [], "--mixed part: needs 2"),
    ('[[part]]\ngpu = "A100-80GB"\n[[part]]\ngpu = "H100-SXM"\ngpus = 8\n', [],
     "--mixed part[0].gpus: required"),
    ('[[part]]\ngpu = "Z80"\ngpus = 8\n[[part]]\ngpu = "H100-SXM"\ngpus = 8\n', [],
     "--mixed part[0].gpu Z80"),
    ('[[part]]\ngpu = "A100-80GB"\ngpus = 8\nwarp = 9\n[[part]]\ngpu = "H100-SXM"\ngpus = 8\n',
     [], "--mixed part[0].warp: unknown key"),
    ('[[part]]\ngpu = "A100-80GB"\ngpus = 0\n[[part]]\ngpu = "H100-SXM"\ngpus = 8\n', [],
     "--mixed part[0].gpus: 0"),
    (TWO_KINDS + '[between]\nlink = "tin-can"\n', [], "--mixed between.link 'tin-can'"),
    (TWO_KINDS, ["--layout", "pp=2"], "--layout: not with --mixed"),
    (TWO_KINDS, ["--gpus", "8"], "--gpus 8: the --mixed file's parts hold 32"),
    ('[[part]]\ngpu = "A100-80GB"\ngpus = 8\nrack_oversubscription = 0.5\n[[part]]\n'
     'gpu = "H100-SXM"\ngpus = 8\n', [], "--mixed part[0]: cluster: rack_oversubscription=0.5"),
    (TWO_KINDS, ["--inter", "ndr-ib"], "--inter: not with --mixed"),
    (TWO_KINDS, ["--nodes-per-rack", "2"], "--nodes-per-rack: not with --mixed"),
    (TWO_KINDS, ["--fp8", "tensorwise", "--fp8-all-gather"],
     "--fp8-all-gather: not with --mixed"),
    ("not toml [", [], "--mixed"),
])
def test_a_bad_mixed_file_is_refused_by_field(tmp_path, capsys, text, extra, named):
    path = write(tmp_path, text)
    assert main([*ARGS, "--mixed", str(path), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


def test_an_unknown_part_table_key_is_an_error_class():
    with pytest.raises(MixedClusterError, match="unknown table"):
        load_mixed_text(TWO_KINDS + "[nodes]\nx = 1\n")
