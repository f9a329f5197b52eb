"""Schedule generators, one module per family, and a registry by name.

Every generator is a pure function ``(pp_size, microbatches, ...) -> Schedule``; its docstring
cites the paper and states the valid microbatch counts. ``get(name)`` returns the generator.
Three lists: ``names()``, the one-copy families (every microbatch visits every stage), which the
runtime trains, torch's CSV carries, and the schedule search compares against; ``routed()``, the
families over several copies of the model (``Schedule.routes``), which the runtime trains too but
which travel as JSON only and stay outside the search; ``trainable()`` is both. ``simulation_only()``
lists families the runtime cannot train (none at the moment; they would validate, simulate and
export, and the config would refuse them for training by name).

* ``bidirectional_v`` (routed): BitPipe's shape, two V pipelines in opposite directions over two
  copies of the model. Trainable for an even pp and m >= 2: the runtime holds both copies and
  sums their gradients over the mirror ranks (see ``loom.pipeline.runtime``); the config refuses
  ZeRO-1/2, which it does not compose with yet, by name.

Not provided, and why:

* Hanayo (Liu et al. SC'23): its wave placement exists (``v_placement(p, 2 * waves)``) and
  needs no routes (one copy, every microbatch visits every stage; the runtime's same-rank
  hand-over already covers its turns). What is missing is the order: I found no closed form for
  its warm-up per wave and rank, and Loom's greedy scheduler (full backwards, 1F1B's budget of p
  units) gives about twice 1F1B's bubble (docs/design.md), the opposite of the paper's claim; so
  nothing is registered under Hanayo's name.
"""

from __future__ import annotations

import functools

from collections.abc import Callable

from loom.schedule.ir import Schedule
from loom.schedule.families.bidirectional import bidirectional_v
from loom.schedule.families.controllable_memory import v_half, v_min
from loom.schedule.families.dualpipev import dualpipev
from loom.schedule.families.gpipe import gpipe
from loom.schedule.families.interleaved import interleaved_1f1b
from loom.schedule.families.looped_bfs import looped_bfs
from loom.schedule.families.one_f_one_b import one_f_one_b
from loom.schedule.families.zbv import zbv
from loom.schedule.families.zero_bubble import zb_h1, zb_h2

Generator = Callable[..., Schedule]

_REGISTRY: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "looped_bfs": looped_bfs,
    "zb_h1": zb_h1,
    "zb_h2": zb_h2,
    "zbv": zbv,
    "v_half": v_half,
    "v_min": v_min,
    "dualpipev": dualpipev,
}

# Families over two copies of the model (per-microbatch routes): trainable, JSON export only.
_ROUTED: dict[str, Generator] = {
    "bidirectional_v": bidirectional_v,
}


# Families the runtime cannot train: validated, simulated, exported, and refused by the config
# for training, by name. None at the moment (kept for families added ahead of their runtime).
_SIMULATION_ONLY: dict[str, Generator] = {}


def names() -> list[str]:
    """One-copy schedule families (the runtime trains them), in registration order."""
    return list(_REGISTRY)


def routed() -> list[str]:
    """Families over several copies of the model, which the runtime trains as well."""
    return list(_ROUTED)


def trainable() -> list[str]:
    """Every family ``parallel.schedule`` accepts: ``names()`` then ``routed()``."""
    return names() + routed()


def simulation_only() -> list[str]:
    """Schedule families that validate and simulate but that the runtime cannot train."""
    return list(_SIMULATION_ONLY)


def get(name: str) -> Generator:
    """The generator registered as ``name`` (case-insensitive; '-' and '_' are equivalent)."""
    key = name.lower().replace("-", "_")
    generator = _REGISTRY.get(key) or _ROUTED.get(key) or _SIMULATION_ONLY.get(key)
    if generator is None:
        known = ", ".join(trainable() + [f"{n} (simulation only)" for n in simulation_only()])
        raise KeyError(f"unknown pipeline schedule {name!r}; known: {known}")
    return generator


