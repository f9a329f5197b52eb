"""Specification of the Zeppelin partition planner (``loom.data.zeppelin``): every token placed
once, groups that are aligned contiguous sub-rings of a power-of-two size, a plan never slower
on its cost model than dealing by tokens, a linear stage balanced to one token after remapping
that moves only each rank's surplus (inside the node first), and a long tail that it balances
where ``tokens`` cannot."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.data.varlen import balance_tokens
from loom.data.zeppelin import (
    Partition,
    Ranks,
    TokenCosts,
    group_time,
    partition_none,
    partition_static_cp,
    partition_tokens,
    plan_zeppelin,
)

COSTS = TokenCosts(linear=1e-5, attention=2e-10, ring_intra=2e-7, ring_inter=2e-6,
                   remap_intra=1e-6, remap_inter=1e-5)

steps = st.tuples(
    st.lists(st.integers(1, 5000), min_size=1, max_size=60),
    st.sampled_from([(1, 1), (2, 2), (4, 2), (8, 4), (8, 8), (16, 4), (6, 2), (12, 4)]),
    st.sampled_from([COSTS, TokenCosts(1e-5, 2e-10, 1e-4, 1e-3, 1e-3, 1e-2),
                     TokenCosts(0, 1e-9, 0, 0), TokenCosts(1e-5, 1e-9, 0, 0, 0, 0)]),
)


def _check_exact_cover(part: Partition) -> None:
    held = np.concatenate([part.token_indices(r) for r in range(part.ranks.count)])
    assert np.array_equal(np.sort(held), np.arange(part.total_tokens))
    assert part.rank_tokens().tolist() == [len(part.token_indices(r))
                                           for r in range(part.ranks.count)]


@settings(max_examples=60, deadline=None)  # 150 took 9 s of the suite's budget
@given(steps)
def test_every_token_is_held_exactly_once_in_both_layouts(step):
    lengths, (count, per_node), costs = step
    ranks = Ranks(count, per_node)
    for part in (plan_zeppelin(lengths, ranks, costs), partition_tokens(lengths, ranks),
                 partition_none(lengths, ranks)):
        _check_exact_cover(part)
        linear = part.linear_layout()
        assert np.array_equal(np.sort(np.concatenate(linear)), np.arange(part.total_tokens))
        assert [len(ix) for ix in linear] == part.quotas().tolist()
        assert part.quotas().max() - part.quotas().min() <= 1
        moved = part.moved_tokens()
        for r in range(count):  # a rank keeps what fits its quota, moves only its surplus
            kept = len(np.intersect1d(linear[r], part.token_indices(r)))
            assert kept == moved[r, r] == min(part.rank_tokens()[r], part.quotas()[r])
        assert moved.sum(axis=1).tolist() == part.rank_tokens().tolist()
        assert moved.sum(axis=0).tolist() == part.linear_tokens_after().tolist()


@settings(max_examples=150, deadline=None)
@given(steps)
def test_groups_are_aligned_contiguous_sub_rings_of_a_power_of_two(step):
    lengths, (count, per_node), costs = step
    part = plan_zeppelin(lengths, Ranks(count, per_node), costs)
    for n, b, g in zip(part.lengths, part.start, part.size):
        assert g & (g - 1) == 0 and 1 <= g <= count
        assert b % g == 0 and b + g <= count
        assert g == 1 or n >= 2 * g  # every zig-zag chunk holds a token
        if g <= per_node and per_node & (per_node - 1) == 0:
            assert part.ranks.inside_node(b, g)  # within a node first


@settings(max_examples=150, deadline=None)
@given(steps)
def test_never_slower_than_dealing_by_tokens_on_the_cost_model(step):
    lengths, (count, per_node), costs = step
    ranks = Ranks(count, per_node)
    zep, tokens = plan_zeppelin(lengths, ranks, costs), partition_tokens(lengths, ranks, costs)
    assert zep.step_seconds() <= tokens.step_seconds() * (1 + 1e-12)
    assert tokens.step_seconds() == pytest.approx(
        max(costs.attention * sum(n * n for n, b in zip(lengths, tokens.start) if b == r)
            + costs.linear * sum(n for n, b in zip(lengths, tokens.start) if b == r)
            for r in range(count)), rel=1e-12)
    if zep.remapped:  # the linear stage after remapping: one token above the mean at most
        assert zep.rank_linear().max() <= costs.linear * -(-sum(lengths) // count) * (1 + 1e-12)


@settings(max_examples=50, deadline=None)
@given(steps)
def test_the_plan_is_deterministic(step):
    lengths, (count, per_node), costs = step
    a = plan_zeppelin(lengths, Ranks(count, per_node), costs)
    b = plan_zeppelin(list(lengths), Ranks(count, per_node), costs)
    assert (a.start, a.size) == (b.start, b.size)


def test_the_tokens_baseline_is_varlens_deal():
    lengths = [900, 30, 512, 7, 77, 300, 300, 1]
    part = partition_tokens(lengths, Ranks(3, 3))
    assert list(part.start) == balance_tokens(np.array(lengths), 3, sum(lengths)).tolist()
    assert set(part.size) == {1}


def test_a_long_tail_is_balanced_where_tokens_cannot_be():
    """One sequence 32x the median: alone on one rank it sets the step (tokens' attention
    max/mean is large); Zeppelin rings it over a node or more and deals the short ones whole."""
    lengths = [32 * 1024] + [1024] * 900
    ranks = Ranks(16, 8)
    costs = TokenCosts(linear=1e-7, attention=2e-10, ring_intra=2e-8, ring_inter=2e-7,
                       remap_intra=1e-9, remap_inter=1e-8)  # attention matters above ~500 tokens
    tokens = partition_tokens(lengths, ranks, costs).imbalance()
    zep_part = plan_zeppelin(lengths, ranks, costs)
    zep = zep_part.imbalance()
    assert tokens["attention"] > 3
    assert zep["attention"] < 1.2
    assert zep["linear_after"] == 1.0 and zep_part.remapped
    assert zep_part.step_seconds() < 0.5 * partition_tokens(lengths, ranks, costs).step_seconds()
    assert zep_part.size[0] >= 8 and set(zep_part.size[1:]) == {1}  # short ones stay whole


def test_static_cp_pays_the_ring_for_short_sequences():
    """With communication dearer than a short sequence's blocks, a fixed ring is slower than
    keeping short sequences whole; the planner keeps them whole."""
    lengths = [256] * 64
    ranks = Ranks(8, 8)
    costly = TokenCosts(linear=1e-5, attention=2e-10, ring_intra=1e-5, ring_inter=1e-4)
    cp = partition_static_cp(lengths, ranks, 8, costly)
    zep = plan_zeppelin(lengths, ranks, costly)
    assert zep.step_seconds() < cp.step_seconds()
    assert set(zep.size) == {1}


def test_group_time_is_the_ring_of_blocks():
    c = TokenCosts(linear=0, attention=1.0, ring_intra=10.0, ring_inter=100.0)
    assert group_time(8, 1, True, c) == 64
    assert group_time(8, 2, True, c) == 16 + 1 * max(16, 40)  # communication-bound step
    assert group_time(8, 2, False, c) == 16 + 400
    assert group_time(64, 4, True, c) == 256 + 3 * max(256, 160)  # compute-bound: hidden


def test_zig_zag_chunks_pair_the_ends():
    part = Partition("x", (8,), (0,), (2,), Ranks(2, 2), COSTS)
    assert part.token_indices(0).tolist() == [0, 1, 6, 7]
    assert part.token_indices(1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("bad", [[], [0], [5, -1]])
def test_an_empty_or_non_positive_step_is_refused(bad):
    with pytest.raises(ValueError, match="one or more sequences"):
        plan_zeppelin(bad, Ranks(2, 2), COSTS)


def test_bad_ranks_and_costs_are_refused_by_name():
    with pytest.raises(ValueError, match="count"):
        Ranks(0, 1)
    with pytest.raises(ValueError, match="ring_inter"):
        TokenCosts(1.0, 1.0, 0.0, -1.0)
    with pytest.raises(ValueError, match="cp=3"):
        partition_static_cp([100] * 4, Ranks(4, 4), 3)


def test_the_remapping_moves_surplus_inside_the_node_first():
    """Rank 0 holds 3 tokens over its quota of 2, rank 1 one under, rank 2 (the other node)
    two under: one token stays in the node, two cross."""
    part = Partition("x", (5, 1, 2), (0, 1, 3), (1, 1, 1), Ranks(4, 2), COSTS)
    assert part.rank_tokens().tolist() == [5, 1, 0, 2]
    moved = part.moved_tokens()
    assert moved[0].tolist() == [2, 1, 2, 0]
    assert [ix.tolist() for ix in part.linear_layout()] == [[0, 1], [5, 2], [3, 4], [6, 7]]


def test_without_remapping_attention_and_linear_are_balanced_together():
    lengths = [32 * 1024] + [1024] * 900
    costs = TokenCosts(linear=1e-7, attention=2e-10, ring_intra=2e-8, ring_inter=2e-7,
                       remap_intra=1e-9, remap_inter=1e-8)
    part = plan_zeppelin(lengths, Ranks(16, 8), costs, remap=False)
    assert not part.remapped and part.remap_seconds() == 0.0
    work = part.rank_attention() + part.rank_linear()
    assert work.max() / work.mean() < 1.1
    assert part.step_seconds() <= partition_tokens(lengths, Ranks(16, 8), costs).step_seconds()


def test_an_emulated_clusters_regions_are_its_nodes():
    from loom.cluster import Link, regions

    cluster = regions([4, 2, 2], intra=Link(1e-5, 1e10), inter=Link(1e-3, 1e8))
    ranks = Ranks.of_cluster(cluster)
    assert ranks.node_ids().tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert ranks.largest_in_node() == 4
    assert ranks.inside_node(4, 2) and not ranks.inside_node(2, 4)
    part = plan_zeppelin([4096] + [64] * 40, ranks, COSTS)
    assert part.size[0] > 1  # the long one is ringed: inside the 4-device region
    for b, g in zip(part.start, part.size):
        assert g == 1 or ranks.inside_node(b, g)
    _check_exact_cover(part)
    with pytest.raises(ValueError, match="non-decreasing"):
        Ranks(3, nodes=(0, 1, 0))
