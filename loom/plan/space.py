"""The planner's search space: every layout of a model on a cluster that Loom's rules allow.

A layout is a factorisation of the world into Loom's axes (pp, dp_replicate, dp_shard, ep, cp,
tp), the ZeRO stage on dp_shard, the context-parallel mode, the microbatch size (the count
follows from the global batch), the pipeline schedule family and its chunks, and the
recomputation policy. ``layouts`` yields them all, pruned only by shape rules (what divides what)
and by one dominance rule: sequence parallelism is always on under tp > 1. It moves the same
bytes as plain TP (all-gather + reduce-scatter = all-reduce) and holds less activation memory, so
a layout without it is never better (Korthikanti et al. 2022 §4.2).

``vocab_pp_fits`` says whether a pipeline layout's axes allow its twin with the embedding and
head split over every pipeline rank (``Layout.vocab_parallel_pp``); the space itself does not
yield the twins, whose memory is priced on the runtime's schedule (seconds each on a deep
pipeline): the search adds the twins of its best pipeline layouts.

The pipeline schedule is one of Loom's families or the schedule search's own output under the
activation memory the budget leaves (``schedule = "search"``; ``loom.plan.search`` sets the
limit, since the space knows shapes, not bytes).

ZeRO-1, 2 and 3 are all searched on a dp_shard axis. ZeRO-1 and ZeRO-2 move the same bytes, and
which holds less at its peak depends on Loom's buckets and on accumulation (the memory instants
of ``loom.train.memory`` price both), so neither dominates.

Which of these Loom can run today (some combinations are still refused by
``loom.config_rules``) is decided by the search, which asks the config rules themselves.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, overload

from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.layout import CPLayout, check_layout

# Families the planner considers, with the chunks per rank they are searched at. GPipe and the
# looped breadth-first schedule are left out: they take 1F1B's time with m microbatches in flight
# instead of p (or pp x chunks of interleaving), i.e. they are dominated.
SCHEDULES: dict[str, tuple[int, ...]] = {
    "1f1b": (1,),
    "interleaved_1f1b": (2, 3, 4),
    "zb_h1": (1,),
    "zb_h2": (1,),
    "zbv": (2,),
    "v_half": (2,),
    "v_min": (2,),
    # Loom's schedule search under the memory left (``parallel.schedule = "search"``), on the
    # looped placement (1) and the V (2); the planner sets its limit from the memory budget
    "search": (1, 2),
}
# The search runs on every rank when training starts and in the planner's simulation: kept to
# pipelines of at most this many p·m actions per pass (p = 8, m = 32: about a second here)
SEARCH_MAX_WORK = 256
RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Workload:
    """What is trained: a model shape, a sequence length and the global batch per step."""

    name: str
    model: TransformerArgs
    seq_len: int
    global_batch: int  # sequences per optimizer step
    config_path: str | None = None  # a Loom TOML whose model (and other sections) to plan for
    fp8: str = "none"  # ``train.fp8``'s recipe (the blocks' linears in FP8)
    # ``train.fp8_all_gather``: ZeRO-3 gathers the FP8 linears' weights in float8 (tensorwise)
    fp8_all_gather: bool = False
    # ``train.compile``: the blocks compiled (``Framework.compiled``); None: the config's own
    compile: bool | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def tp_fits(m: TransformerArgs, tp: int, seq: int, cp: int) -> bool:
    """Whether tp divides the heads, the KV heads, the vocabulary and a cp rank's sequence
    (sequence parallelism's split)."""
    return (m.n_heads % tp == 0 and m.n_kv_heads % tp == 0 and m.vocab_size % tp == 0
            and (seq // cp) % tp == 0)


def vocab_pp_fits(m: TransformerArgs, lay: Layout) -> bool:
    """Whether the trainer's rules on the axes allow ``lay`` with the embedding and head split
    over its pipeline (``loom.config_rules.pipeline``'s vocab_parallel_pp rules): pp > 1, the
    vocabulary divisible by pp x tp, no ep (the shards are built for dense models), a dense
    model and one route through the pipeline (Loom's families here). cp is allowed: each cp
    coordinate's pipeline runs its own tokens' passes (b·S/cp of them, ``cost_memory``) and the
    rows are reduced over dp x cp (``vocab_cost.rows_data_parallel``). ZeRO on
    dp_shard included (``vocab_pipeline.data_parallel_rows``): the memory prices ZeRO-3's rows
    gathered across the step with their unsharded gradients (``StageSpan.gathered``; the
    allocator's peak of pp2 x dp_shard2 at ZeRO-1 and ZeRO-3 within the estimator's usual
    accuracy, bench/zero_memory.py), the step time the rows' reduction after the schedule
    (``vocab_cost.rows_data_parallel``)."""
    return (lay.pp > 1 and m.vocab_size % (lay.pp * lay.tp) == 0 and lay.ep == 1
            and m.n_experts == 0)


def ring_shapes(m: TransformerArgs, seq: int, per_node: int, gpus: int
                ) -> Iterator[tuple[int, int]]:
    """The (tp, ring cp) pairs a group of ``gpus`` ranks takes: tp within a node of
    ``per_node``, tp x cp dividing the group, ring cp splitting the sequence, and the shape
    rules of ``tp_fits`` and ``cp_modes`` (the inside of ``loom plan --mixed``'s stages and
    replicas)."""
    for tp, cp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if tp <= per_node and gpus % (tp * cp) == 0 and seq % cp == 0 \
                and tp_fits(m, tp, seq, cp) and "ring" in cp_modes(m, tp, cp, seq):
            yield tp, cp


def cp_modes(m: TransformerArgs, tp: int, cp: int, seq: int) -> list[str]:
    """Context-parallel modes whose shape rules hold (``loom.parallel.context.check_layout``)."""
    if cp == 1:
        return ["ring"]

    modes = []
    for mode in ("ring", "ulysses", "hybrid"):
        try:
            layout = CPLayout.from_mode(mode, cp)
            if mode == "hybrid" and layout.ulysses in (1, cp):
                continue  # the same as ring or ulysses
            check_layout(layout, seq, m.n_heads // tp, m.n_kv_heads // tp)
        except ValueError:
            continue
        modes.append(mode)
    return modes


def _layout(fields: Mapping[str, Any]) -> Layout:
    """``Layout(**fields)`` given every field: the same object (its fields, then its
    ``__post_init__``) at a quarter of the price. The frozen dataclass's ``__init__`` sets 24
    fields one ``object.__setattr__`` at a time, and the space builds tens of thousands."""
    layout = object.__new__(Layout)
    layout.__dict__.update(fields)
    layout.__post_init__()
    return layout


# every field of a Layout at its default (``_layout``'s starting point)
_DEFAULTS: Mapping[str, Any] = MappingProxyType(vars(Layout()))


class LayoutGroup(Sequence[Layout]):
    """Layouts that differ only in the recomputation policy, cheapest first. Only the first is
    built up front: the planner drops most groups on it alone (their model state does not fit),
    and building the hundreds of thousands of others was a third of a large plan's time."""

    def __init__(self, first: Layout, recompute: tuple[str, ...]) -> None:
        self.first = first
        self._recompute = recompute
        self._built: list[Layout] = [first]

    def __len__(self) -> int:
        return len(self._recompute)

    @overload
    def __getitem__(self, index: int) -> Layout: ...

    @overload
    def __getitem__(self, index: slice) -> list[Layout]: ...

    def __getitem__(self, index: int | slice) -> Layout | list[Layout]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        while len(self._built) <= index:
            # the first's fields with another policy (dataclasses.replace takes twice as long)
            fields = {**vars(self.first), "recompute": self._recompute[len(self._built)]}
            self._built.append(_layout(fields))
        return self._built[index]

    def __iter__(self) -> Iterator[Layout]:
        for index in range(len(self._recompute)):
            yield self[index]


def layouts(work: Workload, world: int, gpus_per_node: int, *,
            max_cp: int = 16, schedules: dict[str, tuple[int, ...]] | None = None,
            micro_batches: tuple[int, ...] = MICRO_BATCHES,
            recompute: tuple[str, ...] = RECOMPUTE,
            drop: Callable[[Layout], bool] | None = None,
            skipped: Callable[[int], None] = lambda count: None) -> Iterator[LayoutGroup]:
    """Every layout of ``work`` on ``world`` accelerators (see the module docstring), in groups
    that differ only in the recomputation policy, cheapest first: a search may stop at the first
    of a group that fits in memory, since recomputing more never makes a step faster.
    ``drop``: a test that must not look at the context-parallel mode or the recomputation, nor
    at the microbatches beyond whether there is more than one (the planner's: the model state
    does not fit); asked once for the groups that differ only in those, which are then not
    built (``skipped`` is told how many layouts)."""
    m, seq, batch = work.model, work.seq_len, work.global_batch
    families = SCHEDULES if schedules is None else schedules
    experts = m.n_experts
    for tp in divisors(world):
        if tp > gpus_per_node or m.n_heads % tp or m.n_kv_heads % tp or m.vocab_size % tp:
            continue  # tensor parallelism stays inside a node (its traffic is per layer)
        for cp in divisors(world // tp):
            if cp > max_cp or seq % cp or not tp_fits(m, tp, seq, cp):
                continue
            modes = cp_modes(m, tp, cp, seq)
            for ep in divisors(world // (tp * cp)) if experts else [1]:
                if experts and experts % ep:
                    continue
                rest = world // (tp * cp * ep)
                for pp in divisors(rest):
                    if pp > m.n_layers:
                        continue
                    dp = rest // pp  # dp_replicate x dp_shard
                    if batch % (dp * ep):
                        continue
                    local = batch // (dp * ep)
                    yield from _inner(m, pp, dp, ep, cp, tp, local, modes, gpus_per_node,
                                      families, micro_batches, recompute, drop, skipped)


def _shard_options(dp: int, inner: int, gpus_per_node: int) -> list[int]:
    """dp_shard degrees: 1 (plain data parallelism), all of dp (ZeRO over every replica) and,
    for HSDP, the largest degree that keeps a shard group inside a node."""
    options = {1, dp}
    node = max(1, gpus_per_node // inner)
    local = max((d for d in divisors(dp) if d <= node), default=1)
    if 1 < local < dp:
        options.add(local)
    return sorted(options)


def _inner(m, pp, dp, ep, cp, tp, local, modes, gpus_per_node, families, micro_batches,
           recompute, drop, skipped) -> Iterator[LayoutGroup]:
    for shard in _shard_options(dp, tp * cp * ep, gpus_per_node):
        stages = (0,) if shard == 1 else (1, 2, 3)
        for zero in stages:
            # ``drop``'s verdicts by (schedule, chunks, m > 1): the microbatch sizes share them
            verdicts: dict[tuple[str, int, bool], bool] = {}
            for b in micro_batches:
                if local % b:
                    continue
                micro = local // b
                if pp == 1:
                    plans = [("none", 1)]
                else:
                    # interleaving needs m a multiple of p (Megatron's rule; Loom runs any
                    # m >= p, but with a deeper, irregular memory peak the planner does not model)
                    plans = [(name, v) for name, chunks in families.items() for v in chunks
                             if micro >= pp and m.n_layers >= pp * v
                             and (name != "interleaved_1f1b" or micro % pp == 0)
                             and (name != "search" or pp * micro <= SEARCH_MAX_WORK)]
                for schedule, chunks in plans:
                    key = (schedule, chunks, micro > 1)
                    if verdicts.get(key):  # dropped at another microbatch size: not built
                        skipped(len(modes) * len(recompute))
                        continue
                    sp = tp > 1  # under every schedule (split I/W backwards too, since the
                    # retaining split's W applies TP's gradient placement: loom.pipeline.stage)
                    for mode in modes:
                        first = _layout({
                            **_DEFAULTS, "pp": pp, "dp_replicate": dp // shard,
                            "dp_shard": shard, "ep": ep, "cp": cp, "tp": tp, "zero_stage": zero,
                            "sequence_parallel": sp,
                            # ZeRO-3 stages stay gathered across the step, as priced
                            "reshard_after_forward": not (pp > 1 and zero == 3),
                            "cp_mode": mode, "schedule": schedule, "chunks": chunks,
                            "micro_batch": b, "microbatches": micro, "recompute": recompute[0]})
                        if drop is not None and key not in verdicts:
                            verdicts[key] = drop(first)
                        if verdicts.get(key):
                            skipped(len(modes) * len(recompute))
                            break  # the other modes share what ``drop`` looks at
                        yield LayoutGroup(first, recompute)


__all__ = ["Workload", "LayoutGroup", "layouts", "vocab_pp_fits", "tp_fits", "cp_modes",
           "divisors", "SCHEDULES", "RECOMPUTE", "MICRO_BATCHES", "SEARCH_MAX_WORK"]
