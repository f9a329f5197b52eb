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
  every rank, so ranks in several rings cannot wait on each other in a cycle. Forward and
  backward are one autograd ``Function``, so the order does not depend on autograd's.
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
measures that choice at cp = 4). With tp and pp the domain is per (tp, pp) coordinate, as the
cp ring is: the domain groups (``RankGrid.groups(dp axes, "cp")``) are one per tp index and
stage, every tp rank and stage of a domain rank merges and places the same microbatches (the
loader deals each of them every bin of the step), and a stage's messages to the next go
between ranks of one domain index, which hold the same shard; the schedule runs its ``M``
microbatches as with ``tokens`` (tests/dist/test_zeppelin_dp.py: dp x tp with SP off and on,
dp x pp with 1f1b and ZB-H1, and the three-axis composites).

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
Every candidate is then priced remapped (``zeppelin_placement.cp_step_price``): the busiest
rank's attention plus the equal split's linear work plus the busiest rank's remapped bytes
(``REMAP_BYTE_FLOPS``, measured by bench/remap_price.py). With tp and pp it runs unchanged:
the all-to-alls go over the domain group of the rank's own (tp, pp) coordinate (the cp group
the core is given), each tp rank moving its shard of the heads (under SP the attention core
sees the whole linear shard, SP splitting it only around the blocks), and each stage remaps
inside its own layers and passes the linear shard on (tests/dist/test_zeppelin_dp.py's remap
section).

How a placement is chosen and priced: ``loom.parallel.zeppelin_placement``.

Hand-written: no library places variable-length sequences over a context-parallel ring, nor
runs ring attention over several sub-rings of one cp group side by side (torch's context
parallelism has one ring and no document masks).

Shape legend: B batch (1: a varlen microbatch), N query heads, K key/value heads, L this
rank's tokens, n a member's tokens of one ring's documents, Hd head dim, g a ring's size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from loom.data.zeppelin import TokenCosts
from loom.models.document_attention import DocumentMask
from loom.parallel import comm
from loom.parallel.comm import CommLedger
from loom.parallel.context_documents import (PAD_KEY, Tile, block_backward, block_forward,
                                             document_tiles, merge_masked)
from loom.parallel.remap import Remap, build_remap
from loom.parallel.ring_attention import DKV_TAG, KV_TAG, Ring, wait_all
from loom.parallel.zeppelin_placement import place_over_cp


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
    window: int = 0  # model.sliding_window (0: none), in the tiles and for the whole documents


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
                  ledger: CommLedger | None = None, axis: str = "cp",
                  window: int = 0) -> SubRingKeys:
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
        return _plan(ids, pos, sub_rings, ledger, axis, device, window)
    return _remapped_plan(ids, pos, sub_rings, cp_group, ledger, axis, device, window)


def _remapped_plan(ids: list[np.ndarray], pos: list[np.ndarray], sub_rings: SubRings,
                   cp_group: Any, ledger: CommLedger | None, axis: str,
                   device: torch.device, window: int = 0) -> SubRingKeys:
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
    keys = _plan(ids_a, pos_a, sub_rings, ledger, axis, device, window)
    remap = build_remap(attention, me, cp_group, linear, ledger=ledger)
    return replace(keys, remap=remap, attention_real=len(attention[me]),
                   linear_rows=len(ids[me]), linear_real=len(linear[me]))


def _plan(ids: list[np.ndarray], pos: list[np.ndarray], sub_rings: SubRings,
          ledger: CommLedger | None, axis: str, device: torch.device,
          window: int = 0) -> SubRingKeys:
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
    own = document_tiles(ids_e[me], pos_e[me], ids_e[me], pos_e[me], device, own_keys=True,
                         window=window)
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
                                        pos_e[src][held[src - start]], device, window=window))
        ring = Ring(sub_rings.group((start, size)), sub_rings.members[start:start + size], j,
                    ledger, axis)
        rings.append(RingPart(ring, tuple(int(h.sum()) for h in held),
                              torch.from_numpy(np.flatnonzero(held[j])).to(device),
                              tuple(tiles)))
    return SubRingKeys(len(ids[me]), whole, torch.from_numpy(whole_rows).to(device),
                       torch.from_numpy(engine_rows[me]).to(device), own, tuple(rings),
                       window=window)


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
    whole = (functools.partial(keys.whole.attention, window=keys.window)
             if keys.whole is not None else None)
    if whole is not None and len(keys.whole_index) == keys.rows:  # all whole, in order
        return whole(q_BNLH, k_BKLH, v_BKLH)
    # padding rows attend to nothing: output 0, in the graph (a shard of padding alone has a
    # backward too)
    out_BNLH = q_BNLH * 0
    for index, attend in ((keys.whole_index, whole),
                          (keys.ring_index, lambda *qkv: _SubRingAttention.apply(*qkv, keys))):
        if len(index):
            part = attend(*(t.index_select(2, index) for t in (q_BNLH, k_BKLH, v_BKLH)))
            out_BNLH = out_BNLH.index_copy(2, index, part)
    return out_BNLH


__all__ = ["RemapPlacement", "RingPart", "SubRingKeys", "SubRings", "aligned_blocks",
           "new_sub_rings", "ring_block", "sub_ring_attention", "sub_ring_keys", "with_remap"]
