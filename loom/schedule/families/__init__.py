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
  sums their gradients over the mirror ranks (see ``loom.pipeline.runtime``), with tp and every
  ZeRO stage (docs/design.md, "BitPipe in full").

* ``bitpipe`` (routed): the same placement with BitPipe's own order (its warm-up, steady and
  cool-down phases, full backwards), written by construction; even p, m a multiple of p.

* ``hanayo``: Hanayo's wave (Liu et al. SC'23), ``chunks / 2`` down-and-up waves (an even
  count; ``chunks=2`` is the V placement) with full backwards (see the module).
"""

from __future__ import annotations

from collections.abc import Callable

from loom.schedule.ir import Schedule
from loom.schedule.families.bidirectional import bidirectional_v
from loom.schedule.families.bitpipe import bitpipe
from loom.schedule.families.controllable_memory import v_half, v_min
from loom.schedule.families.dualpipev import dualpipev
from loom.schedule.families.gpipe import gpipe
from loom.schedule.families.hanayo import hanayo
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
    "hanayo": hanayo,
}

# Families over two copies of the model (per-microbatch routes): trainable; their CSV export
# ends with a routes row (Loom's extension of torch's format, ``Schedule.to_torch_csv``).
_ROUTED: dict[str, Generator] = {
    "bidirectional_v": bidirectional_v,
    "bitpipe": bitpipe,
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


# ``parallel.schedule_placement`` values besides "auto" (``loom.schedule.search.PLACEMENTS``)
SEARCH_PLACEMENTS = ("looped", "interleaved", "v")


__all__ = ["Generator", "get", "names", "routed", "trainable", "simulation_only",
           "SEARCH_PLACEMENTS"]
