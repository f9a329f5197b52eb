"""The schedule search's result types: ``Candidate`` (one ranked schedule) and ``SearchResult``
(the winner, its simulation and the leaderboard), with ``Place``, a placement kind and its
stages per rank.

Their own module so that the search (``loom.schedule.search``) and its PipeOffload step
(``loom.schedule.search_offload``) both build them without importing each other;
``loom.schedule.search`` re-exports them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from loom.schedule.ir import Op, Schedule
from loom.schedule.cost import StageCosts
from loom.schedule.offload import count_transfers
from loom.schedule.simulate import Figures, SimResult, simulate

Place = tuple[str, int]  # (placement kind, stages per rank): ("interleaved", 4), ("v", 2), ...


@dataclass(frozen=True)
class Candidate:
    """One ranked candidate: where it came from and its replayed makespan and peak memory."""

    label: str
    placement: str  # looped, interleaved, v or wave (``Place``'s kind)
    makespan: float
    peak: float
    idle_zb: float = 0.0  # idle time inside the longest rank span (``SimResult.bubble_time_zb``)
    chunks: int = 1  # stages per rank

    @property
    def place(self) -> Place:
        return (self.placement, self.chunks)


@dataclass(frozen=True)
class SearchResult:
    """The best schedule, its exact headline figures, and what the search looked at; its full
    simulation (``sim_result``: a slot per action) is made when first asked for."""

    schedule: Schedule
    figures: Figures  # ``simulate.headline`` of ``schedule`` with ``costs``
    costs: StageCosts  # the placement-scaled costs ``figures`` were simulated with
    memory_limit: float
    candidates_tried: int
    best: Candidate
    leaderboard: tuple[Candidate, ...] = field(default=())  # the best few, best first
    # the simulation when it is not ``simulate``'s (PipeOffload's, which prices the transfers)
    simulated: SimResult | None = field(default=None, repr=False, compare=False)

    @cached_property
    def sim_result(self) -> SimResult:
        """The winner's simulation: timeline and memory curves (``figures`` are its numbers)."""
        return self.simulated if self.simulated is not None else simulate(self.schedule,
                                                                          self.costs)

    def summary(self) -> dict:
        simulated = self.simulated.summary() if self.simulated is not None else \
            self.figures.report(self.schedule, self.costs.describe())
        return {
            "schedule": self.schedule.name,
            "placement": self.best.placement,
            "chunks": self.best.chunks,
            "memory_limit": self.memory_limit,
            "candidates_tried": self.candidates_tried,
            **simulated,
            "leaderboard": [dataclasses.asdict(c) for c in self.leaderboard],
            # PipeOffload's transfers (``search(..., offload=True)``), when the winner has any
            **({"offloads": sum(n for (_, op), n in count_transfers(self.schedule).items()
                                if op is Op.O)} if self.schedule.has_transfers else {}),
        }
