"""``data.balance = zeppelin`` at run time: each varlen microbatch placed over the cp ranks.

``data.balance = tokens`` deals a step's pieces into microbatches of nearly equal tokens; under
context parallelism (``parallel.cp > 1``) the default sharding (``context_documents
.document_shard_indices``) then cuts *every* document zig-zag over all cp ranks. ``zeppelin``
deals the same microbatches, and places each one's documents over its cp ranks by the
Zeppelin planner (``loom.data.zeppelin``, Chen et al. 2025): a document either whole on one
rank (short ones: no ring work at all) or zig-zag over an aligned power-of-two group of ranks
(long ones), chosen so the ranks' attention work (~ s² per document, s²/g per rank of a group
of g) and linear work (~ tokens) are balanced. The placement is a pure function of the
microbatch's piece lengths, computed alike on every rank: nothing is communicated to agree.

The attention that runs it is the existing masked document ring over the whole cp group
(``context_documents.document_ring_attention``), with each block cut per document
(``document_tiles``): a rank's block against a peer's keys has work only where the two share a
document, so a document whole on one rank costs its own square on that rank (torch's causal
kernel) and nothing on the others, and a group's document costs each of its ranks one causal
tile and ``g - 1`` blocks of ``(s/g)²`` (torch's kernel for a long one's chunk pairs). **The
communication is still the full ring's** (every rank's keys and values make every hop, and the
key/value gradients travel back the same way): this is Zeppelin's compute balance without its
sub-ring communication savings, and without its remapping layer (``loom.parallel.remap`` is
not wired into the model): every rank's shard is padded to the longest rank's token count
(padding: ``context_documents``' rules, out of attention and out of the loss), so the linear
modules run on that many rows everywhere.

The placement is therefore priced as it runs: attention waits for the busiest rank (the ring
synchronises every layer), priced per tile (``tiled_attention``: a document cut over more ranks
than its length needs costs each of them a whole tile), and the linear stage for the longest
shard, ``max(attention) + max(tokens) x linear``; the candidates are the planner's
(``zeppelin_candidates``, both with the linear work balanced per rank and with attention
alone), its ``tokens`` deal and static cp (every document over all cp ranks, the default
sharding's placement), and the cheapest wins (ties: the first), so on this cost model a
placement is never worse than static cp.
Costs (``model_token_costs``) are flop counts of the model's shape, forward and backward.

Hand-written: no library places variable-length sequences over a context-parallel ring.
"""

from __future__ import annotations

import numpy as np
import torch

from loom.data.zeppelin import (Partition, Ranks, TokenCosts, partition_static_cp,
                                zeppelin_candidates)
from loom.models.args import TransformerArgs
from loom.parallel.context_documents import PAD_SLOT, TILE_TOKENS


ATTENTION_SLOWDOWN = 4.5  # the masked fp32 tiles' time per flop / the linear GEMMs' (CPU)


def model_token_costs(args: TransformerArgs,
                      attention_slowdown: float = ATTENTION_SLOWDOWN) -> TokenCosts:
    """Flops of one token through the linear modules (projections, MLP, output head) and of
    one query-key pair of attention (scores and weighted values), forward and backward (x3),
    over every layer; attention's weighted by ``attention_slowdown``, how much slower per flop
    the masked tiles run than the linear modules (fp32 masked scores, exp and small matmuls:
    2.4x to 4.5x on this machine's CPU, load-dependent, ``bench/varlen.py --calibrate``).
    Only the ratio matters to the placement, and it is a constant, not a per-run measurement:
    every rank must compute the same placement."""
    d, layers = args.dim, args.n_layers
    kv = d * args.n_kv_heads // args.n_heads
    per_layer = 2 * d * d + 2 * d * kv + args.mlp_matrices * d * args.ffn_dim  # q, o; k, v; MLP
    linear = 3 * 2 * (layers * per_layer + d * args.vocab_size)
    attention = 3 * 4 * d * layers * attention_slowdown  # q.k and p.v, 2 flops per mul-add
    return TokenCosts(linear=float(linear), attention=float(attention))


