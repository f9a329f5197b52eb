"""Which schedule a run uses: ``schedule_for(parallel.schedule, pp, m, ...)``.

A family's generator (``loom.schedule.families``), or, for ``parallel.schedule = "search"``,
the schedule search's pick (``loom.schedule.search``) under the given memory limit and costs;
validated and cached, so config checks, the estimator, every rank of the trainer and the planner
get the same object. Here, above both, so that the family registry and the search (which seeds
itself with the families) do not import each other. Torch-free, like the rest of the package.
"""

from __future__ import annotations

import functools
import inspect
import math

from loom.layout import Layout
from loom.schedule.cost import MAX_COST, OpCosts, StageCosts
from loom.schedule.families import SEARCH_PLACEMENTS, get
from loom.schedule.ir import Schedule
from loom.schedule.offload import insert_offload
from loom.schedule.paths import SKIPPIPE
from loom.schedule.search import MAX_CHUNKS, search
from loom.schedule.validate import validate


class ChunksError(ValueError):
    """``chunks`` given for a family whose number of stages per rank is fixed."""


SEARCH = "search"  # ``parallel.schedule = "search"``: the schedule search picks the schedule


def parse_search_costs(text: str, pp: int = 0
                       ) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """``parallel.schedule_costs``: ``"F,I,W,latency"``, one full stage's relative costs for every
    rank, or ``"F,I,W;F,I,W;...;F,I,W,latency"``, one rank's full share each (the ends also
    carry the embedding and the head); returns the (F, I, W) per group and the latency. ``pp``
    (0: unchecked) is the number of ranks a per-rank list must name."""
    groups = [group.split(",") for group in text.split(";")]
    rule = (f"{text!r} must be F,I,W,latency (or one F,I,W per rank separated by ';', the last"
            f" followed by ,latency) with F, I, W > 0 and latency >= 0, each at most"
            f" {MAX_COST:.0e}, e.g. 1,1,1,0")
    try:
        numbers = [[float(v) for v in group] for group in groups]
    except ValueError:
        raise ValueError(rule) from None
    # NaN passes every comparison below, and a latency of 1e300 made the search's makespans
    # infinite (an OverflowError in its ranking): the bound of ``loom schedule --costs``
    if not all(math.isfinite(v) and v <= MAX_COST for group in numbers for v in group):
        raise ValueError(rule)
    if len(numbers[-1]) != 4 or any(len(group) != 3 for group in numbers[:-1]):
        raise ValueError(rule)
    latency = numbers[-1].pop()
    if latency < 0 or any(min(group) <= 0 for group in numbers):
        raise ValueError(rule)
    if pp and len(numbers) not in (1, pp):
        raise ValueError(f"{text!r} names {len(numbers)} ranks' costs: give one F,I,W for every"
                         f" rank or one per rank ({pp})")
    return tuple((f, i, w) for f, i, w in numbers), latency


@functools.lru_cache(maxsize=16)
def _searched(pp: int, microbatches: int, memory_limit: float,
              costs: tuple[tuple[tuple[float, float, float], ...], float],
              placement: str, max_chunks: int, offload: bool = False) -> Schedule:
    """Deterministic (an effort limit, no wall-clock budget): every rank finds the same one.
    ``offload``: the search may place PipeOffload's transfers to fit ``memory_limit``; the
    config's costs name no host link, so they are priced as free (the copies fully overlapped:
    what offloading the search's pick afterwards, as the trainer did before, assumed too)."""
    stages, latency = costs
    schedule = search(pp, microbatches,
                      StageCosts(tuple(OpCosts(f, i, w) for f, i, w in stages), latency=latency),
                      memory_limit, placement, max_chunks=max_chunks, offload=offload).schedule
    validate(schedule, memory_limit=memory_limit if offload else None)
    return schedule


