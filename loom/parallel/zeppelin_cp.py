"""``data.balance = zeppelin`` at run time: each varlen microbatch placed over the cp (x dp) ranks.

``data.balance = tokens`` deals a step's pieces into microbatches of nearly equal tokens; under
context parallelism (``parallel.cp > 1``) the default sharding (``context_documents
.document_shard_indices``) then cuts *every* document zig-zag over all cp ranks. ``zeppelin``
deals the same microbatches, and places each one's documents over its cp ranks by the
Zeppelin planner (``loom.data.zeppelin``, Chen et al. 2025): a document either whole on one
rank (short ones: no ring work at all) or zig-zag over an aligned power-of-two group of ranks
(long ones), chosen so the ranks' attention work (~ s² per document, s²/g per rank of a group
of g) and linear work (~ tokens) are balanced. The placement is a pure function of the
microbatch's piece lengths, computed alike on every rank: nothing is communicated to agree.

The attention that runs it is Zeppelin's engine (``sub_ring_attention``), fed by the shard's
document ids and positions (one all-gather of them over the cp group per forward, shared by
every layer: ``sub_ring_keys``):

* **Whole documents** (held by one rank) run the model's own document attention on that rank
  (``DocumentMask.attention``: what ``data.balance = tokens`` runs), with no communication.
* **A document over a group** of ``g`` cp ranks (an aligned block: start a multiple of ``g``)
  runs ring attention over **that group only**: its members' keys and values of the group's
  documents make ``g - 1`` hops inside the group's own process group, and the key/value
  gradients travel back the same way (``ring_attention``'s travelling dK/dV sum). Every
  aligned block of cp ranks has its process group, created once at setup, collectively on all
  ranks (``new_sub_rings``: gloo has no ``split_group``), and passed explicitly
  (``context.CPGroups.sub_rings``). A document's block is the smallest aligned one that holds
  all its ranks (the placement's own group; any other sharding still runs, on a larger ring).
* A rank's own block of its grouped documents (their queries against its own keys: causal
  tiles) is computed while the first hop of each of its rings is in flight; then its rings
  run one after another in one global order (largest first, then by start), the same on
  every rank, so ranks in several rings cannot wait on each other in a cycle. Forward and backward are one autograd
  ``Function``, so the order does not depend on autograd's.
* Messages carry exactly the sender's tokens of the ring's documents (every rank knows every
  rank's counts from the all-gather): **no shard is padded to the longest** (a rank's shard is
  its own tokens, ``zeppelin_shard_indices``; one padding slot only for a rank given none),
  and the linear modules run on each rank's own tokens.

With tensor parallelism (``parallel.tp > 1``) the tp ranks of one cp rank hold the same tokens
and a shard of the heads: each computes the same placement from the same microbatch (nothing
is communicated), and its sub-rings join the cp ranks of its own tp index, as the cp ring does
(``new_sub_rings`` makes them for every cp group, one per tp and data coordinate). Under
sequence parallelism a cp rank's shard, its own token count, is split over its tp ranks
unevenly where tp does not divide it, as a varlen microbatch is at cp = 1; the engine sees the
whole shard, gathered. With pipeline parallelism every stage computes the same placement, its
stage-to-stage messages between ranks of one cp index (one shard length), and each stage's
sub-rings join its own cp ranks, which run the schedule's passes in the same order.

**Over the data-parallel ranks too** (``parallel.dp > 1``: Zeppelin's "sub-ring of the cp x dp
ranks, nearest ranks first"). The placement domain is then every dp x cp rank of the (tp, pp)
coordinate, ``D x C`` ranks flattened with the cp index innermost (``RankGrid.groups(dp axes,
"cp")``' order), so an aligned block of ranks is nearest ranks first: a group of ``g <= C``
stays inside one dp rank's cp ranks, a larger one spans neighbouring dp ranks. Every rank of
the domain gets the same *merged* microbatch (``merge_dp_microbatches``): microbatch ``i`` of
the step is the pieces the ``D`` dp ranks would have got as their ``i``-th (``data.balance =
tokens``' bins), concatenated in dp order; the planner places its documents over the ``D x C``
ranks exactly as over cp ranks (cp = 1 with dp > 1 too: short documents whole on a dp rank,
long ones over a sub-ring of dp ranks), and the sub-rings are the domain's aligned blocks
(``new_sub_rings`` over the domain groups, made once at setup, collectively, passed
explicitly). The step's documents are unchanged, and so is the loss: each rank sums its own
tokens' losses, the step's tokens are counted over dp x cp (the placement holds each token
once), and the gradient average over dp x cp turns the ranks' sums, each times ``D x C`` over
the step's tokens, into the token mean however unevenly the ranks hold tokens. The step keeps
its ``M = N / D`` microbatches, each merged from ``D`` bins, rather than one microbatch of all
``N``: a rank then holds about ``B / C`` tokens of a microbatch (``B`` the token budget), what
``tokens`` gives a rank under cp, so activation memory and the schedule (``M`` forward and
backward passes) stay as they are; one merged microbatch of the whole step would give the
planner more freedom but ``M`` times the activations (the bench's ``zeppelin-step`` row
measures that choice at cp = 4).

**The remapping layer** (``data.zeppelin_remap``, ``loom.parallel.remap``): the trainer's
shard is then the placement's *linear layout* (``Partition.linear_layout``: an equal split of
the microbatch, token counts within one of each other, each rank keeping what fits its quota of
what the placement gave it), so embedding, norms, projections, MLP and loss run balanced. The
attention core (``sub_ring_keys``, once per forward, shared by every layer) gathers the shard's
(id, position) pairs as it does without remapping, recomputes the same placement from the
microbatch's run lengths on every rank (``RemapPlacement``: the trainer's costs; nothing
communicated to agree), rebuilds the row and plans the sub-rings on the attention layout; each
layer's q, k and v (RoPE applied in linear layout at each token's own position) go to the
attention layout in one all-to-all (``Remap.to_attention``) and the output comes back in
another (``Remap.to_linear``; backward the same two the other way, ledger axis ``remap``).
Every candidate is then priced remapped (``cp_step_price``): the busiest rank's attention plus
the equal split's linear work plus the busiest rank's remapped bytes
(``REMAP_BYTE_FLOPS``, an estimate). Built and proven with tp = pp = 1 (the config refuses it
otherwise).

Without the remapping layer (the default), a rank's
linear work is its own tokens', so a placement is priced as the busiest rank's attention
(``tiled_attention``: a document cut over more ranks than its length needs costs each of them
a whole tile) plus its linear work, ``max(attention + tokens x linear)`` (``cp_step_price``;
the ring's waits inside a group are not modelled). The candidates are the planner's
(``zeppelin_candidates``, both with the linear work balanced per rank and with attention
alone), its ``tokens`` deal and static cp (every document over all cp ranks; over a dp x cp
domain also over each dp rank's own cp ranks), and the cheapest wins (ties: the first), so on
this cost model a placement is never worse than static cp or an all-whole deal. Costs
(``model_token_costs``) are flop counts of the model's shape, forward and backward,
attention's weighted by how much slower per flop each attention path runs than the linear
modules, measured on this machine's CPU (``KERNEL_SLOWDOWN`` for the model's own kernel on
whole documents, ``TILE_SLOWDOWN`` for the engine's masked tiles, ``RING_SLOWDOWN`` for a
grouped document's tiles against the same document whole, dearer where a rank's share is
under ``RING_CHUNK`` tokens; ``bench/varlen.py --calibrate``).

Hand-written: no library places variable-length sequences over a context-parallel ring, nor
runs ring attention over several sub-rings of one cp group side by side (torch's context
parallelism has one ring and no document masks).

Shape legend: B batch (1: a varlen microbatch), N query heads, K key/value heads, L this
rank's tokens, n a member's tokens of one ring's documents, Hd head dim, g a ring's size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from loom.data.packing import DocumentBatch
from loom.data.varlen import VarlenBatch
from loom.data.zeppelin import (Partition, Ranks, TokenCosts, partition_static_cp,
                                zeppelin_candidates)
from loom.models.args import TransformerArgs
from loom.models.document_attention import DocumentMask
from loom.parallel import comm
from loom.parallel.comm import CommLedger
from loom.parallel.context_documents import (PAD_KEY, PAD_SLOT, TILE_TOKENS, Tile,
                                             block_backward, block_forward, document_tiles,
                                             merge_masked)
from loom.parallel.remap import Remap, build_remap
from loom.parallel.ring_attention import DKV_TAG, KV_TAG, Ring, wait_all


# Attention's seconds per flop over the linear modules' (forward + backward, fp32, one CPU
# thread, the tiny model), measured by ``python bench/varlen.py --ranks 4 --calibrate
# --corpora ""`` on this machine (2026-11-26, docs/benchmarks.md): the model's own kernel on
# whole documents (causal SDPA per document) fitted to the model's step time over rows of 1024
# to 4096 tokens cut into 1 to 16 documents: 1.00; the engine's masked fp32 tiles: 3.68 (load
# ~10); an 8192-token document cut over a group of 4 (its zig-zag chunks' causal and full tiles
# on the same kernel, merged per hop) against a quarter of it whole: 1.12 to 1.16 over the
# ranks (load ~13; the bench's ``ring_over_whole``, 4096 tokens, gave 1.27 at load 16 to 68,
# where the other two read 1.22 and 4.21: the ratios move ~20% with load). The kernel's 1.00
# predicts the busiest rank's CPU time under data.balance = tokens on the long-context long
# tail within 1% (10.14 s vs 10.21 s measured, seed 0). Only the ratios matter to the
# placement, and they are constants, not per-run measurements: every rank must compute the
# same placement.
KERNEL_SLOWDOWN = 1.0
TILE_SLOWDOWN = 3.7
RING_SLOWDOWN = 1.13
# RING_SLOWDOWN holds for a rank's share of a grouped document of RING_CHUNK tokens or more;
# smaller shares run smaller, relatively dearer tiles: ``ring_over_whole`` (2026-11-27, load
# ~50) gave 1.06 at 2048 tokens a rank (8192 over 4), 1.21 and 1.42 at 1024 (2048 over 2, 4096
# over 4), 1.83 and 1.91 at 512 (1024 over 2, 2048 over 4): RING_SLOWDOWN x (RING_CHUNK /
# share) ** RING_CHUNK_EXPONENT fits them within ~15%. Without it the placement cut stdlib's
# 2048-token pieces over 4 ranks at a predicted 0.85 of tokens' step and ran ~1.3x slower.
RING_CHUNK = 2048
RING_CHUNK_EXPONENT = 0.35
# The remapping layer's all-to-alls (data.zeppelin_remap) priced in linear flops per byte a
# rank sends or receives: gloo between local processes moves ~1 GB/s where one CPU thread runs
# the linear modules' fp32 matmuls at ~40 GFLOP/s (REMAP_BYTE_FLOPS = their ratio; an estimate,
# not a calibration: see cp_step_price).
REMAP_BYTE_FLOPS = 40.0


def model_token_costs(args: TransformerArgs,
                      attention_slowdown: float = KERNEL_SLOWDOWN) -> TokenCosts:
    """Flops of one token through the linear modules (projections, MLP, output head) and of
    one query-key pair of attention (scores and weighted values), forward and backward (x3),
    over every layer; attention's weighted by ``attention_slowdown``, how much slower per flop
    the model's own attention kernel runs than the linear modules (``KERNEL_SLOWDOWN``; the
    engine's tiles are priced relative to it by ``tiled_attention``)."""
    d, layers = args.dim, args.n_layers
    kv = d * args.n_kv_heads // args.n_heads
    per_layer = 2 * d * d + 2 * d * kv + args.mlp_matrices * d * args.ffn_dim  # q, o; k, v; MLP
    linear = 3 * 2 * (layers * per_layer + d * args.vocab_size)
    attention = 3 * 4 * d * layers * attention_slowdown  # q.k and p.v, 2 flops per mul-add
    # a remapped token's q, k, v out and its attention output back, and their gradients the
    # other way: 2 x (2d + 2kv) fp32 values per layer each way (Partition.remap_seconds takes
    # the larger of what a rank sends and receives)
    remap = REMAP_BYTE_FLOPS * 4 * 2 * (2 * d + 2 * kv) * layers
    return TokenCosts(linear=float(linear), attention=float(attention), remap_intra=float(remap),
                      remap_inter=float(remap))


