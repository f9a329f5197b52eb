"""The placements the schedule search considers, and what each means for a step.

A ``Place`` is a placement kind and its stages per rank: looped (v = 1), interleaved (looped with
v >= 2), V (the v = 2 zig-zag) and wave (the zig-zag with v >= 3, Hanayo's). ``places`` lists
what the search tries (one pinned, or every kind at every chunk count up to ``max_chunks``);
``placement_of`` and ``place_of`` translate between a ``Place`` and its stage -> rank tuple;
``placement_costs`` gives each chunk its share of a full stage's costs (the CLI's one meaning of
``--costs``). Split from ``loom.schedule.search`` (which re-exports these names): the vocabulary
of placements is shared by the search, its CLI and the benchmarks, the search algorithm is not.
"""

from __future__ import annotations

from loom.schedule.cost import StageCosts, full_stage_costs
from loom.schedule.families import SEARCH_PLACEMENTS
from loom.schedule.ir import Schedule, looped_placement, v_placement
from loom.schedule.search_types import Place

PLACEMENTS = SEARCH_PLACEMENTS  # what ``placement`` pins: looped (v=1), interleaved (v=2), v (V)
PINNED = {"looped": ("looped", 1), "interleaved": ("interleaved", 2), "v": ("v", 2)}
MAX_CHUNKS = 8  # stages per rank the search goes up to (fewer where the layers do not allow)


class SearchError(ValueError):
    """The search cannot run with these inputs (the message names the argument and the rule);
    ``argument`` is that parameter's name (pp, microbatches, costs, memory_limit, placement or
    max_chunks), for a caller that refuses by its own flag's name."""

    def __init__(self, message: str, argument: str):
        super().__init__(message)
        self.argument = argument


def places(pp: int, placement: str = "any", max_chunks: int = MAX_CHUNKS) -> list[Place]:
    """The placements the search considers: ``placement`` pinned, or for "any" every kind at
    every chunk count up to ``max_chunks`` (one rank has nothing to interleave: looped only)."""
    if max_chunks < 1:
        raise SearchError(f"max_chunks must be >= 1, got {max_chunks}", "max_chunks")
    if placement != "any":
        if placement not in PINNED:
            raise SearchError(f"placement: unknown {placement!r}; choose from any, "
                              f"{', '.join(PLACEMENTS)}", "placement")
        kind, chunks = PINNED[placement]
        if chunks > max_chunks:
            raise SearchError(f"placement {placement!r} puts {chunks} stages on each rank, more "
                              f"than max_chunks={max_chunks} (the model's layers / pp)",
                              "max_chunks")
        return [PINNED[placement]]
    if pp == 1:
        return [("looped", 1)]
    top = min(max_chunks, MAX_CHUNKS)
    return ([("looped", 1)] + [("interleaved", v) for v in range(2, top + 1)]
            + [("v", 2)] * (top >= 2) + [("wave", v) for v in range(3, top + 1)])


def placement_of(name: str, pp: int, chunks: int = 0) -> tuple[int, ...]:
    """The stage -> rank tuple of a placement kind with ``chunks`` stages per rank (0: the kind's
    classic count: looped 1, interleaved 2, v 2, wave 4)."""
    chunks = chunks or {"looped": 1, "interleaved": 2, "v": 2, "wave": 4}.get(name, 0)
    if name in ("looped", "interleaved"):
        return looped_placement(pp, chunks)
    if name in ("v", "wave"):
        return v_placement(pp, chunks)
    raise SearchError(f"placement: unknown {name!r}; choose from any, {', '.join(PLACEMENTS)}",
                      "placement")


def place_of(layout: tuple[int, ...]) -> Place | None:
    """The ``Place`` of a stage -> rank tuple, or None when it is none of the search's kinds."""
    pp = max(layout) + 1
    chunks, extra = divmod(len(layout), pp)
    if extra:
        return None
    if layout == looped_placement(pp, chunks):
        return ("looped", 1) if chunks == 1 else ("interleaved", chunks)
    if chunks >= 2 and layout == v_placement(pp, chunks):
        return ("v", 2) if chunks == 2 else ("wave", chunks)
    return None


def placement_costs(costs: StageCosts, placement: tuple[int, ...]) -> StageCosts:
    """``costs`` of full stages, per global stage of ``placement`` (a chunk gets 1/v of them:
    ``loom.schedule.cost.full_stage_costs``, the CLI's one meaning of ``--costs``)."""
    pp = max(placement) + 1
    if len(costs.stages) not in (1, pp):
        raise SearchError(
            f"costs: give one F,I,W for every stage or one per rank ({pp}), got {len(costs.stages)}",
            "costs")
    if costs.activation is not None:
        raise SearchError("costs: per-stage activation weights are not supported by the search; "
                          "it uses the validator's units (a chunk of v weighs 1/v)", "costs")
    return full_stage_costs(costs, Schedule(len(placement), 1, placement, [[]] * pp))


__all__ = ["MAX_CHUNKS", "PINNED", "PLACEMENTS", "SearchError", "place_of", "placement_costs",
           "placement_of", "places"]
