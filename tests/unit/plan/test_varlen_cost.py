"""Specification of variable-length step pricing (``loom.sim.varlen_cost``) and ``loom plan
--length-dist``: per-token costs that are the cost model's own FLOP counts, the routing layer
that spreads a ring's node crossing over the node's NICs, the length-distribution file (its
formats and its refusals by name), and a long tail on which Zeppelin is predicted faster than
dealing by tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loom.cli import main
from loom.data.zeppelin import Ranks, partition_tokens, plan_zeppelin
from loom.errors import ConfigError
from loom.models.presets import PRESETS
from loom.plan.hardware import make_cluster
from loom.sim.cost_model import CostModel
from loom.sim.varlen_cost import (
    Fabric,
    LengthDistribution,
    load_length_distribution,
    lognormal,
    price,
    rank_balances,
    unit_costs,
)

MODEL = PRESETS["llama3-8b"]


def _cost_model(gpus: int = 16, nics: int = 0, seq: int = 8192) -> CostModel:
    return CostModel(MODEL, seq, 1, make_cluster("H100-SXM", gpus, 8, nics_per_node=nics))


def test_attention_and_linear_costs_are_the_cost_models_flops():
    model = _cost_model(seq=8192)
    costs = unit_costs(model, Fabric.of(model.cluster))
    gpu, layers = model.cluster.gpu, MODEL.n_layers
    mat, core = model.layer_flops(8192, 1, False)  # one sequence of 8192 tokens, one layer
    # the core's forward and its flash backward, 2.5 times the forward (it recomputes the
    # scores): 3.5 x the forward's FLOPs, as the cost model's F and I
    assert costs.attention * 8192 ** 2 == pytest.approx(
        3.5 * layers * core / gpu.matmul_rate(MODEL.head_dim), rel=1e-12)
    head = 3 * 2 * MODEL.dim * MODEL.vocab_size * 8192
    assert costs.linear * 8192 == pytest.approx(
        3 * layers * mat / gpu.matmul_rate(min(MODEL.dim, MODEL.ffn_dim))
        + head / gpu.matmul_rate(min(MODEL.dim, MODEL.vocab_size)), rel=1e-12)
    # the ring passes K and V of each token: inside a node at NVLink, across at the NICs
    kv_bytes = 3 * layers * 2 * MODEL.n_kv_heads * MODEL.head_dim * 2
    assert costs.ring_intra == pytest.approx(kv_bytes / model.cluster.intra.effective_bandwidth)


def test_the_routing_layer_spreads_a_node_crossing_over_every_nic():
    cluster = make_cluster("H100-SXM", 16, 8)  # one NIC per GPU, 50 GB/s each
    routed, pinned = Fabric.of(cluster), Fabric.of(cluster, routing=False)
    nic = cluster.inter.effective_bandwidth
    assert pinned.ring_crossing == pytest.approx(nic)  # the boundary GPU's own NIC
    assert routed.ring_crossing == pytest.approx(8 * nic)  # all 8, relayed over NVLink
    one_nic = Fabric.of(make_cluster("H100-SXM", 16, 8, nics_per_node=1))
    assert one_nic.ring_crossing == pytest.approx(8 * nic)  # one fat NIC: nothing to spread
    assert Fabric.of(make_cluster("H100-SXM", 16, 8, nics_per_node=1), routing=False) \
        .ring_crossing == pytest.approx(8 * nic)
    # an all-to-all has every GPU sending at once: its share, routed or not
    assert routed.per_gpu_inter == pytest.approx(nic) == pinned.per_gpu_inter


def test_a_long_tail_is_predicted_faster_under_zeppelin_than_under_tokens():
    model = _cost_model(gpus=16)
    dist = lognormal(1024, 32, 1.2, seed=1)
    ranking = rank_balances(model, model.cluster, dist, 16 * 8192, steps=2)
    rows = {row.balance: row for row in ranking.rows}
    assert set(rows) == {"none", "tokens", "static-cp8", "zeppelin", "zeppelin-noremap"}
    assert [r.seconds for r in ranking.rows] == sorted(r.seconds for r in ranking.rows)
    assert rows["zeppelin"].seconds < rows["tokens"].seconds
    assert rows["zeppelin"].imbalance["attention"] < rows["tokens"].imbalance["attention"]
    assert rows["zeppelin"].imbalance["linear_after"] < 1.001
    assert rows["static-cp8"].imbalance["linear_before"] < 1.01  # every sequence split by 8
    assert rows["tokens"].remap == 0 and rows["tokens"].max_group == 1


def test_a_partitions_price_is_its_step_time():
    model = _cost_model(gpus=8)
    costs = unit_costs(model, Fabric.of(model.cluster))
    lengths = [8192, 512, 512, 300, 2000, 4000, 100, 64]
    tokens = price(partition_tokens(lengths, Ranks(8, 8), costs))
    assert tokens.seconds == pytest.approx(max(
        costs.attention * sum(n * n for n, b in zip(lengths, part.start) if b == r)
        + costs.linear * sum(n for n, b in zip(lengths, part.start) if b == r)
        for part in [partition_tokens(lengths, Ranks(8, 8), costs)] for r in range(8)))
    zep = plan_zeppelin(lengths, Ranks(8, 8), costs)
    assert price(zep).seconds == zep.step_seconds() <= tokens.seconds


def test_a_step_is_drawn_from_the_distribution_within_the_token_budget():
    dist = LengthDistribution(np.array([100, 1000]), np.array([3.0, 1.0]))
    step = dist.sample_step(10_000, seed=7)
    assert sum(step) <= 10_000 and set(step) <= {100, 1000}
    assert step == dist.sample_step(10_000, seed=7)
    assert dist.sample_step(50, seed=0) in ([100], [1000])  # at least one sequence
    assert dist.median == 100


@pytest.mark.parametrize("text, lengths, weights", [
    ("[512, 2048, 512]", [512, 2048, 512], [1, 1, 1]),
    ('{"histogram": [[512, 10], [4096, 0], [65536, 1]]}', [512, 4096, 65536], [10, 0, 1]),
    ("# lengths\n512\n\n4096 3  # a comment\n", [512, 4096], [1, 3]),
])
def test_the_length_file_formats(tmp_path, text, lengths, weights):
    path = tmp_path / "lengths"
    path.write_text(text)
    dist = load_length_distribution(path)
    assert dist.lengths.tolist() == lengths and dist.weights.tolist() == weights


@pytest.mark.parametrize("text, rule", [
    ("[512, 0]", "length 1: 0 is not an integer >= 1"),
    ("[512, 1.5]", "is not an integer"),
    ('{"histogram": [[512]]}', "histogram entry 0: must be [length, count]"),
    ('{"histogram": [[512, -1]]}', "histogram entry 0 count: -1"),
    ('{"lengths": [1]}', "JSON must be a list of lengths"),
    ("[512,", "is not valid JSON"),
    ("512\nabc\n", "line 2"),
    ("512 1 1\n", "line 1"),
    ("# nothing\n", "holds no lengths"),
    ('{"histogram": [[512, 0]]}', "holds no lengths"),
])
def test_a_bad_length_file_is_refused_by_name(tmp_path, text, rule):
    path = tmp_path / "lengths"
    path.write_text(text)
    with pytest.raises(ConfigError, match="--length-dist") as err:
        load_length_distribution(path)
    assert rule in str(err.value)


def test_a_missing_length_file_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="--length-dist.*file does not exist"):
        load_length_distribution(tmp_path / "absent")


def test_cli_ranks_the_balances_of_a_length_distribution(tmp_path, capsys):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"histogram": [[1024, 60], [4096, 15], [32768, 1]]}))
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--length-dist", str(path),
                 "--global-batch-tokens", str(16 * 16384), "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["ranked"]
    assert {r["balance"] for r in ranked} == {"none", "tokens", "static-cp8", "zeppelin",
                                              "zeppelin-noremap"}
    assert ranked[0]["step_seconds"] <= ranked[-1]["step_seconds"]
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--length-dist", str(path),
                 "--global-batch-tokens", str(16 * 16384)]) == 0
    assert "predicted by the cost model" in capsys.readouterr().out


@pytest.mark.parametrize("args, named", [
    (["--global-batch-tokens", "1000"], "--global-batch-tokens"),  # shorter than the longest
    (["--global-batch-tokens", "100000", "--layout", "dp=16"], "--layout"),
    (["--global-batch-tokens", "100000", "--nics-per-node", "-1"], "--nics-per-node"),
    ([], "--global-batch-tokens"),
    # what the balances do not price is refused, not silently left out
    (["--global-batch-tokens", "100000", "--fp8", "tensorwise"], "--fp8 tensorwise"),
    (["--global-batch-tokens", "100000", "--fp8-all-gather"], "--fp8-all-gather"),
    (["--global-batch-tokens", "100000", "--sites", "2"], "--sites 2"),
    (["--global-batch-tokens", "100000", "--mixed", "cluster.toml"], "--mixed cluster.toml"),
])
def test_cli_refuses_bad_varlen_input_by_name(tmp_path, capsys, args, named):
    path = tmp_path / "lengths.txt"
    path.write_text("1024 5\n4096 1\n")
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--length-dist", str(path),
                 *args]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1


def test_cli_refuses_a_bad_length_file_with_exit_2(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("1024\n-5\n")
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--length-dist", str(path),
                 "--global-batch-tokens", "100000"]) == 2
    assert "--length-dist" in capsys.readouterr().err