def tiled_attention(partition: Partition, tile_tokens: int = TILE_TOKENS,
                    slowdown: float = ATTENTION_SLOWDOWN) -> np.ndarray:
    """Each rank's attention work on the tiled ring, in ``costs.attention`` units (the masked
    tiles' pairs): a document of ``s`` tokens on a group of ``g`` ranks gives each of them its
    own causal tile of ``s/g`` tokens (torch's causal kernel: (s/g)²/2 pairs at the linear
    modules' speed, ``1 / slowdown`` of a masked pair) and ``g - 1`` blocks against the other
    ranks' chunks: full tiles on the same kernel (half the pairs visible) when its ``s/g``
    queries reach ``tile_tokens``, else a masked tile of at least ``tile_tokens`` keys (small
    documents share one, whose masked pairs are computed too): a document whole on one rank
    costs the causal kernel only, one cut over more ranks than its length needs pays masked
    tiles on each."""
    load = np.zeros(partition.ranks.count)
    for n, b, g in zip(partition.lengths, partition.start, partition.size):
        chunk = n / g
        remote = (chunk * chunk / (2 * slowdown) if chunk >= tile_tokens  # full tiles
                  else chunk * tile_tokens)  # masked, in a shared tile
        load[b:b + g] += chunk * chunk / (2 * slowdown) + (g - 1) * remote
    return load * partition.costs.attention


def cp_step_price(partition: Partition) -> float:
    """A placement's time on the cp runtime (module docstring): the busiest rank's attention
    (``tiled_attention``) plus the longest shard's linear work (every shard is padded to it)."""
    return float(tiled_attention(partition).max()
                 + partition.rank_tokens().max() * partition.costs.linear)


def place_over_cp(lengths: list[int] | np.ndarray, cp: int, costs: TokenCosts) -> Partition:
    """The placement of one microbatch's documents (``lengths``, in row order) over ``cp``
    ranks: the cheapest candidate by ``cp_step_price`` (module docstring)."""
    seqs = [int(n) for n in lengths]
    ranks = Ranks(cp, per_node=cp)  # one machine's ranks: every group inside a node
    candidates = (zeppelin_candidates(seqs, ranks, costs, remap=False)
                  + zeppelin_candidates(seqs, ranks, costs, remap=True)
                  + [partition_static_cp(seqs, ranks, cp, costs)])
    return min(candidates, key=cp_step_price)


def document_runs(document_ids_S: np.ndarray) -> list[int]:
    """The lengths of the row's runs of equal ids (its documents, in order)."""
    starts = np.flatnonzero(np.r_[True, document_ids_S[1:] != document_ids_S[:-1]])
    return np.diff(np.append(starts, len(document_ids_S))).tolist()


def zeppelin_shard_indices(document_ids_BS: torch.Tensor, cp: int, cp_rank: int,
                           costs: TokenCosts) -> torch.Tensor:
    """Which tokens of a varlen microbatch (``[1, S]``) cp rank ``cp_rank`` holds: int64
    ``[1, L]`` indices into the row (``place_over_cp``'s ``token_indices``), ``PAD_SLOT`` after
    them up to ``L``, the longest rank's token count (the ring passes equal shapes)."""
    if document_ids_BS.shape[0] != 1:
        raise ValueError(f"data.balance = zeppelin places a varlen microbatch (one row), not"
                         f" {document_ids_BS.shape[0]} rows")
    partition = place_over_cp(document_runs(document_ids_BS[0].cpu().numpy()), cp, costs)
    mine = partition.token_indices(cp_rank)
    index = np.full((1, int(partition.rank_tokens().max())), PAD_SLOT, dtype=np.int64)
    index[0, :len(mine)] = mine
    return torch.from_numpy(index).to(document_ids_BS.device)


__all__ = ["ATTENTION_SLOWDOWN", "cp_step_price", "document_runs", "model_token_costs",
           "place_over_cp", "tiled_attention", "zeppelin_shard_indices"]