def tiled_attention(partition: Partition, tile_tokens: int = TILE_TOKENS,
                    masked: float = TILE_SLOWDOWN / KERNEL_SLOWDOWN,
                    ring: float = RING_SLOWDOWN) -> np.ndarray:
    """Each rank's attention work on the cp runtime, in ``costs.attention`` units (pairs on
    the model's kernel): a document whole on one rank costs its causal pairs, s²/2, on the
    model's kernel. One of ``s`` tokens on a group of ``g`` ranks gives each of them its own
    causal tile of ``s/g`` tokens ((s/g)²/2 pairs) and ``g - 1`` blocks against the other
    ranks' chunks: full tiles (half the pairs visible) when its ``s/g`` queries reach
    ``tile_tokens``, those pairs ``ring`` times a whole document's (the tiles' merges and
    smaller kernels), and ``(RING_CHUNK / (s/g)) ** RING_CHUNK_EXPONENT`` times more where
    ``s/g`` is under ``RING_CHUNK``; else a masked tile of at least ``tile_tokens`` keys
    (small documents share one, whose masked pairs are computed too), each computed pair
    ``masked`` times a kernel pair: a document cut over more ranks than its length needs pays
    masked tiles on each."""
    load = np.zeros(partition.ranks.count)
    for n, b, g in zip(partition.lengths, partition.start, partition.size):
        if g == 1:
            load[b] += n * n / 2
            continue
        chunk = n / g
        if chunk >= tile_tokens:  # full tiles, dearer the smaller they are (RING_CHUNK)
            rate = ring * max(1.0, RING_CHUNK / chunk) ** RING_CHUNK_EXPONENT
            load[b:b + g] += rate * g * chunk * chunk / 2
            continue
        # masked, in a shared tile
        load[b:b + g] += ring * chunk * chunk / 2 + (g - 1) * chunk * tile_tokens * masked
    return load * partition.costs.attention


