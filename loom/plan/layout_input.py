"""The checks a ``loom plan --layout`` what-if passes before it is priced.

``--layout`` prices one layout whether or not Loom's trainer would run it (a framework's layout,
a combination the config rules refuse for want of a parity test), so the trainer's rules are not
applied here. What is refused is a layout the cost model cannot give a meaning to: a degree below
one, an unknown mode, a schedule that cannot be built for its pipeline, batch sizes below one.
Each refusal is a ``LayoutInputError`` naming the ``--layout`` field, its value and the rule (the
CLI prints it on one line and exits 2), raised before anything is priced.

Why its own module: the rules are the union of the cost model's preconditions, which live in
several modules (``loom.layout``, ``loom.schedule.select``, ``loom.sim``); gathered here they
are one list a hostile-input test can hold the CLI to.
"""

from __future__ import annotations

import math

from loom.layout import MODES, CPLayout, Layout, check_layout
from loom.models.args import TransformerArgs
from loom.schedule.families import SEARCH_PLACEMENTS, simulation_only, trainable
from loom.schedule.paths import SKIPPIPE
from loom.schedule.select import SEARCH, ChunksError, schedule_of

RECOMPUTE = ("none", "selective", "full", "every_k")
PLACEMENTS = ("auto", *SEARCH_PLACEMENTS)


class LayoutInputError(ValueError):
    """A ``--layout`` field breaks a rule; ``str()`` names the field, its value and the rule."""


def _refuse(field: str, value: object, rule: str) -> LayoutInputError:
    return LayoutInputError(f"--layout {field}={value}: {rule}")


def check_layout_input(layout: Layout, model: TransformerArgs, seq_len: int) -> None:
    """Raise ``LayoutInputError`` when ``layout`` cannot be priced for ``model`` at ``seq_len``
    tokens per sequence (module docstring); return None otherwise."""
    for axis in ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp"):
        if getattr(layout, axis) < 1:
            raise _refuse(axis, getattr(layout, axis), "must be >= 1")
    for field in ("micro_batch", "microbatches", "recompute_every"):
        if getattr(layout, field) < 1:
            raise _refuse(field, getattr(layout, field), "must be >= 1")
    for field in ("chunks", "cp_ulysses", "schedule_memory_limit", "schedule_offload_limit"):
        value = getattr(layout, field)
        if not (0 <= value < math.inf):  # also NaN, which every comparison lets through
            raise _refuse(field, value, "must be a finite number >= 0")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise _refuse("zero_stage", layout.zero_stage, "must be 0, 1, 2 or 3")
    if layout.recompute not in RECOMPUTE:
        raise _refuse("recompute", layout.recompute, f"must be one of {', '.join(RECOMPUTE)}")
    if layout.schedule_placement not in PLACEMENTS:
        raise _refuse("schedule_placement", layout.schedule_placement,
                      f"must be one of {', '.join(PLACEMENTS)}")
    if layout.ep > 1 and not model.n_experts:
        raise _refuse("ep", layout.ep, "expert parallelism needs an MoE model (this one has no"
                      " experts)")
    if layout.ep > 1 and model.n_experts % layout.ep:
        raise _refuse("ep", layout.ep, f"must divide the model's {model.n_experts} experts")
    if layout.cp_mode not in MODES:
        raise _refuse("cp_mode", layout.cp_mode, f"must be one of {', '.join(MODES)}")
    if layout.cp > 1:
        try:
            cp = CPLayout.from_mode(layout.cp_mode, layout.cp, layout.cp_ulysses)
            check_layout(cp, seq_len, max(1, model.n_heads // layout.tp),
                         max(1, model.n_kv_heads // layout.tp))
        except ValueError as err:
            raise _refuse("cp", layout.cp, f"{err} (cp_mode={layout.cp_mode})") from None
    _check_schedule(layout, model)


def _check_schedule(layout: Layout, model: TransformerArgs) -> None:
    """A pipeline's schedule: a known family (or the search, or SkipPipe's paths) that builds
    for pp, microbatches and chunks, with as many stages per rank as ``chunks`` says (the cost
    model splits the layers by it) and at most one stage per layer."""
    if layout.pp == 1:
        if layout.chunks != 1:
            raise _refuse("chunks", layout.chunks, "must be 1 without a pipeline (pp = 1)")
        return
    known = [*trainable(), *simulation_only(), SEARCH, SKIPPIPE]
    name = layout.schedule.lower().replace("-", "_")
    if name not in known:
        raise _refuse("schedule", layout.schedule, f"pp = {layout.pp} needs a schedule: one of"
                      f" {', '.join(known)}")
    if name == SKIPPIPE:  # paths over one stage per rank, priced as GPipe
        if layout.chunks != 1:
            raise _refuse("chunks", layout.chunks, "skippipe runs one stage per rank; use"
                          " chunks = 1")
        return
    if name == SEARCH:  # what the planner prices: the search over one placement
        pinned = {1: "looped", 2: "v"}
        if layout.chunks not in pinned:
            raise _refuse("chunks", layout.chunks, "a searched schedule is priced with one stage"
                          " per rank (chunks = 1: the looped placement) or two (chunks = 2: the"
                          " V placement)")
        if layout.schedule_placement != pinned[layout.chunks]:
            raise _refuse("schedule_placement", layout.schedule_placement,
                          f"chunks = {layout.chunks} prices the {pinned[layout.chunks]}"
                          " placement; leave it auto")
        if 0 < layout.schedule_memory_limit < 1:
            raise _refuse("schedule_memory_limit", layout.schedule_memory_limit, "must be 0 (the"
                          " planner's choice) or >= 1 unit (one microbatch's activations)")
        if layout.chunks == 2 and 2 * layout.pp > model.n_layers:
            raise _refuse("chunks", layout.chunks, f"the V placement's {2 * layout.pp} stages"
                          f" need as many layers; the model has {model.n_layers}")
        return
    try:
        schedule = schedule_of(layout, max_stages=model.n_layers)
    except ChunksError as err:
        raise _refuse("chunks", layout.chunks, str(err)) from None
    except (KeyError, ValueError) as err:
        raise _refuse("schedule", layout.schedule, str(err).strip('"')) from None
    if schedule.chunks_per_rank != layout.chunks:
        raise _refuse("chunks", layout.chunks, f"schedule {layout.schedule!r} places"
                      f" {schedule.chunks_per_rank} stage(s) per rank; use chunks ="
                      f" {schedule.chunks_per_rank}")
    stages = layout.pp * layout.chunks
    if stages > model.n_layers:
        raise _refuse("chunks", layout.chunks, f"pp x chunks = {stages} stages need as many"
                      f" layers; the model has {model.n_layers}")


__all__ = ["LayoutInputError", "check_layout_input"]
