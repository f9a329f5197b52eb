"""The partitioner: exact optimum of the largest stage cost, embedding and head accounted."""

import itertools
import random

import pytest

from loom.models import preset
from loom.pipeline.partition import max_stage_cost, partition, partition_model, stage_costs


def brute_force(n_layers, n_stages, costs, embedding, head):
    best = float("inf")
    for cuts in itertools.combinations(range(1, n_layers), n_stages - 1):
        bounds = (0, *cuts, n_layers)
        ranges = [range(a, b) for a, b in zip(bounds, bounds[1:])]
        best = min(best, max_stage_cost(ranges, costs, embedding, head))
    return best


def test_uniform_layers_split_evenly():
    assert partition(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition(4, 4) == [range(i, i + 1) for i in range(4)]
    assert sorted(len(r) for r in partition(8, 3)) == [2, 3, 3]


def test_the_head_unbalances_the_last_stage():
    # A head worth two layers: the last stage gets two fewer layers.
    assert [len(r) for r in partition(10, 2, head_cost=2.0)] == [6, 4]
    assert [len(r) for r in partition(10, 2, embedding_cost=2.0)] == [4, 6]
    # Both ends cost one layer: the middle stage takes the extra layers.
    assert [len(r) for r in partition(13, 3, embedding_cost=1.0, head_cost=1.0)] == [4, 5, 4]


def test_exact_optimum_on_small_random_cases():
    rng = random.Random(0)
    for _ in range(200):
        n_layers = rng.randint(1, 9)
        n_stages = rng.randint(1, n_layers)
        costs = [rng.choice([0.5, 1.0, 1.5, 3.0]) for _ in range(n_layers)]
        embedding, head = rng.choice([0.0, 0.7, 2.0]), rng.choice([0.0, 1.3, 4.0])
        ranges = partition(n_layers, n_stages, costs, embedding, head)
        assert len(ranges) == n_stages and all(len(r) >= 1 for r in ranges)
        assert [i for r in ranges for i in r] == list(range(n_layers))
        assert max_stage_cost(ranges, costs, embedding, head) == pytest.approx(
            brute_force(n_layers, n_stages, costs, embedding, head))


def test_default_costs_from_the_model_shape():
    args = preset("llama3-8b")
    costs = stage_costs(args, seq_len=8192)
    # D*V / (12-ish D^2 + attention): between 0.5 and 2 layers for Llama 3 8B.
    assert costs["layer"] == 1.0 and costs["embedding"] == 0.0 and 0.5 < costs["head"] < 2.0
    ranges = partition_model(args, 4, seq_len=8192)
    # 32 layers + a head of ~1.8 layers: the last stage gives up one to two layers, the others
    # stay as even as the bottleneck of 9 allows.
    assert sorted(len(r) for r in ranges[:3]) == [8, 8, 9] and len(ranges[3]) == 7


def test_a_vocabulary_split_over_the_pipeline_leaves_the_layers_even():
    """Under ``parallel.vocab_parallel_pp`` every rank runs 1/p of the head and holds 1/p of
    the embedding, the same work on each: the last stage keeps all of its layers."""
    args = preset("llama3-8b")
    assert [len(r) for r in partition_model(args, 4, seq_len=8192, vocab_spread=True)] == \
        [8, 8, 8, 8]


def test_rejects_impossible_splits():
    with pytest.raises(ValueError, match="n_layers >= n_stages"):
        partition(3, 4)
    with pytest.raises(ValueError, match="entries"):
        partition(3, 2, [1.0, 1.0])