def per_token_square(costs: TokenCosts) -> TokenCosts:
    """``costs`` in the planner's attention unit: ``loom.data.zeppelin.group_time`` prices a
    causal sequence of n tokens as attention x n², while ``model_token_costs`` and
    ``tiled_attention`` count attention per query-key pair (n²/2 of them)."""
    return replace(costs, attention=costs.attention / 2)


def cp_step_price(partition: Partition) -> float:
    """A placement's time on the cp runtime (module docstring): the busiest rank's attention
    (``tiled_attention``) plus linear work on its own tokens (shards are not padded). Remapped
    (``partition.remapped``: data.zeppelin_remap), the attention stage and the linear stage
    each wait for their busiest rank (the all-to-alls between them synchronise every layer),
    the linear stage on the equal split, plus the busiest rank's remapped bytes
    (``Partition.remap_seconds`` at ``costs.remap_intra``, ``model_token_costs``)."""
    attention = tiled_attention(partition)
    if partition.remapped:
        return float(attention.max() + partition.quotas().max() * partition.costs.linear
                     + partition.remap_seconds())
    return float((attention + partition.rank_tokens() * partition.costs.linear).max())


def place_over_cp(lengths: list[int] | np.ndarray, cp: int, costs: TokenCosts,
                  inner_cp: int = 0, remap: bool = False) -> Partition:
    """The placement of one microbatch's documents (``lengths``, in row order) over ``cp``
    ranks (the cp ranks, or the dp x cp domain's): the cheapest candidate by ``cp_step_price``
    (module docstring). ``inner_cp``: over a dp x cp domain, the cp degree, whose static cp
    (every document over one of the ``cp / inner_cp`` rings of cp ranks) is a candidate too.
    ``remap``: the runtime remaps every microbatch (data.zeppelin_remap), so every candidate
    is priced remapped."""
    seqs = [int(n) for n in lengths]
    ranks = Ranks(cp, per_node=cp)  # one machine's ranks: every group inside a node
    sizing = per_token_square(costs)  # the planner's unit; each candidate priced in pairs
    candidates = [replace(plan, costs=costs, remapped=remap) for balanced in (False, True)
                  for plan in zeppelin_candidates(seqs, ranks, sizing, remap=balanced)]
    static = [replace(partition_static_cp(seqs, ranks, ring, costs), remapped=remap)
              for ring in dict.fromkeys((cp, inner_cp)) if ring > 1 and cp % ring == 0]
    return min(candidates + static, key=cp_step_price)


