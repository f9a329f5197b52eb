"""How one training job is laid out over its ranks: the single ``Layout`` value, and the
``Job`` (layout, model shape and numerics) the builders take.

A ``Layout`` holds everything that decides who computes what and when: the degree of each mesh
axis, ZeRO's stage, tensor/sequence/vocabulary and context parallelism's modes, the pipeline
schedule with its knobs, the microbatching and the recomputation policy. It is frozen, torch-free
and on the ground floor, so one value travels through the whole system:

* ``loom.config.layout_of(config)`` makes it from a resolved config (``[parallel]`` is its TOML
  face; ``[train]`` gives the microbatching and the recomputation), and
  ``loom.config.with_layout(config, layout)`` writes one back into a config, by value;
* the trainer builds its ``RankGrid`` (``Layout.grid``) and meshes from it, ``parallelize`` and
  the pipeline builder read their knobs from it, the memory estimator prices it;
* the planner enumerates ``Layout``s, the cost model and the simulator price them, and the chosen
  one becomes the config ``loom train`` runs.

Normal form (what ``layout_of`` returns, and what the planner builds): ``zero_stage`` is 0 when
``dp_shard`` is 1 (nothing to shard), ``schedule`` is "none" at pp = 1, ``chunks`` is the number
of stages per pipeline rank (0: the family's own, or the search's choice), and the schedule
search's knobs are at their defaults unless ``schedule`` is "search", where a named ``chunks``
pins the placement (1 looped, 2 the V) unless one is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from loom.topology import AXES, RankGrid

if TYPE_CHECKING:  # annotations only: the model's module imports torch, this one must not
    from loom.models.args import TransformerArgs

# ``train.fp8``'s recipes (torchao's names; ``loom.parallel.fp8`` applies them)
FP8_RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")

# -- context parallelism's split of cp into Ulysses x ring (``loom.parallel.context`` runs it) --
Mode = Literal["ulysses", "ring", "hybrid", "allgather"]
MODES: tuple[str, ...] = ("ulysses", "ring", "hybrid", "allgather")


@dataclass(frozen=True)
class CPLayout:
    """cp = ulysses x ring; Ulysses groups are runs of ``ulysses`` consecutive cp ranks.
    ``gather``: the ring's keys and values all-gathered at once instead of passed around
    (``allgather`` mode, ``loom.parallel.allgather_attention``; same zig-zag shards)."""

    size: int
    ulysses: int
    gather: bool = False

    @property
    def ring(self) -> int:
        return self.size // self.ulysses

    @classmethod
    def from_mode(cls, mode: Mode, size: int, ulysses_degree: int = 0) -> "CPLayout":
        """``ulysses_degree`` is only read for ``hybrid``; 0 picks the largest divisor u of cp
        with u <= cp/u (cp=4 -> 2x2, cp=8 -> 2x4; cp=2 -> 1x2, i.e. ring)."""
        if mode not in MODES:
            raise ValueError(f"context parallel mode {mode!r} is not one of {MODES}")
        if mode == "ulysses":
            return cls(size, size)
        if mode == "ring":
            return cls(size, 1)
        if mode == "allgather":
            return cls(size, 1, gather=True)
        u = ulysses_degree or max(d for d in range(1, size + 1) if size % d == 0 and d * d <= size)
        if size % u:
            raise ValueError(f"ulysses degree {u} does not divide cp degree {size}")
        return cls(size, u)


def check_layout(layout: CPLayout, seq_len: int, n_heads: int, n_kv_heads: int) -> None:
    """The rules a config must satisfy; raises ``ValueError`` naming the value and the rule.
    ``n_heads``/``n_kv_heads`` are the heads one cp rank holds before Ulysses (divide by tp)."""
    cp, u, r = layout.size, layout.ulysses, layout.ring
    multiple = cp * 2 if r > 1 else cp  # zig-zag: 2r chunks, each pair split u ways
    if seq_len % multiple:
        nearest = max(multiple, round(seq_len / multiple) * multiple)
        raise ValueError(f"seq_len={seq_len} must be divisible by {multiple} "
                         f"({'2 * cp for zig-zag ring' if r > 1 else 'cp'}); nearest: {nearest}")
    for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
        if heads % u:
            raise ValueError(f"{name}={heads} must be divisible by the Ulysses degree {u} "
                             f"(all-to-all splits heads over the Ulysses group)")


# Families that place stages in a V (rank r holds stages r and 2p-1-r), or, Hanayo with more
# than one wave, in a snake of ``chunks`` sweeps (``loom.schedule.ir.v_placement``).
V_SHAPED = frozenset({"zbv", "v_half", "v_min", "dualpipev", "hanayo"})


@dataclass(frozen=True)
class Layout:
    """The degrees of every axis and the knobs of the step (see the module docstring)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    zero_stage: int = 0  # 0 (no sharding), 1, 2, 3; needs dp_shard > 1 when > 0
    # ZeRO-3: free gathered parameters after forward; false keeps them for the backward (in a
    # pipeline: gathered once per step per stage)
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    vocab_parallel: bool = True
    cp_mode: str = "ring"  # ring | ulysses | hybrid | allgather
    cp_ulysses: int = 0  # hybrid: Ulysses group size (0: auto)
    schedule: str = "none"  # a schedule family (or "search") when pp > 1
    chunks: int = 1  # stages per pipeline rank; 0: the family's own or the search's choice
    # schedule = "search": the activation units it may hold (0: pp, or for the planner: to be set
    # from the memory left), the relative "F,I,W,latency" it searches for ("": the planner fills
    # them from its cost model) and the placement (looped | interleaved | v | auto)
    schedule_memory_limit: float = 0.0
    schedule_costs: str = ""
    schedule_placement: str = "auto"
    # PipeOffload: the schedule's offloads keep each rank's device activations within this many
    # units (0: no offload; ``loom.schedule.offload.insert_offload``)
    schedule_offload_limit: float = 0.0
    micro_batch: int = 1  # sequences per forward/backward on one rank
    microbatches: int = 1  # per pipeline (or accumulation steps) per optimizer step
    recompute: str = "none"  # none | selective | full | every_k
    recompute_every: int = 2
    # the embedding and head split over every pipeline rank (``parallel.vocab_parallel_pp``),
    # as the planner and the memory estimator price it; the runtime reads Job's
    vocab_parallel_pp: bool = False

    def __post_init__(self) -> None:
        # The search's stages per rank pin its placement when none is named (the planner's
        # habit: 1 searches the looped placement, 2 the V); 0 leaves the choice to the search.
        if self.schedule == "search" and self.schedule_placement == "auto" and self.chunks:
            object.__setattr__(self, "schedule_placement", "v" if self.chunks == 2 else "looped")

    # -- shape -----------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.ep * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Degree seen by the batch: replicate x shard x expert axes."""
        return self.dp_replicate * self.dp_shard * self.ep

    def degrees(self) -> dict[str, int]:
        return {axis: getattr(self, axis) for axis in AXES}

    def grid(self) -> RankGrid:
        """The named rank grid of this layout (the meshes are built from it)."""
        return RankGrid(self.degrees())

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.dp * self.micro_batch * self.microbatches

    # -- the pipeline ----------------------------------------------------------------------------
    @property
    def searched(self) -> bool:
        return self.pp > 1 and self.schedule == "search"

    @property
    def v_shaped(self) -> bool:
        """Stages placed in a V (rank r holds stages r and 2p-1-r)."""
        return self.schedule in V_SHAPED or (self.schedule == "search"
                                             and self.schedule_placement == "v")

    def label(self) -> str:
        """A short human name, e.g. ``pp8 dp_shard4 tp8 zero3 sp 1f1b mb1x32``."""
        parts = [f"{axis}{getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1]
        text = " ".join(parts) or "single"
        if self.zero_stage:
            text += f" zero{self.zero_stage}"
        if self.tp > 1 and self.sequence_parallel:
            text += " sp"
        if self.cp > 1:
            text += f" {self.cp_mode}"
        if self.searched:
            text += f" search-{self.schedule_placement}"
            if self.schedule_memory_limit:
                text += f"@{self.schedule_memory_limit:g}"
        elif self.pp > 1:
            text += f" {self.schedule}" + (f"x{self.chunks}" if self.chunks > 1 else "")
        if self.schedule_offload_limit:
            text += f" offload@{self.schedule_offload_limit:g}"
        if self.vocab_parallel_pp:
            text += " vocab-pp"
        text += f" mb{self.micro_batch}x{self.microbatches}"
        if self.recompute != "none":
            text += f" rc-{self.recompute}"
        return text


@dataclass(frozen=True)
class CompressionSpec:
    """The data-parallel reducer's gradient compression, resolved from ``parallel.grad_
    compression*`` (``loom.config.compression_of``; ``loom.parallel.compression`` builds it)."""

    method: str = "none"  # none | powersgd | int8 | topk
    rank: int = 4  # PowerSGD's rank
    topk_ratio: float = 0.01  # fraction of each tensor's elements top-k sends
    adaptive: str = "none"  # "lgreco": per-tensor levels re-chosen every ``refresh`` steps
    refresh: int = 100
    # PowerSGD compresses a matrix only where (rows + cols) r * this < rows cols (torch's rule)
    min_compression_rate: float = 2.0


@dataclass(frozen=True)
class Job:
    """Everything the builders need, resolved once (``loom.config.job_of``): the model's shape,
    the layout, and the step's numerics. ``parallelize`` and the pipeline builder take this one
    value instead of a config section each and a bag of keywords."""

    args: TransformerArgs
    layout: Layout
    seq_len: int
    seed: int = 0  # initial weights, by parameter name (the same on every layout)
    dtype: str = "fp32"  # fp32; bf16 parameters, fp32 masters; bf16_autocast over fp32 ones
    grad_reduce_dtype: str = "fp32"
    grad_bucket_mb: float = 25.0  # gradient buckets of data parallelism and ZeRO-1/2
    grad_reduce_every_microbatch: bool = False  # ZeRO-2/3: reduce each backward's gradients
    offload_optimizer: bool = False  # resolved for the device (``train.offload``)
    # Data parallelism across dp_replicate: "sync" (gradients averaged over every data axis) or an
    # outer loop ("diloco", "noloco", "co2": gradients averaged inside a replica only, the
    # replicas' weights merged by ``loom.parallel.outer``). A Job field, not a Layout one, while
    # the simulator and the planner price sync only (issue 19 item 4 moves it).
    dp_mode: str = "sync"
    compile: bool = False  # torch.compile each transformer block (``train.compile``)
    # ``data.packing``: documents (pack, varlen) compile around their eager attention kernel,
    # varlen for any sequence length (``loom.parallel.compile``)
    packing: str = "concat"
    # The data-parallel reducer's gradient compression (``parallel.grad_compression``); None:
    # none. A Job field for the same reason as dp_mode: the planner does not price it yet.
    compression: CompressionSpec | None = None
    fp8: str = "none"  # FP8 matmuls in the blocks' linears (``train.fp8``, loom.parallel.fp8)
    fp8_emulate: bool = False
    fp8_all_gather: bool = False  # ZeRO-3 gathers the FP8 linears' weights in float8
    # The embedding and output layer split over the vocabulary onto every pipeline rank
    # (``parallel.vocab_parallel_pp``, loom.parallel.vocab_pipeline); the runtime reads this
    # one, the planner and the estimator ``Layout.vocab_parallel_pp`` (the same setting)
    vocab_parallel_pp: bool = False


__all__ = ["Layout", "Job", "CompressionSpec", "V_SHAPED", "CPLayout", "MODES", "check_layout",
           "FP8_RECIPES"]
