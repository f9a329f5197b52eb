"""Specifications for loom.topology.RankGrid: the named, row-major grid of ranks.

Axes, outermost first: pp, dp_replicate, dp_shard, ep, cp, tp. The last axis varies fastest, so
a tp group is a run of consecutive ranks.
"""

from __future__ import annotations

import itertools
import math

import pytest

from loom.topology import AXES, DATA_AXES, RankGrid

SHAPES = [
    {},
    {"tp": 2},
    {"dp_replicate": 4},
    {"pp": 2, "tp": 2},
    {"pp": 2, "dp_replicate": 2, "tp": 2},
    {"pp": 3, "dp_shard": 2, "cp": 2},
    {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "ep": 2, "cp": 2, "tp": 2},
]
SHAPE_IDS = ["x".join(f"{a}{d}" for a, d in s.items()) or "single" for s in SHAPES]


def test_axes_are_listed_outermost_first() -> None:
    assert AXES == ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
    assert DATA_AXES == ("dp_replicate", "dp_shard", "ep")


@pytest.mark.parametrize("degrees", SHAPES, ids=SHAPE_IDS)
def test_shape_and_size(degrees: dict[str, int]) -> None:
    grid = RankGrid(degrees)
    assert grid.shape == tuple(degrees.get(a, 1) for a in AXES)
    assert grid.size == math.prod(degrees.values())


@pytest.mark.parametrize("degrees", SHAPES, ids=SHAPE_IDS)
def test_rank_coords_round_trip(degrees: dict[str, int]) -> None:
    grid = RankGrid(degrees)
    seen = set()
    for rank in range(grid.size):
        coords = grid.coords(rank)
        assert list(coords) == list(AXES)
        assert all(0 <= coords[a] < degrees.get(a, 1) for a in AXES)
        assert grid.rank(**coords) == rank
        seen.add(tuple(coords.values()))
    assert len(seen) == grid.size  # every rank has its own coordinates


@pytest.mark.parametrize("degrees", SHAPES, ids=SHAPE_IDS)
def test_ranks_are_row_major(degrees: dict[str, int]) -> None:
    grid = RankGrid(degrees)
    every_coordinate = itertools.product(*(range(d) for d in grid.shape))
    assert [tuple(grid.coords(r).values()) for r in range(grid.size)] == list(every_coordinate)


def test_rank_with_axes_left_out_is_at_coordinate_0() -> None:
    grid = RankGrid({"pp": 2, "dp_replicate": 2, "tp": 2})
    assert grid.rank() == 0
    assert grid.rank(tp=1) == 1
    assert grid.rank(dp_replicate=1) == 2
    assert grid.rank(pp=1) == 4
    assert grid.rank(pp=1, dp_replicate=1, tp=1) == 7


