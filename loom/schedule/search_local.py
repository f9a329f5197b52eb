"""Local improvement for ``loom.schedule.search``: adjacent swaps on one rank, hill climbing.

A list scheduler decides greedily, one rank and one instant at a time, so its orders often hold
a W that delays an I, or a forward that would have been better one slot later. This pass tries
every swap of two adjacent actions on a rank (which moves a W earlier or later one slot at a
time, or exchanges an F and an I) and keeps a swap only when the order still runs (no deadlock,
the same-rank dependencies stay in order), the rank stays within the memory limit, and the
score improves (a shorter makespan, or the same makespan with less idle time inside the longest
rank span, the Zero Bubble paper's bubble). It stops after a pass without improvement or when the
search's effort budget is spent, so it only matters for small sizes, where it is cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from loom.schedule.replay import EPS, Costs, Row, Score, live_levels, score


class Budget(Protocol):
    def spend(self, actions: int) -> None: ...

    def exhausted(self) -> bool: ...


def improve(
    rows: Sequence[Row],
    placement: Sequence[int],
    microbatches: int,
    costs: Costs,
    limit: float,
    start: Score,
    budget: Budget,
    max_passes: int = 4,
) -> tuple[list[Row], Score] | None:
    """A better order than ``rows`` (and its score), or None if no swap helped."""
    rows = [list(row) for row in rows]
    size = sum(len(row) for row in rows)
    chunks = [max(placement.count(r), 1) for r in range(len(rows))]
    ones = [1] * len(placement)  # live memory in chunks: a chunk of v weighs 1/v units
    best = start
    for _ in range(max_passes):
        improved = False
        for rank, row in enumerate(rows):
            for n in range(len(row) - 1):
                if budget.exhausted():
                    return (rows, best) if best.better_than(start) else None
                a, b = row[n], row[n + 1]
                if a[0] == b[0] and a[2] == b[2]:
                    continue  # same (stage, microbatch): the later one depends on the earlier
                row[n], row[n + 1] = b, a
                budget.spend(size)
                candidate = score(rows, placement, microbatches, costs)
                if (candidate is not None and candidate.better_than(best)
                        and max(live_levels(row, ones)) / chunks[rank] <= limit + EPS):
                    best, improved = candidate, True
                else:
                    row[n], row[n + 1] = a, b
        if not improved:
            break
    return (rows, best) if best.better_than(start) else None

