"""A rank grid as ``loom train --dry-run`` prints it: every rank's coordinates, compact when large.

``str(RankGrid)`` lists every rank and every group: right for the few ranks of a local run, and
thousands of lines for a cluster. ``describe_grid`` prints that full table up to ``full_up_to``
ranks. Past it, what is needed to place any rank by hand: ranks are row-major over the axes, so a
rank is the sum of its coordinates times the axes' strides (the formula is printed), then the
first and last few ranks, and per axis how many groups there are and rank 0's group.
"""

from __future__ import annotations

from loom.topology import RankGrid


def _strides(grid: RankGrid) -> dict[str, int]:
    """Axis -> how far apart two ranks one step apart on that axis are."""
    strides, stride = {}, 1
    for axis, degree in reversed(grid.degrees):
        strides[axis] = stride
        stride *= degree
    return strides


def _members(ranks: list[int], shown: int = 8) -> str:
    if len(ranks) <= shown:
        return "[" + ", ".join(map(str, ranks)) + "]"
    head = ", ".join(map(str, ranks[:shown // 2]))
    return f"[{head}, ..., {ranks[-1]}]"


def describe_grid(grid: RankGrid, full_up_to: int = 64, edge: int = 4) -> str:
    """The grid's rank -> coordinates table: all of it up to ``full_up_to`` ranks, else the
    rank formula, the first and last ``edge`` ranks and a summary of each axis's groups."""
    if grid.size <= full_up_to:
        return str(grid)
    active = [(axis, degree) for axis, degree in grid.degrees if degree > 1]
    names = [axis for axis, _ in active]
    strides = _strides(grid)
    formula = " + ".join(f"{strides[a]}*{a}" if strides[a] > 1 else a for a in names)
    header = " x ".join(f"{a}={d}" for a, d in active)
    lines = [f"RankGrid({header}; {grid.size:,} ranks): rank = {formula}",
             "rank  " + "  ".join(f"{n:>12}" for n in names)]
    width = max(4, len(str(grid.size - 1)))
    for rank in [*range(edge), None, *range(grid.size - edge, grid.size)]:
        if rank is None:
            lines.append(f"{'...':>{width}}")
            continue
        coords = grid.coords(rank)
        lines.append(f"{rank:>{width}}  " + "  ".join(f"{coords[n]:>12}" for n in names))
    for axis, degree in active:
        group = list(grid.group(0, axis))
        lines.append(f"{axis} groups: {grid.size // degree:,} of {degree} ranks,"
                     f" {strides[axis]} apart; rank 0's: {_members(group)}")
    return "\n".join(lines)


__all__ = ["describe_grid"]