def document_runs(document_ids_S: np.ndarray) -> list[int]:
    """The lengths of the row's runs of equal ids (its documents, in order)."""
    starts = np.flatnonzero(np.r_[True, document_ids_S[1:] != document_ids_S[:-1]])
    return np.diff(np.append(starts, len(document_ids_S))).tolist()


def zeppelin_shard_indices(document_ids_BS: torch.Tensor, cp: int, cp_rank: int,
                           costs: TokenCosts, inner_cp: int = 0,
                           remap: bool = False) -> torch.Tensor:
    """Which tokens of a varlen microbatch (``[1, S]``) cp rank ``cp_rank`` holds: int64
    ``[1, L]`` indices into the row (``place_over_cp``'s ``token_indices``), ``L`` its own
    token count (not padded: the sub-rings pass each member's own count); a rank the placement
    gives no token holds one ``PAD_SLOT`` (a forward needs a token). Over a dp x cp domain
    ``cp`` is the domain's size, ``cp_rank`` the rank's place in it, ``inner_cp`` the cp degree.
    ``remap``: the placement's linear layout instead (``Partition.linear_layout``, the equal
    split), which the model holds outside attention (``RemapPlacement``)."""
    if document_ids_BS.shape[0] != 1:
        raise ValueError(f"data.balance = zeppelin places a varlen microbatch (one row), not"
                         f" {document_ids_BS.shape[0]} rows")
    partition = place_over_cp(document_runs(document_ids_BS[0].cpu().numpy()), cp, costs,
                              inner_cp, remap)
    mine = partition.linear_layout()[cp_rank] if remap else partition.token_indices(cp_rank)
    index = mine[None] if len(mine) else np.full((1, 1), PAD_SLOT, dtype=np.int64)
    return torch.from_numpy(index).to(document_ids_BS.device)


def merge_dp_microbatches(batch: VarlenBatch, dp: int) -> VarlenBatch:
    """The step's ``N`` microbatches (every dp rank's, dp rank ``d`` holding ``[d*M, (d+1)*M)``,
    ``M = N / dp``) as the ``M`` merged ones every rank of a dp x cp domain runs (module
    docstring): merged microbatch ``i`` is microbatch ``d*M + i`` of every ``d``, concatenated
    in dp order, its document ids renumbered to stay run ordinals (neighbours differ)."""
    count = len(batch.microbatches)
    if dp < 1 or count % dp:
        raise ValueError(f"{count} microbatches cannot be merged over {dp} data-parallel ranks")
    per_rank = count // dp
    merged = []
    for i in range(per_rank):
        parts = [batch.microbatches[d * per_rank + i] for d in range(dp)]
        ids, first = [], 0
        for part in parts:  # each part's ids are 0 .. k-1 ordinals
            ids.append(part.document_ids + first)
            first += int(part.document_ids.max()) + 1
        merged.append(DocumentBatch(*(torch.cat(column, dim=1) for column in (
            [p.inputs for p in parts], [p.targets for p in parts],
            [p.positions for p in parts], ids))))
    return VarlenBatch(tuple(merged), batch.step_tokens)


# -- the sub-rings: process groups, made once ---------------------------------------------------
def aligned_blocks(cp: int) -> list[tuple[int, int]]:
    """Every block of cp ranks a document's ring can run on, as (start, size): the aligned
    power-of-two blocks of >= 2 ranks (start a multiple of the size), largest first, then by
    start, and the whole cp group where ``cp`` is not a power of two. This order is the one
    every rank runs its rings in."""
    blocks = []
    g = 2
    while g <= cp:
        blocks += [(b, g) for b in range(0, cp - g + 1, g)]
        g *= 2
    if cp & (cp - 1):
        blocks.append((0, cp))
    return sorted(blocks, key=lambda block: (-block[1], block[0]))


