"""Specifications for loom.grid_summary: the rank table of ``loom train --dry-run``."""

from __future__ import annotations

import re

from loom.grid_summary import describe_grid
from loom.topology import AXES, RankGrid


def test_a_small_grid_is_shown_whole() -> None:
    grid = RankGrid({"dp_replicate": 2, "tp": 2})
    assert describe_grid(grid) == str(grid)
    assert "   3             1             1" in describe_grid(grid)


def test_a_large_grid_is_compact_and_places_every_rank() -> None:
    grid = RankGrid({"pp": 16, "dp_shard": 64, "tp": 8})
    text = describe_grid(grid)
    lines = text.splitlines()
    assert len(lines) < 20
    assert lines[0] == ("RankGrid(pp=16 x dp_shard=64 x tp=8; 8,192 ranks):"
                        " rank = 512*pp + 8*dp_shard + tp")
    # the formula places any rank: check it against the grid itself
    strides = {axis: int(n) for n, axis in re.findall(r"(\d+)\*(\w+)", lines[0])} | {"tp": 1}
    for rank in (0, 1, 777, 4095, 8191):
        assert sum(strides[a] * c for a, c in grid.coords(rank).items() if a in strides) == rank
    rows = [line.split() for line in lines[2:] if line.strip() != "..."
            and line.strip()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3, 8188, 8189, 8190, 8191]
    for rank, *coords in rows:
        expected = grid.coords(int(rank))
        assert [int(c) for c in coords] == [expected[a] for a in ("pp", "dp_shard", "tp")]
    assert "tp groups: 1,024 of 8 ranks, 1 apart; rank 0's: [0, 1, 2, 3, 4, 5, 6, 7]" in lines
    assert "dp_shard groups: 128 of 64 ranks, 8 apart; rank 0's: [0, 8, 16, 24, ..., 504]" in lines
    assert list(grid.group(0, "pp"))[-1] == 7680
    assert "rank 0's: [0, 512, 1024, 1536, ..., 7680]" in text


def test_the_threshold_is_the_world_size() -> None:
    degrees = dict.fromkeys(AXES, 1) | {"dp_replicate": 65}
    assert "..." in describe_grid(RankGrid(degrees))
    assert "..." not in describe_grid(RankGrid(degrees), full_up_to=65)
