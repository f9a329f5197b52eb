"""Schedule generators, one module per family, and a registry by name.

Every generator is a pure function ``(pp_size, microbatches, ...) -> Schedule``; its docstring
cites the paper and states the valid microbatch counts. ``get(name)`` returns the generator,
``names()`` lists them.

Not provided, and why:

* Hanayo (Liu et al. SC'23): its wave placement exists (``v_placement(p, 2 * waves)``), but I
  found no closed form for its warm-up per wave and rank, and deriving it with Loom's greedy
  scheduler (full backwards, 1F1B's budget of p units) gave bubbles about 3x those of 1F1B,
  the opposite of the paper's claim; so nothing is registered under Hanayo's name yet.
* BitPipe (Wu et al. 2024) and the bidirectional DualPipe (DeepSeek-V3 report) send half the
  microbatches through a second, mirrored copy of the model, so a microbatch visits only one of
  two stage sets and the weights exist twice. Loom's IR has one stage set that every microbatch
  visits; expressing them needs a per-microbatch route (or replica) field that the runtime,
  lowering and simulator would have to agree on first. DualPipeV, the V-shaped single-copy
  variant, is provided.
"""

from __future__ import annotations

from collections.abc import Callable

from loom.pipeline.ir import Schedule
from loom.pipeline.schedules.controllable_memory import v_half, v_min
from loom.pipeline.schedules.dualpipev import dualpipev
from loom.pipeline.schedules.gpipe import gpipe
from loom.pipeline.schedules.interleaved import interleaved_1f1b
from loom.pipeline.schedules.looped_bfs import looped_bfs
from loom.pipeline.schedules.one_f_one_b import one_f_one_b
from loom.pipeline.schedules.zbv import zbv
from loom.pipeline.schedules.zero_bubble import zb_h1, zb_h2

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


def names() -> list[str]:
    """Registered schedule families, in registration order."""
    return list(_REGISTRY)


def get(name: str) -> Generator:
    """The generator registered as ``name`` (case-insensitive; '-' and '_' are equivalent)."""
    key = name.lower().replace("-", "_")
    if key not in _REGISTRY:
        raise KeyError(f"unknown pipeline schedule {name!r}; known: {', '.join(names())}")
    return _REGISTRY[key]


__all__ = ["Generator", "get", "names"]
