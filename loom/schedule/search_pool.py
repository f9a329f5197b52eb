"""What the schedule search keeps while it runs: its effort budget and its pool of candidates.

``Budget`` counts the effort in simulated actions, so the same inputs give the same schedule on
any machine (an optional wall-time stop trades that for a bound on time); ``Pool`` holds every
candidate that fits and ranks them as ``loom.schedule.search`` documents (makespan, then the
Zero Bubble idle, then peak, then arrival), replaying a candidate's idle only when the ranking
needs it, and remembers how to build an order again on another problem (``Recipe``: the way
back to full size for the orders found on the search's smaller copy). Split from ``search.py``,
which decides what to try; this module only keeps and ranks. It communicates nothing.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from loom.schedule.ir import Schedule
from loom.schedule.replay import Costs, Row, Score, score
from loom.schedule.search_types import Candidate

# builds an order again on another problem (the search's, which lives with the search: Any
# here) under a memory limit: its rows, and its score where built with it
Recipe = Callable[[Any, float], "tuple[list[Row], Score | None] | None"]


class Budget:
    """Effort counted in simulated actions (deterministic), plus an optional wall-time stop."""

    def __init__(self, effort: int, time_budget_s: float | None, deadline: float | None = None):
        self.left = effort
        self.spent = 0
        self.deadline = deadline
        if time_budget_s is not None:
            self.deadline = time.monotonic() + time_budget_s

    def spend(self, actions: int) -> None:
        self.left -= actions
        self.spent += actions

    def share(self, parts: int) -> Budget:
        """A budget of 1/parts of what is left (the caller spends what the share spent)."""
        return Budget(max(self.left, 0) // max(parts, 1), None, self.deadline)

    def late(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def exhausted(self) -> bool:
        return self.left <= 0 or self.late()


class Pool:
    """Every candidate that fits; ``best`` orders by makespan, then idle, then peak, then
    arrival.

    A candidate whose makespan is known without a replay (the list scheduler's sweep) may come
    without its idle (``add(..., idle_from=...)``): the idle is replayed only when ``best`` needs
    it, i.e. when the makespan alone does not already rank the candidate below the ones asked
    for. Most sweep candidates are longer than five others and are never replayed (a replay at
    p=32, m=256 and four chunks per rank is a twentieth of a second), and the order is exactly
    the one with every idle known."""

    def __init__(self) -> None:
        self.entries: list[tuple[Candidate, list[Row]]] = []
        self.tried = 0
        # a seed's own Schedule, by the id of its rows (which the pool keeps alive): the winner
        # need not be decoded again (a second at p=64, m=512 and 8 chunks)
        self.built: dict[int, Schedule] = {}
        # entry index -> (layout, microbatches, costs) to replay its idle with (``add``)
        self.unscored: dict[int, tuple[tuple[int, ...], int, Costs]] = {}
        # how to build an order again on another problem, by the id of its rows: ``_grown``'s
        # way back to full size for an order whose steady state does not repeat
        self.recipes: dict[int, Recipe] = {}

    def add(self, candidate: Candidate, rows: list[Row], built: Schedule | None = None,
            idle_from: tuple[tuple[int, ...], int, Costs] | None = None,
            recipe: Recipe | None = None) -> None:
        """``idle_from``: ``candidate``'s idle is not known yet; replay ``rows`` on this layout,
        microbatches and costs when it counts (``candidate.idle_zb`` is a placeholder until)."""
        if idle_from is not None:
            self.unscored[len(self.entries)] = idle_from
        self.entries.append((candidate, rows))
        if built is not None:
            self.built[id(rows)] = built
        if recipe is not None:
            self.recipes[id(rows)] = recipe

    def best(self, count: int) -> list[tuple[Candidate, list[Row]]]:
        self._score(count)

        def key(n: int) -> tuple:
            c = self.entries[n][0]
            return (*Score(c.makespan, c.idle_zb).key(), c.peak, n)

        order = sorted(range(len(self.entries)), key=key)
        return [self.entries[n] for n in order[:count]]

    def _score(self, count: int) -> None:
        """Replay the idle of every unscored entry that the makespan alone does not rank below
        the first ``count``: those ranked below have ``count`` entries whose (rounded) makespan
        is smaller, which no idle can reorder."""
        if not self.unscored or count <= 0:
            return
        rounded = sorted(Score(c.makespan, 0.0).key()[0] for c, _ in self.entries)
        bar = rounded[min(count, len(rounded)) - 1]
        for n in sorted(self.unscored):
            candidate, rows = self.entries[n]
            if Score(candidate.makespan, 0.0).key()[0] > bar:
                continue
            layout, microbatches, costs = self.unscored.pop(n)
            scored = score(rows, layout, microbatches, costs)
            idle = scored.idle_zb if scored is not None else float("inf")
            self.entries[n] = (dataclasses.replace(candidate, idle_zb=idle), rows)


__all__ = ["Budget", "Pool", "Recipe"]
