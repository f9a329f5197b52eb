"""Where ``data.balance = zeppelin`` puts a varlen microbatch's documents, and what that costs.

The placement half of Zeppelin at run time (``loom.parallel.zeppelin_cp`` is the attention
engine that runs it): a pure function of the microbatch's piece lengths and the model's shape,
computed alike on every rank, so nothing is communicated to agree. ``place_over_cp`` picks the
cheapest of the planner's candidates (``loom.data.zeppelin``), its ``tokens`` deal and static
cp; ``zeppelin_shard_indices`` is the tokens a rank holds (the attention layout, or with
``data.zeppelin_remap`` the linear layout); ``merge_dp_microbatches`` makes the dp x cp
domain's merged microbatches.

Without the remapping layer (the default), a rank's linear work is its own tokens', so a placement is priced as the busiest rank's attention
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

Hand-written: no library places variable-length sequences over a context-parallel ring. Torch
only here, no process groups.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from loom.data.packing import DocumentBatch
from loom.data.varlen import VarlenBatch
from loom.data.zeppelin import (Partition, Ranks, TokenCosts, partition_static_cp,
                                zeppelin_candidates)
from loom.models.args import TransformerArgs
from loom.parallel.context_documents import PAD_SLOT, TILE_TOKENS


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
# rank sends or receives: their ratio measured by bench/remap_price.py on this 2-core machine
# (load ~1, tiny preset, 4 gloo ranks): one thread's fp32 projections at 110-146 GFLOP/s, an
# all-to-all at 0.69-0.87 GB/s sent per rank, 160-169 flops per byte at 512-2048 rows (the
# earlier estimate, 40, assumed 40 GFLOP/s and 1 GB/s). A GPU's ratio differs: rerun there.
REMAP_BYTE_FLOPS = 160.0


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


__all__ = ["KERNEL_SLOWDOWN", "REMAP_BYTE_FLOPS", "RING_CHUNK", "RING_CHUNK_EXPONENT",
           "RING_SLOWDOWN", "TILE_SLOWDOWN", "cp_step_price", "document_runs",
           "merge_dp_microbatches", "model_token_costs", "per_token_square", "place_over_cp",
           "tiled_attention", "zeppelin_shard_indices"]