def schedule_for(name: str, pp: int, microbatches: int, chunks: int = 0, *,
                 memory_limit: float = 0.0, costs: str = "1,1,1,0",
                 max_stages: int = 0, placement: str = "auto",
                 offload_limit: float = 0.0) -> Schedule:
    """The validated schedule of family ``name`` (``parallel.schedule``) for ``pp`` ranks and
    ``microbatches``; ``chunks`` stages per rank, 0 for the family's default. Raises ValueError
    with the family's rule when the sizes are invalid, ``ChunksError`` for a fixed-chunk family
    given another count. (Here rather than in the runtime so that config validation and the
    planner do not import ``torch.distributed.pipelining``.)

    ``name = "search"``: the schedule search's best schedule, placement included, for relative
    ``costs`` ("F,I,W,latency", or one F,I,W per rank: ``parse_search_costs``) under
    ``memory_limit`` units of one stage's activations (0: ``pp``, what 1F1B needs);
    ``parallel.schedule_memory_limit`` and ``parallel.schedule_costs``. ``placement``
    (``parallel.schedule_placement``) pins the search to one placement (looped, interleaved or
    v); "auto" lets it choose among all of them with up to ``MAX_CHUNKS`` stages per rank, as
    many as ``max_stages`` (the model's layers; 0: no bound) allows: layers // pp, so below 2 pp
    one stage per rank.

    ``offload_limit`` (``parallel.schedule_offload_limit``, 0: off): PipeOffload's device limit
    in the same units. A family's schedule gets ``insert_offload``'s transfers under it; the
    search places them itself (``search(..., offload=True)``) under the lower of the two limits,
    so a schedule over the limit competes with its transfers against those that fit without."""
    if offload_limit and name.lower() != SEARCH:
        return _offloaded(_generated(name, pp, microbatches, chunks), offload_limit)
    if name.lower() == SEARCH:
        if chunks:
            raise ChunksError("the search chooses the placement and its stages per rank; use"
                              " chunks = 0")
        if placement == "auto":
            placement = "looped" if 0 < max_stages < 2 * pp else "any"
        elif placement not in SEARCH_PLACEMENTS:
            raise ValueError(f"placement {placement!r}: choose from auto, "
                             f"{', '.join(SEARCH_PLACEMENTS)}")
        elif placement != "looped" and 0 < max_stages < 2 * pp:
            raise ValueError(f"placement {placement!r} puts two stages on each rank: it needs"
                             f" 2 x pp = {2 * pp} layers, the model has {max_stages}")
        max_chunks = min(MAX_CHUNKS, max_stages // pp) if max_stages else MAX_CHUNKS
        limit = float(memory_limit or pp)
        return _searched(pp, microbatches, min(limit, offload_limit) if offload_limit else limit,
                         parse_search_costs(costs, pp), placement, max(max_chunks, 1),
                         bool(offload_limit))
    return _generated(name, pp, microbatches, chunks)


def schedule_of(layout: Layout, max_stages: int = 0) -> Schedule:
    """The schedule ``layout``'s pipeline runs: the trainer's, the memory estimator's and the
    planner's simulation, from one place. ``max_stages``: the model's layers (0: no bound),
    which keep an "auto" search to one stage per rank below 2 pp. At pp = 1 it is plain
    gradient accumulation, one stage running each microbatch's forward then its backward (the
    configured schedule does not apply: its splits and chunks would only add stages or hold
    more activations on the one rank)."""
    if layout.pp == 1:
        return _generated("1f1b", 1, layout.microbatches, 0)
    if layout.schedule_offload_limit:  # PipeOffload: the family's schedule with host copies,
        # or the search's pick with the copies it placed
        return schedule_for(layout.schedule, layout.pp, layout.microbatches,
                            0 if layout.searched else layout.chunks,
                            memory_limit=layout.schedule_memory_limit,
                            costs=layout.schedule_costs or "1,1,1,0", max_stages=max_stages,
                            placement=layout.schedule_placement,
                            offload_limit=layout.schedule_offload_limit)
    if layout.schedule == SKIPPIPE:
        # Paths, not a per-rank action list (loom.schedule.paths): the estimator and the
        # planner price it as GPipe over one replica's share of the microbatches, an
        # approximation (a replica may be visited by more or fewer of them); the trainer runs
        # the paths (loom.pipeline.paths_runtime).
        return _generated("gpipe", layout.pp, layout.microbatches, 0)
    return schedule_for(layout.schedule, layout.pp, layout.microbatches,
                        0 if layout.searched else layout.chunks,
                        memory_limit=layout.schedule_memory_limit,
                        costs=layout.schedule_costs or "1,1,1,0", max_stages=max_stages,
                        placement=layout.schedule_placement)


@functools.lru_cache(maxsize=64)
def _offloaded(schedule: Schedule, limit: float) -> Schedule:
    """``schedule`` with PipeOffload's offloads and reloads under ``limit`` units per rank
    (``parallel.schedule_offload_limit``), validated against that limit; cached like the rest."""
    offloaded = insert_offload(schedule, limit)
    validate(offloaded, memory_limit=limit)
    return offloaded


@functools.lru_cache(maxsize=256)
def _generated(name: str, pp: int, microbatches: int, chunks: int) -> Schedule:
    """A family's validated schedule, cached: config checks, the estimator, the trainer and the
    planner's runnability check of many layouts ask for the same few (a V-Min at pp 32 with
    hundreds of microbatches takes a tenth of a second to generate and validate)."""
    generator = get(name)
    if chunks and "chunks" not in inspect.signature(generator).parameters:
        schedule = generator(pp, microbatches)
        if schedule.chunks_per_rank != chunks:
            raise ChunksError(f"schedule {name!r} places a fixed {schedule.chunks_per_rank} "
                              f"stage(s) per rank; use chunks = 0 or {schedule.chunks_per_rank}")
    else:
        schedule = generator(pp, microbatches, chunks=chunks) if chunks else generator(pp, microbatches)
    validate(schedule)
    return schedule


__all__ = ["schedule_for", "schedule_of", "SEARCH", "parse_search_costs", "ChunksError"]