@pytest.mark.parametrize("degrees", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("axis", AXES)
def test_groups_along_one_axis_partition_the_ranks(degrees: dict[str, int], axis: str) -> None:
    grid = RankGrid(degrees)
    groups = grid.groups(axis)
    assert sorted(itertools.chain(*groups)) == list(range(grid.size))
    assert all(len(g) == grid.degree(axis) == degrees.get(axis, 1) for g in groups)
    assert len(groups) == grid.size // grid.degree(axis)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    for group in groups:
        # Members agree on every other axis and take each coordinate of this one once, in order.
        coords = [grid.coords(r) for r in group]
        assert [c[axis] for c in coords] == list(range(len(group)))
        for other in AXES:
            if other != axis:
                assert len({c[other] for c in coords}) == 1
        for rank in group:
            assert grid.group(rank, axis) == group


def test_tp_the_last_axis_is_contiguous() -> None:
    grid = RankGrid({"pp": 2, "dp_replicate": 2, "tp": 2})
    assert grid.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert grid.groups("dp_replicate") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert grid.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_groups_along_several_axes() -> None:
    grid = RankGrid({"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2})
    dp_groups = grid.groups(*DATA_AXES)
    assert dp_groups == [(0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)]
    assert grid.groups("dp_shard", "tp") == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11),
                                             (12, 13, 14, 15)]
    # The order the axes are named in does not matter: groups follow the grid's axis order.
    assert grid.groups("tp", "dp_shard") == grid.groups("dp_shard", "tp")
    assert grid.groups(*AXES) == [tuple(range(16))]
    assert grid.groups() == [(r,) for r in range(16)]  # along no axis: each rank alone


@pytest.mark.parametrize("degrees", SHAPES, ids=SHAPE_IDS)
def test_groups_along_axis_pairs_partition_the_ranks(degrees: dict[str, int]) -> None:
    grid = RankGrid(degrees)
    for a, b in itertools.combinations(AXES, 2):
        groups = grid.groups(a, b)
        assert sorted(itertools.chain(*groups)) == list(range(grid.size))
        assert all(len(g) == grid.degree(a, b) for g in groups)


def test_index_is_the_position_inside_the_group() -> None:
    grid = RankGrid({"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2})
    for axes in [("tp",), ("pp",), DATA_AXES, ("dp_shard", "tp")]:
        for group in grid.groups(*axes):
            assert [grid.index(r, *axes) for r in group] == list(range(len(group)))
    assert grid.index(13, *DATA_AXES) == 2  # rank 13 = pp 1, dp_replicate 1, dp_shard 0, tp 1
    assert grid.index(5, "pp") == 0 and grid.index(13, "pp") == 1
    assert grid.index(7) == 0


def test_degree_is_the_product_over_the_axes() -> None:
    grid = RankGrid({"pp": 2, "dp_replicate": 3, "dp_shard": 2, "tp": 4})
    assert grid.degree("tp") == 4
    assert grid.degree("cp") == 1
    assert grid.degree(*DATA_AXES) == 6
    assert grid.degree("pp", "tp") == 8
    assert grid.degree(*AXES) == grid.size == 48
    assert grid.degree() == 1


def test_str_lists_coordinates_and_groups() -> None:
    text = str(RankGrid({"dp_replicate": 2, "tp": 2}))
    assert text.splitlines()[0] == "RankGrid(dp_replicate=2 x tp=2; 4 ranks)"
    assert "tp groups: [0, 1] [2, 3]" in text
    assert "dp_replicate groups: [0, 2] [1, 3]" in text
    assert "pp" not in text  # degree-1 axes are left out
    assert str(RankGrid({})) == "RankGrid(single rank; 1 ranks)"


def test_grids_compare_by_degrees() -> None:
    assert RankGrid({"tp": 2}) == RankGrid({"tp": 2, "pp": 1})
    assert RankGrid({"tp": 2}) != RankGrid({"pp": 2})
    assert len({RankGrid({"tp": 2}), RankGrid({"tp": 2, "cp": 1})}) == 1


@pytest.mark.parametrize("degrees, words", [
    ({"tensor": 2}, "unknown axes ['tensor']"),
    ({"tp": 0}, "degree of axis 'tp' must be a positive integer, got 0"),
    ({"pp": -1}, "degree of axis 'pp' must be a positive integer, got -1"),
    ({"dp_shard": 1.5}, "degree of axis 'dp_shard' must be a positive integer, got 1.5"),
    ({"cp": "2"}, "degree of axis 'cp' must be a positive integer, got '2'"),
])
def test_invalid_degrees_raise_naming_the_axis(degrees: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        RankGrid(degrees)
    assert words in str(info.value)


def test_unknown_axis_names_raise_everywhere() -> None:
    grid = RankGrid({"tp": 2})
    for call in (lambda: grid.degree("dp"), lambda: grid.group(0, "dp"),
                 lambda: grid.groups("tp", "dp"), lambda: grid.index(0, "dp"),
                 lambda: grid.rank(dp=0)):
        with pytest.raises(ValueError, match=r"unknown axes \['dp'\]"):
            call()


def test_out_of_range_ranks_and_coordinates_raise() -> None:
    grid = RankGrid({"pp": 2, "tp": 2})
    with pytest.raises(ValueError, match="rank 4 outside a grid of 4 ranks"):
        grid.coords(4)
    with pytest.raises(ValueError, match="rank -1 outside"):
        grid.coords(-1)
    with pytest.raises(ValueError, match="coordinate tp=2 outside degree 2"):
        grid.rank(tp=2)