class ChunksError(ValueError):
    """``chunks`` given for a family whose number of stages per rank is fixed."""


SEARCH = "search"  # ``parallel.schedule = "search"``: the schedule search picks the schedule
# ``parallel.schedule_placement`` values besides "auto" (``loom.schedule.search.PLACEMENTS``)
SEARCH_PLACEMENTS = ("looped", "interleaved", "v")


def parse_search_costs(text: str, pp: int = 0
                       ) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """``parallel.schedule_costs``: ``"F,I,W,latency"``, one full stage's relative costs for every
    rank, or ``"F,I,W;F,I,W;...;F,I,W,latency"``, one rank's full share each (the ends also
    carry the embedding and the head); returns the (F, I, W) per group and the latency. ``pp``
    (0: unchecked) is the number of ranks a per-rank list must name."""
    groups = [group.split(",") for group in text.split(";")]
    rule = (f"{text!r} must be F,I,W,latency (or one F,I,W per rank separated by ';', the last"
            f" followed by ,latency) with F, I, W > 0 and latency >= 0, e.g. 1,1,1,0")
    try:
        numbers = [[float(v) for v in group] for group in groups]
    except ValueError:
        raise ValueError(rule) from None
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
              placement: str) -> Schedule:
    """Deterministic (an effort limit, no wall-clock budget): every rank finds the same one."""
    from loom.schedule.search import search
    from loom.schedule.validate import validate
    from loom.schedule.cost import OpCosts, StageCosts

    stages, latency = costs
    schedule = search(pp, microbatches,
                      StageCosts(tuple(OpCosts(f, i, w) for f, i, w in stages), latency=latency),
                      memory_limit, placement).schedule
    validate(schedule)
    return schedule


def schedule_for(name: str, pp: int, microbatches: int, chunks: int = 0, *,
                 memory_limit: float = 0.0, costs: str = "1,1,1,0",
                 max_stages: int = 0, placement: str = "auto") -> Schedule:
    """The validated schedule of family ``name`` (``parallel.schedule``) for ``pp`` ranks and
    ``microbatches``; ``chunks`` stages per rank, 0 for the family's default. Raises ValueError
    with the family's rule when the sizes are invalid, ``ChunksError`` for a fixed-chunk family
    given another count. (Here rather than in the runtime so that config validation and the
    planner do not import ``torch.distributed.pipelining``.)

    ``name = "search"``: the schedule search's best schedule, placement included, for relative
    ``costs`` ("F,I,W,latency", or one F,I,W per rank: ``parse_search_costs``) under
    ``memory_limit`` units of one stage's activations (0: ``pp``, what 1F1B needs);
    ``parallel.schedule_memory_limit`` and ``parallel.schedule_costs``. ``placement`` (``parallel.schedule_placement``) pins the
    search to one placement (looped, interleaved or v); "auto" lets it choose, except that
    ``max_stages`` (the model's layers; 0: no bound) below 2 pp keeps it to one stage per rank."""
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
        return _searched(pp, microbatches, float(memory_limit or pp),
                         parse_search_costs(costs, pp), placement)
    return _generated(name, pp, microbatches, chunks)


@functools.lru_cache(maxsize=256)
def _generated(name: str, pp: int, microbatches: int, chunks: int) -> Schedule:
    """A family's validated schedule, cached: config checks, the estimator, the trainer and the
    planner's runnability check of many layouts ask for the same few (a V-Min at pp 32 with
    hundreds of microbatches takes a tenth of a second to generate and validate)."""
    import inspect

    from loom.schedule.validate import validate

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


__all__ = ["Generator", "get", "names", "routed", "trainable", "simulation_only", "schedule_for",
           "SEARCH", "SEARCH_PLACEMENTS", "parse_search_costs",
           "ChunksError"]