@dataclass(frozen=True)
class SubRings:
    """This rank's sub-ring process groups (``new_sub_rings``): ``members`` the global ranks of
    its cp group in cp order, ``cp_rank`` its place there, ``groups`` the process group of
    every aligned block (``aligned_blocks``) that holds it, by (start, size)."""

    members: tuple[int, ...]
    cp_rank: int
    groups: tuple[tuple[tuple[int, int], Any], ...]
    remap: "RemapPlacement | None" = None  # data.zeppelin_remap: shards in linear layout

    def group(self, block: tuple[int, int]) -> Any:
        return dict(self.groups)[block]


@dataclass(frozen=True)
class RemapPlacement:
    """``data.zeppelin_remap``: the shards the model holds are the linear layout of
    ``place_over_cp(lengths, cp, costs, inner_cp, remap=True)`` (``zeppelin_shard_indices``
    with ``remap``), and attention remaps q, k, v to its attention layout and the output back
    (``sub_ring_keys``, ``sub_ring_attention``). ``costs`` and ``inner_cp`` must be the
    trainer's, so that every rank's core recomputes the placement the shards were cut by."""

    costs: TokenCosts
    inner_cp: int = 0


def with_remap(sub_rings: SubRings, costs: TokenCosts, inner_cp: int = 0) -> SubRings:
    """``sub_rings`` whose attention runs the remapping layer (``RemapPlacement``)."""
    return replace(sub_rings, remap=RemapPlacement(costs, inner_cp))


def new_sub_rings(cp_rank_groups: Sequence[Sequence[int]], rank: int) -> SubRings:
    """The process group of every aligned block of every cp group (each listing global ranks
    in cp order; ``cp - 1`` groups per cp group when cp is a power of two). With tp, pp and
    data axes there is one cp group per (tp, pp, data) coordinate, so a sub-ring never joins
    ranks holding different heads, layers or data. Collective: every rank of the default group
    calls it with the same arguments (``dist.new_group`` is)."""
    mine = None
    for ranks in cp_rank_groups:
        ranks = tuple(int(r) for r in ranks)
        made = []
        for start, size in aligned_blocks(len(ranks)):
            members = ranks[start:start + size]
            group = dist.new_group(list(members))
            if rank in members:
                made.append(((start, size), group))
        if rank in ranks:
            mine = SubRings(ranks, ranks.index(rank), tuple(made))
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the cp groups {cp_rank_groups}")
    return mine


def ring_block(first: int, last: int, cp: int) -> tuple[int, int]:
    """The smallest block of ``aligned_blocks(cp)`` holding cp ranks ``first`` to ``last``;
    ``(first, 1)`` when they are one rank."""
    if first == last:
        return first, 1
    for start, size in sorted(aligned_blocks(cp), key=lambda block: block[1]):
        if start <= first and last < start + size:
            return start, size
    raise AssertionError("the whole cp group holds every rank")


# -- one forward's plan: which documents run where ----------------------------------------------
@dataclass(frozen=True)
class RingPart:
    """This rank's part of one sub-ring: the ring (its process group, members, this rank's
    index), every member's token count of the ring's documents (ring order), this rank's rows
    of them (``index``, in its order) and, per hop ``1 .. g-1``, the tiles of this rank's
    queries (all its rows) against the keys that arrive then (member ``index - hop``'s)."""

    ring: Ring
    counts: tuple[int, ...]
    index: torch.Tensor
    tiles: tuple[tuple[Tile, ...], ...]


@dataclass(frozen=True)
class SubRingKeys:
    """One forward's plan, shared by its layers. ``whole``: the ``DocumentMask`` of this rank's
    whole documents (rows ``whole_index`` of its shard, each document contiguous and in
    order), which the model's own document attention runs; ``ring_index``: the rows the
    engine runs (the other documents' tokens), ``own`` their tiles against their own keys and
    ``rings`` this rank's rings in the global order (indices into those rows). Padding rows
    are in neither and attend to nothing (output 0)."""

    rows: int
    whole: DocumentMask | None
    whole_index: torch.Tensor
    ring_index: torch.Tensor
    own: tuple[Tile, ...]
    rings: tuple[RingPart, ...]
    # data.zeppelin_remap: the rows above are the attention layout's (``attention_real`` real
    # ones, a padding row where none); the model's shard is the linear layout, ``linear_rows``
    # rows of which ``linear_real`` real; ``remap`` moves the rows between the two
    remap: Remap | None = None
    attention_real: int = 0
    linear_rows: int = 0
    linear_real: int = 0


def _plain_runs(ids: np.ndarray, pos: np.ndarray, docs: set[int]) -> set[int]:
    """Those of ``docs`` whose tokens here are one contiguous run at positions 0, 1, ...: what
    the model's document attention (runs of equal ids, causal by index) computes exactly."""
    plain = set()
    for d in docs:
        at = np.flatnonzero(ids == d)
        if at[-1] - at[0] + 1 == len(at) and np.array_equal(pos[at], np.arange(len(at))):
            plain.add(d)
    return plain


def sub_ring_keys(documents: DocumentMask, sub_rings: SubRings, cp_group: Any,
                  ledger: CommLedger | None = None, axis: str = "cp") -> SubRingKeys:
    """Gather every cp rank's (document id, position) pairs (an all-gather of the token
    counts, then one of the pairs padded to the longest, ``2 x L_max`` int64 per rank) and
    derive the plan: each document's block (``ring_block`` of the ranks that hold it), this
    rank's whole documents, its other rows' own tiles and, for every ring it is in, the tiles
    of each hop. With ``sub_rings.remap`` the shards are the linear layout and the plan is
    the attention layout's, with the ``Remap`` between them (``_remapped_plan``)."""
    positions = documents.known_positions
    if documents.shape[0] != 1 or positions is None:
        raise ValueError("sub-ring attention runs a varlen microbatch ([1, L]) with each"
                         " token's position in its document")
    ids_L, pos_L = documents.document_ids[0].long(), positions.expand(documents.shape)[0].long()
    cp, device = len(sub_rings.members), ids_L.device
    counts = torch.empty(cp, dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(counts, torch.tensor([len(ids_L)], device=device), cp_group,
                                axis=axis, ledger=ledger)
    longest = int(counts.max())
    mine = torch.stack([torch.full((longest,), PAD_KEY, device=device),
                        torch.zeros(longest, dtype=torch.int64, device=device)])
    mine[0, :len(ids_L)], mine[1, :len(ids_L)] = ids_L, pos_L
    gathered = torch.empty((cp * 2, longest), dtype=torch.int64, device=device)
    comm.all_gather_into_tensor(gathered, mine, cp_group, axis=axis, ledger=ledger)
    pairs = gathered.view(cp, 2, longest).cpu().numpy()
    ids = [pairs[p, 0, :n] for p, n in enumerate(counts.tolist())]
    pos = [pairs[p, 1, :n] for p, n in enumerate(counts.tolist())]
    if sub_rings.remap is None:
        return _plan(ids, pos, sub_rings, ledger, axis, device)
    return _remapped_plan(ids, pos, sub_rings, cp_group, ledger, axis, device)


def _remapped_plan(ids: list[np.ndarray], pos: list[np.ndarray], sub_rings: SubRings,
                   cp_group: Any, ledger: CommLedger | None, axis: str,
                   device: torch.device) -> SubRingKeys:
    """``data.zeppelin_remap``: ``ids`` and ``pos`` are every rank's linear layout. The
    microbatch's document lengths are their ids' counts (ids are the row's run ordinals), so
    every rank recomputes the placement the trainer cut the shards by (``RemapPlacement``),
    rebuilds the row from the linear layout, and plans attention on the attention layout's
    (id, position) pairs; the ``Remap`` between the two layouts runs on the cp group."""
    cp, me, placement = len(ids), sub_rings.cp_rank, sub_rings.remap
    real = [ids[p] >= 0 for p in range(cp)]  # a rank given no token holds one padding slot
    lengths = np.bincount(np.concatenate([ids[p][real[p]] for p in range(cp)]))
    if not len(lengths) or (lengths == 0).any():
        raise ValueError("remapping needs the microbatch's document ids as run ordinals")
    partition = place_over_cp(lengths, cp, placement.costs, placement.inner_cp, remap=True)
    linear = partition.linear_layout()
    row_ids = np.empty(partition.total_tokens, dtype=np.int64)
    row_pos = np.empty(partition.total_tokens, dtype=np.int64)
    for p in range(cp):
        if len(linear[p]) != int(real[p].sum()):
            raise ValueError(f"cp rank {p} holds {int(real[p].sum())} tokens, the placement's"
                             f" linear layout {len(linear[p])}: shards cut by another placement")
        row_ids[linear[p]], row_pos[linear[p]] = ids[p][real[p]], pos[p][real[p]]
    attention = [partition.token_indices(p) for p in range(cp)]
    ids_a = [row_ids[a] if len(a) else np.array([PAD_KEY]) for a in attention]
    pos_a = [row_pos[a] if len(a) else np.zeros(1, dtype=np.int64) for a in attention]
    keys = _plan(ids_a, pos_a, sub_rings, ledger, axis, device)
    remap = build_remap(attention, me, cp_group, linear, ledger=ledger)
    return replace(keys, remap=remap, attention_real=len(attention[me]),
                   linear_rows=len(ids[me]), linear_real=len(linear[me]))


def _plan(ids: list[np.ndarray], pos: list[np.ndarray], sub_rings: SubRings,
          ledger: CommLedger | None, axis: str, device: torch.device) -> SubRingKeys:
    """``sub_ring_keys``' plan from every rank's (document id, position) pairs."""
    cp = len(ids)
    holders: dict[int, list[int]] = {}
    for p in range(cp):
        for d in np.unique(ids[p][ids[p] >= 0]).tolist():
            holders.setdefault(d, []).append(p)
    block_of = {d: ring_block(min(ps), max(ps), cp) for d, ps in holders.items()}
    me = sub_rings.cp_rank
    plain = _plain_runs(ids[me], pos[me], {d for d in np.unique(ids[me][ids[me] >= 0]).tolist()
                                           if block_of[d][1] == 1})
    whole_rows = np.flatnonzero(np.isin(ids[me], sorted(plain)))
    whole = None
    if len(whole_rows):
        whole = DocumentMask(torch.from_numpy(ids[me][whole_rows])[None].to(device))
    engine_rows = [np.flatnonzero((ids[p] >= 0) & ~np.isin(ids[p], sorted(plain)))
                   for p in range(cp)]  # other ranks' "plain" ids are never in my rings
    ids_e = [ids[p][engine_rows[p]] for p in range(cp)]
    pos_e = [pos[p][engine_rows[p]] for p in range(cp)]
    own = document_tiles(ids_e[me], pos_e[me], ids_e[me], pos_e[me], device, own_keys=True)
    rings = []
    for start, size in aligned_blocks(cp):
        if not start <= me < start + size:
            continue
        docs = np.array(sorted(d for d, block in block_of.items() if block == (start, size)))
        if not len(docs):
            continue
        held = [np.isin(ids_e[start + j], docs) for j in range(size)]
        j = me - start
        tiles = []
        for hop in range(1, size):
            src = start + (j - hop) % size
            tiles.append(document_tiles(ids_e[me], pos_e[me], ids_e[src][held[src - start]],
                                        pos_e[src][held[src - start]], device))
        ring = Ring(sub_rings.group((start, size)), sub_rings.members[start:start + size], j,
                    ledger, axis)
        rings.append(RingPart(ring, tuple(int(h.sum()) for h in held),
                              torch.from_numpy(np.flatnonzero(held[j])).to(device),
                              tuple(tiles)))
    return SubRingKeys(len(ids[me]), whole, torch.from_numpy(whole_rows).to(device),
                       torch.from_numpy(engine_rows[me]).to(device), own, tuple(rings))


# -- the engine ---------------------------------------------------------------------------------
def _hop(part: RingPart, sending: torch.Tensor, tag: int, sent_of: int,
         received_of: int) -> tuple[torch.Tensor, list[Any], list[Any]]:
    """Post one hop of ``part``'s ring: ``sending`` (member ``sent_of``'s rows, dim 3) to the
    next member, and a buffer for member ``received_of``'s rows from the previous one; returns
    the buffer, the send's and the receive's requests (each awaited once: gloo's wait is not
    idempotent). Both sides know every count: an empty message is neither sent nor awaited."""
    g = part.ring.size
    sent = [part.ring.send(sending, tag)] if part.counts[sent_of % g] else []
    shape = list(sending.shape)
    shape[3] = part.counts[received_of % g]
    buffer = sending.new_empty(shape)
    received = [part.ring.recv(buffer, tag)] if shape[3] else []
    return buffer, sent, received


def _kv_of(part: RingPart, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor) -> torch.Tensor:
    """This rank's keys and values of the ring's documents, one message: ``[2, B, K, n, Hd]``."""
    return torch.stack([k_BKLH[:, :, part.index], v_BKLH[:, :, part.index]]).contiguous()


def _first_hops(keys: SubRingKeys, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor) -> list[Any]:
    """Every ring's first hop of this rank's keys and values, posted at once."""
    return [_hop(part, _kv_of(part, k_BKLH, v_BKLH), KV_TAG, part.ring.index, part.ring.index - 1)
            for part in keys.rings]


class _SubRingAttention(torch.autograd.Function):
    """Own tiles, then each ring's hops (module docstring); forward and backward in one fixed
    order on every rank. The hops and the travelling dK/dV sum are ``ring_attention``'s, over
    each sub-ring's own process group with each member's own token count."""

    @staticmethod
    def forward(ctx: Any, q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
                keys: SubRingKeys) -> torch.Tensor:
        with torch.autocast(q_BNLH.device.type, enabled=False):  # fp32 softmax statistics
            first = _first_hops(keys, k_BKLH, v_BKLH)  # in flight during the own tiles
            out, lse = block_forward(q_BNLH, k_BKLH, v_BKLH, keys.own)
            for part, (incoming, *requests) in zip(keys.rings, first):
                j, g = part.ring.index, part.ring.size
                for hop in range(1, g):  # holding member j - hop's keys
                    wait_all(requests[0] + requests[1])
                    kv = incoming
                    if hop < g - 1:  # pass it on before computing with it
                        incoming, *requests = _hop(part, kv, KV_TAG, j - hop, j - hop - 1)
                    if part.tiles[hop - 1]:
                        out, lse = merge_masked(out, lse, *block_forward(
                            q_BNLH, kv[0], kv[1], part.tiles[hop - 1]))
        ctx.keys = keys
        ctx.save_for_backward(q_BNLH, k_BKLH, v_BKLH, out, lse)
        return out.to(q_BNLH.dtype)

    @staticmethod
    def backward(ctx: Any, dout_BNLH: torch.Tensor):
        with torch.autocast(dout_BNLH.device.type, enabled=False):
            keys: SubRingKeys = ctx.keys
            q_BNLH, k_BKLH, v_BKLH, out, lse = ctx.saved_tensors
            first = _first_hops(keys, k_BKLH, v_BKLH)  # in flight during the own tiles
            dq, dk, dv = block_backward(q_BNLH, k_BKLH, v_BKLH, out, dout_BNLH, lse, keys.own)
            sends: list[tuple[list[Any], torch.Tensor]] = []  # alive until delivered
            for part, (incoming, *requests) in zip(keys.rings, first):
                j, g = part.ring.index, part.ring.size
                pending_sum: list[Any] = []
                incoming_sum = None
                for hop in range(1, g):  # holding member j - hop's keys
                    wait_all(requests[0] + requests[1])
                    kv = incoming
                    if hop < g - 1:
                        incoming, *requests = _hop(part, kv, KV_TAG, j - hop, j - hop - 1)
                    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                    if part.tiles[hop - 1]:
                        dq_b, dkv[0], dkv[1] = block_backward(
                            q_BNLH, kv[0], kv[1], out, dout_BNLH, lse, part.tiles[hop - 1])
                        dq += dq_b
                    if hop >= 2:  # the previous members' share of this block's gradient
                        wait_all(pending_sum)
                        dkv += incoming_sum
                    # on to the next member; after g - 1 hops the sum reaches the owner
                    incoming_sum, sent, pending_sum = _hop(part, dkv, DKV_TAG, j - hop,
                                                           j - hop - 1)
                    sends.append((sent, dkv))
                wait_all(pending_sum)  # the other members' queries' gradient of my keys
                dk.index_add_(2, part.index, incoming_sum[0])
                dv.index_add_(2, part.index, incoming_sum[1])
            for posted, _ in sends:
                wait_all(posted)
        return dq.to(q_BNLH.dtype), dk.to(k_BKLH.dtype), dv.to(v_BKLH.dtype), None


def sub_ring_attention(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
                       keys: SubRingKeys) -> torch.Tensor:
    """Attention inside each document of this rank's shard (``[1, N, L, Hd]`` queries,
    un-repeated ``[1, K, L, Hd]`` keys and values): whole documents by the model's own
    document attention (what ``tokens`` runs), the others on the engine with their sub-rings
    (module docstring); ``keys`` from ``sub_ring_keys`` of the same forward. Remapped
    (``keys.remap``): the shard is the linear layout; q, k and v (RoPE already applied at each
    token's own position) go to the attention layout in one all-to-all, and the output comes
    back in another (``Remap``; their gradients the reverse way in backward)."""
    if keys.remap is None:
        return _attend(q_BNLH, k_BKLH, v_BKLH, keys)
    heads = (q_BNLH.shape[1], k_BKLH.shape[1], v_BKLH.shape[1])
    qkv = _relayout(torch.cat([q_BNLH, k_BKLH, v_BKLH], dim=1), keys.remap.to_attention,
                    keys.linear_real, keys.rows)
    out_BNLH = _attend(*qkv.split(heads, dim=1), keys)
    return _relayout(out_BNLH, keys.remap.to_linear, keys.attention_real, keys.linear_rows)


def _relayout(x_BHLH: torch.Tensor, move: Any, real: int, rows: int) -> torch.Tensor:
    """``x``'s first ``real`` rows (tokens, dim 2) through ``move`` (a ``Remap`` direction,
    on rows ``[L, H, Hd]``), then zero rows up to ``rows`` (a rank's padding slot)."""
    moved = move(x_BHLH[0, :, :real].transpose(0, 1))
    if rows > moved.shape[0]:
        moved = torch.cat([moved, moved.new_zeros((rows - moved.shape[0],) + moved.shape[1:])])
    return moved.transpose(0, 1).unsqueeze(0).contiguous()


def _attend(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
            keys: SubRingKeys) -> torch.Tensor:
    """``sub_ring_attention`` on the layout ``keys`` plans (the shard's, or the attention
    layout when remapped)."""
    if keys.whole is not None and len(keys.whole_index) == keys.rows:  # all whole, in order
        return keys.whole.attention(q_BNLH, k_BKLH, v_BKLH)
    # padding rows attend to nothing: output 0, in the graph (a shard of padding alone has a
    # backward too)
    out_BNLH = q_BNLH * 0
    for index, attend in ((keys.whole_index, keys.whole.attention if keys.whole else None),
                          (keys.ring_index, lambda *qkv: _SubRingAttention.apply(*qkv, keys))):
        if len(index):
            part = attend(*(t.index_select(2, index) for t in (q_BNLH, k_BKLH, v_BKLH)))
            out_BNLH = out_BNLH.index_copy(2, index, part)
    return out_BNLH


__all__ = ["KERNEL_SLOWDOWN", "REMAP_BYTE_FLOPS", "RING_CHUNK", "RING_CHUNK_EXPONENT",
           "RING_SLOWDOWN", "TILE_SLOWDOWN", "RemapPlacement", "RingPart", "SubRingKeys",
           "SubRings", "aligned_blocks", "cp_step_price", "document_runs",
           "merge_dp_microbatches", "model_token_costs", "new_sub_rings", "per_token_square",
           "place_over_cp", "ring_block", "sub_ring_attention", "sub_ring_keys",
           "tiled_attention", "with_remap", "zeppelin_shard_indices"]
