"""Documents under context parallelism: packed rows and varlen microbatches split over cp ranks.

``data.packing = pack | varlen`` gives rows whose documents must never attend across each
other (``loom.models.document_attention``). Under ``parallel.cp > 1`` a row is split over the cp
ranks; this module is what that needs beyond ``loom.parallel.context``:

**Sharding, per document** (``document_shard_indices``). A row is cut document by document (a
document is a run of equal ids; the padding run is one more): a document of L tokens is cut
into ``2r`` contiguous chunks (``r`` the ring degree) and ring group ``g`` takes chunks ``g``
and ``2r-1-g`` (zig-zag per document, so each group's causal work is balanced inside every
document, not only over the row). The chunks are ``L // 2r`` tokens long and the remainder's
``L % 2r`` tokens go one at a time to the groups in round-robin order, the turn carried from
one document to the next along the row (a group's first extra token joins its early chunk,
its second its late chunk): group token counts then differ by at most one per row, and a row
of ``S`` tokens, ``S`` a multiple of ``2r``, gives every group exactly ``S / r`` (``pack``'s rows).
A document shorter than ``2r`` tokens simply leaves some chunks empty: nothing is padded, and
the attention below stays exact because its masks come from document ids and positions, not
from the chunk layout. A group's tokens (document by document, early chunk then late chunk)
are padded at the end to a length ``L_g`` common to every row and group, a multiple of the
Ulysses degree ``u``, and its ``u`` ranks take consecutive ``L_g / u`` slices. For ``r = 1``
(Ulysses alone) this is contiguous sharding of the row (each document's two chunks are the
document), so the tokens a Ulysses group gathers are the row in global order.

**Padding** (only where a varlen microbatch's ``T`` tokens, or uneven group counts, need it):
a padding slot has input token 0, target ``IGNORE_INDEX`` (out of the loss and out of the
step's token count, which the trainer takes from the targets), position 0 and document id
``PAD_KEY`` (-1; real documents are renumbered as run ordinals >= 0 from the full row), so it
attends only to padding and nothing real attends to it: exact for every real token.

**Attention** (called by ``context.ContextParallelAttention`` with the ``DocumentMask`` of its
shard, which carries the shard's ids and positions): one all-gather over the cp group of the
shard's (document id, position) pairs, ``2 * B * S_loc`` int64 per rank, once per forward and
shared by every layer (``document_keys``; recomputation reuses it), gives every rank the keys
of every group. Then

* Ulysses only (``r = 1``): after the all-to-all a rank holds the whole row for its heads, in
  global order; the gathered ids make that row's ``DocumentMask`` and the ordinary document
  attention runs on it (CPU: causal SDPA per document; CUDA: FlexAttention), no ``[S, S]``
  mask;
* ring (and hybrid, after the Ulysses all-to-all inside each group): ``document_ring_attention``
  is the ring of ``loom.parallel.ring_attention`` (same key/value hops, same travelling dK/dV
  sum, same bytes) whose block from group ``g'`` is masked by
  ``id_q == id_k and position_k <= position_q``: attention inside each document, causal by
  position, whatever the chunk sizes. A block in which no query sees a key (no shared
  document) is skipped (its keys still travel). Block masks are ``[B, S_g, S_g]`` booleans per
  ring step, built once per forward; the block math is plain fp32 torch (the CPU flash kernel
  takes no mask). A varlen microbatch (``B = 1``) has its blocks cut per document instead
  (``document_tiles``: each document's queries against its own keys), so a block costs the sum
  of its documents' queries x keys rather than ``S_g²``: on ring step 0 each document is a
  causal tile on torch's kernel (``ring_attention.attend_block``); on the others a long
  document's chunk pairs are full (non-causal) tiles on it, and short documents share masked
  fp32 tiles of up to ``TILE_TOKENS`` queries. ``data.balance = zeppelin`` (``loom.parallel
  .zeppelin_cp``) runs its sub-rings' blocks with the same tiles (and its whole documents
  with no ring at all).

Why hand-written: torch's context parallelism has neither document masks nor a CPU backward.

Shape legend: B batch, N query heads, K key/value heads, G = N/K, S_g tokens of a ring group
(after Ulysses), Hd head dim, r ring degree, u Ulysses degree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loom.data.packing import IGNORE_INDEX, DocumentBatch
from loom.models.document_attention import DocumentMask
from loom.parallel import comm
from loom.parallel.comm import CommLedger
from loom.parallel.ring_attention import (GradientRelay, Ring, attend_block,
                                          attend_block_backward, attend_block_backward_math,
                                          attend_block_math, finite, ring_hops,
                                          zigzag_positions)

PAD_SLOT = -1  # a shard's gather index for a padding slot
PAD_KEY = -1  # the document id of cp padding; real documents are run ordinals >= 0


# -- sharding -----------------------------------------------------------------------------------
def _chunk_edges(start: int, length: int, ring: int, turn: int) -> tuple[np.ndarray, int]:
    """The ``2r + 1`` edges of a document's chunks, and the round-robin turn after it."""
    sizes = np.full(2 * ring, length // (2 * ring), dtype=np.int64)
    extra = length % (2 * ring)
    taken = np.zeros(ring, dtype=bool)
    for k in range(extra):  # at most two per group: extra < 2r
        group = (turn + k) % ring
        sizes[2 * ring - 1 - group if taken[group] else group] += 1
        taken[group] = True
    return start + np.concatenate([[0], np.cumsum(sizes)]), (turn + extra) % ring


def document_shard_indices(document_ids_BS: torch.Tensor, ring: int, ulysses: int,
                           cp_rank: int) -> torch.Tensor:
    """Which tokens of each row cp rank ``cp_rank`` holds, in order: int64 ``[B, L]`` indices
    into the row, ``PAD_SLOT`` for padding; ``L`` is the same on every cp rank (module
    docstring: per-document zig-zag over ``ring`` groups, each split ``ulysses`` ways)."""
    ids = document_ids_BS.cpu().numpy()
    B, S = ids.shape
    group_of, slot = divmod(cp_rank, ulysses)
    mine: list[np.ndarray] = []
    longest = 0
    for row in ids:
        bounds = np.append(np.flatnonzero(np.r_[True, row[1:] != row[:-1]]), S)
        parts: list[list[np.ndarray]] = [[] for _ in range(ring)]
        turn = 0
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            edges, turn = _chunk_edges(start, end - start, ring, turn)
            for g in range(ring):
                late = 2 * ring - 1 - g
                parts[g] += [np.arange(edges[g], edges[g + 1]),
                             np.arange(edges[late], edges[late + 1])]
        longest = max(longest, *(sum(len(p) for p in group) for group in parts))
        mine.append(np.concatenate(parts[group_of]))
    per_group = -(-longest // ulysses) * ulysses
    index = np.full((B, per_group), PAD_SLOT, dtype=np.int64)
    for b, tokens in enumerate(mine):
        index[b, :len(tokens)] = tokens
    per_rank = per_group // ulysses
    return torch.from_numpy(index[:, slot * per_rank:(slot + 1) * per_rank].copy()).to(
        document_ids_BS.device)


def run_ordinals(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Each token's run number in its row (0, 1, ...): ids that name a document uniquely in
    the row, whichever tokens of it a rank holds (raw ids need only differ between neighbours)."""
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    return starts_BS.long().cumsum(dim=1) - 1


def take_shard(batch: DocumentBatch, index_BL: torch.Tensor) -> DocumentBatch:
    """The rows of ``batch`` at ``index_BL`` (``document_shard_indices``), padding slots filled
    as the module docstring says; document ids become run ordinals."""
    pad_BL = index_BL == PAD_SLOT
    at_BL = index_BL.clamp(min=0)

    def take(values_BS: torch.Tensor, fill: int) -> torch.Tensor:
        return values_BS.gather(1, at_BL).masked_fill(pad_BL, fill)

    # the batch's own padding (a negative id: packed rows' tail) stays padding, as cp's does
    ordinals = run_ordinals(batch.document_ids).masked_fill(batch.document_ids < 0, PAD_KEY)
    return DocumentBatch(take(batch.inputs, 0), take(batch.targets, IGNORE_INDEX),
                         take(batch.positions, 0), take(ordinals, PAD_KEY))


# -- the keys every rank needs ------------------------------------------------------------------
TILE_TOKENS = 128  # a tile's documents are merged until its queries would pass this


@dataclass(frozen=True)
class Tile:
    """Part of one ring step's block: the queries ``q_index`` and keys ``k_index`` of one or a
    few documents present on both sides, and their mask ``[1, len(q_index), len(k_index)]``."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    allowed: torch.Tensor
    # "masked" (the fp32 math under ``allowed``); "causal" (the mask is exactly lower-triangular)
    # or "full" (every query sees every key): torch's kernel runs those two
    kernel: str = "masked"


def _position_runs(index: np.ndarray, positions: np.ndarray) -> list[np.ndarray]:
    """``index`` cut where the positions stop counting up by one (a document's chunks)."""
    cuts = np.flatnonzero(np.diff(positions[index]) != 1) + 1
    return np.split(index, cuts)


def _visible(ids_q: Any, pos_q: Any, ids_k: Any, pos_k: Any, window: int) -> Any:
    """Which keys each query sees (numpy or torch, the last two axes queries x keys): its own
    document, at or before its position, and inside the sliding window if there is one."""
    distance = pos_q[..., :, None] - pos_k[..., None, :]
    allowed = (ids_q[..., :, None] == ids_k[..., None, :]) & (distance >= 0)
    return allowed & (distance < window) if window else allowed


@dataclass(frozen=True)
class DocumentKeys:
    """What the cp core needs of one forward's documents: the whole row's ``DocumentMask``
    (Ulysses only) or the ring's blocks (one per ring step: ``None``, nothing visible; a dense
    mask, rows of ``B > 1``; or tiles, a varlen microbatch's single row)."""

    whole: DocumentMask | None
    block_masks: tuple[Any, ...]


def document_tiles(ids_q: np.ndarray, pos_q: np.ndarray, ids_k: np.ndarray, pos_k: np.ndarray,
                   device: torch.device, tile_tokens: int = TILE_TOKENS,
                   own_keys: bool = False, window: int = 0) -> tuple[Tile, ...]:
    """One row's block cut per document: for every real document (id >= 0; cp padding sees
    nothing and is seen by nothing real) present among the queries and the keys, its queries
    against its keys, consecutive documents merged while the tile's queries stay within
    ``tile_tokens`` (fewer small kernels; the mask keeps them apart). The block's work is then
    ~ the sum over its documents of queries x keys, not ``S_q x S_k``: a short document whole
    on one rank costs its own square only (``data.balance = zeppelin``'s sub-rings cut their
    blocks with it too).

    ``own_keys``: the keys are the queries' own tokens (ring step 0). A document whose tokens
    there are in increasing position (always: whole, or its two zig-zag chunks in order) has
    the mask ``position_k <= position_q`` = lower-triangular: it gets a tile of its own,
    ``causal``, which runs on torch's causal kernel (``ring_attention.attend_block``).

    Other keys: a document with at least ``tile_tokens`` queries here is cut into its chunks
    (runs of consecutive positions) on both sides; a chunk pair is either fully visible (every
    key at or before the first query) or not at all (chunks of different ranks never overlap),
    so it becomes a ``full`` tile on torch's kernel, or nothing; a pair that overlaps (not made
    by the cp sharding) keeps the document masked.

    ``window`` W > 0 (sliding-window attention): a key is also visible only while
    ``position_q - position_k < W``. A causal tile stays one while its document's span here is
    under W, a full chunk pair while its farthest pair is; a pair wholly past the window is
    dropped (nothing computed), and the rest are masked tiles with the window in their mask. On
    ring step 0 a document of at least ``tile_tokens`` queries spanning more than W is cut into
    its chunks the same way (``_windowed_own_tiles``), so a zig-zag shard's two far-apart
    chunks cost two chunk-sized tiles, not one tile of the whole shard."""
    def runs(ids: np.ndarray) -> dict[int, np.ndarray]:
        order = np.argsort(ids, kind="stable")
        values, starts = np.unique(ids[order], return_index=True)
        return {int(v): part for v, part in zip(values, np.split(order, starts[1:]))}

    keys = runs(ids_k)
    queries = runs(ids_q)
    shared = [d for d in dict.fromkeys(ids_q.tolist()) if d >= 0 and d in keys]
    tiles = []
    if own_keys:
        rest = []
        for d in shared:
            qi = queries[d]
            ordered = np.array_equal(qi, keys[d]) and bool(np.all(np.diff(pos_q[qi]) > 0))
            if ordered and not (window and pos_q[qi[-1]] - pos_q[qi[0]] >= window):
                tiles.append(_whole_tile(qi, qi, "causal", device))
            elif ordered and len(qi) >= tile_tokens:  # a window shorter than the document here
                tiles += _windowed_own_tiles(qi, ids_q, pos_q, window, device)
            else:
                rest.append(d)
        shared = rest
    else:
        rest = []
        for d in shared:
            if len(queries[d]) < tile_tokens:
                rest.append(d)
                continue
            pairs, overlap = [], False
            for q_run in _position_runs(queries[d], pos_q):
                for k_run in _position_runs(keys[d], pos_k):
                    nearest = pos_q[q_run[0]] - pos_k[k_run[-1]]
                    farthest = pos_q[q_run[-1]] - pos_k[k_run[0]]
                    if window and nearest >= window:
                        continue  # every key of the pair is past every query's window
                    if nearest >= 0 and not (window and farthest >= window):
                        pairs.append((q_run, k_run))
                    elif farthest >= 0:
                        overlap = True
            if overlap:
                rest.append(d)
                continue
            tiles += [_whole_tile(q_run, k_run, "full", device) for q_run, k_run in pairs]
        shared = rest
    groups: list[list[int]] = []
    count = 0
    for d in shared:
        n = len(queries[d])
        if not groups or count + n > tile_tokens:
            groups.append([])
            count = 0
        groups[-1].append(d)
        count += n
    for docs in groups:
        qi = np.concatenate([queries[d] for d in docs])
        ki = np.concatenate([keys[d] for d in docs])
        allowed = _visible(ids_q[qi], pos_q[qi], ids_k[ki], pos_k[ki], window)
        if allowed.any():
            tiles.append(_masked_tile(qi, ki, allowed, device))
    return tuple(tiles)


def _whole_tile(q: np.ndarray, k: np.ndarray, kernel: str, device: torch.device) -> Tile:
    """Queries ``q`` against keys ``k`` through torch's kernel (``causal`` or ``full``)."""
    return Tile(torch.from_numpy(q).to(device), torch.from_numpy(k).to(device),
                torch.ones(1, 1, 1, dtype=torch.bool, device=device), kernel)


def _masked_tile(q: np.ndarray, k: np.ndarray, allowed: np.ndarray, device: torch.device) -> Tile:
    """Queries ``q`` against keys ``k`` under the boolean mask ``allowed`` (queries x keys)."""
    return Tile(torch.from_numpy(q).to(device), torch.from_numpy(k).to(device),
                torch.from_numpy(allowed)[None].to(device))


def _windowed_own_tiles(index: np.ndarray, ids: np.ndarray, pos: np.ndarray, window: int,
                        device: torch.device) -> list[Tile]:
    """A document's own keys (positions increasing along ``index``) under a window shorter than
    its span here: cut into its runs (its zig-zag chunks), each run against itself causal while
    its span is inside the window, each against an earlier run full while wholly inside it,
    nothing when wholly past it, and a masked tile of the pair only at the window's edge."""
    tiles = []
    runs = _position_runs(index, pos)
    for qi, q_run in enumerate(runs):
        for k_run in runs[:qi + 1]:
            nearest = pos[q_run[0]] - pos[k_run[-1]]  # negative on the diagonal
            farthest = pos[q_run[-1]] - pos[k_run[0]]
            if k_run is not q_run and nearest >= window:
                continue
            if farthest < window:
                tiles.append(_whole_tile(q_run, k_run, "causal" if k_run is q_run else "full",
                                         device))
                continue
            allowed = _visible(ids[q_run], pos[q_run], ids[k_run], pos[k_run], window)
            if allowed.any():
                tiles.append(_masked_tile(q_run, k_run, allowed, device))
    return tiles


def document_keys(documents: DocumentMask, group: Any, ring: int, ulysses: int, ring_index: int,
                  ledger: CommLedger | None = None, axis: str = "cp",
                  window: int = 0) -> DocumentKeys:
    """All-gather the shard's (document id, position) pairs over the cp group (one call of
    ``2 * B * S_loc`` int64 per rank) and derive the row's mask or the ring's block masks
    (with a sliding ``window``, in them; the row's mask takes it at attention time)."""
    positions = documents.known_positions
    if positions is None:
        raise ValueError("context-parallel document attention needs each token's position in"
                         " its document (Transformer.forward(positions=..., document_ids=...))")
    B, S_loc = documents.shape
    mine = torch.stack([documents.document_ids.long(), positions.expand(B, S_loc).long()])
    # [cp * 2, B, S_loc]: gloo's all-gather wants the ranks' tensors stacked along dim 0
    gathered = torch.empty((ring * ulysses * 2, B, S_loc), dtype=mine.dtype, device=mine.device)
    comm.all_gather_into_tensor(gathered, mine.contiguous(), group, axis=axis, ledger=ledger)
    # cp rank = ring group * u + Ulysses rank; a group's tokens are its ranks' shards in order
    by_group = gathered.view(ring, ulysses, 2, B, S_loc).permute(0, 2, 3, 1, 4).reshape(
        ring, 2, B, ulysses * S_loc)
    if ring == 1:
        return DocumentKeys(DocumentMask(by_group[0, 0]), ())
    ids_q, pos_q = by_group[ring_index]
    masks: list[Any] = []
    if B == 1:  # a varlen microbatch: each block cut per document (document_tiles)
        q_np = ids_q[0].cpu().numpy(), pos_q[0].cpu().numpy()
        for step in range(ring):
            ids_k, pos_k = by_group[(ring_index - step) % ring]
            tiles = document_tiles(*q_np, ids_k[0].cpu().numpy(), pos_k[0].cpu().numpy(),
                                   ids_q.device, own_keys=step == 0, window=window)
            masks.append(tiles or None)
        return DocumentKeys(None, tuple(masks))
    for step in range(ring):
        ids_k, pos_k = by_group[(ring_index - step) % ring]
        allowed = _visible(ids_q, pos_q, ids_k, pos_k, window)
        masks.append(allowed if bool(allowed.any()) else None)
    return DocumentKeys(None, tuple(masks))


def window_keys(seq_len: int, ring: int, ring_index: int, window: int,
                device: torch.device) -> DocumentKeys:
    """The ring's blocks for concatenated rows (every row one sequence at positions 0..S-1,
    sharded zig-zag as ``ring_attention`` shards it) under a sliding ``window``: the whole row
    is one document to ``document_tiles``, so a block wholly past the window is skipped, one
    wholly inside it runs on torch's kernel (causal on the diagonal, full elsewhere), and the
    window's edge is a masked tile. Every row has the same positions, so the tiles serve all
    of them. Nothing is communicated: the positions follow from the layout."""
    pos_q = zigzag_positions(seq_len, ring_index, ring).numpy()
    zeros = np.zeros(len(pos_q), dtype=np.int64)
    masks = []
    for step in range(ring):
        pos_k = zigzag_positions(seq_len, (ring_index - step) % ring, ring).numpy()
        masks.append(document_tiles(zeros, pos_q, zeros, pos_k, device, own_keys=step == 0,
                                    window=window) or None)
    return DocumentKeys(None, tuple(masks))


# -- the ring, masked per document --------------------------------------------------------------
def merge_masked(out_BNSH: torch.Tensor, lse_BNS: torch.Tensor, block_out_BNSH: torch.Tensor,
                 block_lse_BNS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring_attention.merge_block`` where either side may have seen no key yet (``-inf``)."""
    lse = torch.logaddexp(lse_BNS, block_lse_BNS)
    base = finite(lse)
    out = (out_BNSH * torch.exp(lse_BNS - base).unsqueeze(-1)
           + block_out_BNSH * torch.exp(block_lse_BNS - base).unsqueeze(-1))
    return out, lse


def block_forward(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                  block: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output ``[B, N, Sq, Hd]`` and log-sum-exp ``[B, N, Sq]`` (fp32) under a dense
    per-row mask (``attend_block_math``: a row that sees no key gets output 0 and log-sum-exp
    ``-inf``), or under tiles (rows in no tile: the same)."""
    if not isinstance(block, tuple):
        return attend_block_math(q_BNSH, k_BKSH, v_BKSH, False, block)
    B, N, S, Hd = q_BNSH.shape
    out = q_BNSH.new_zeros((B, N, S, Hd), dtype=torch.float32)
    lse = q_BNSH.new_full((B, N, S), float("-inf"), dtype=torch.float32)
    for tile in block:
        q, k, v = (q_BNSH[:, :, tile.q_index], k_BKSH[:, :, tile.k_index],
                   v_BKSH[:, :, tile.k_index])
        if tile.kernel == "masked":
            o, l = attend_block_math(q, k, v, False, tile.allowed)
        else:
            o, l = attend_block(q, k, v, tile.kernel == "causal")
        # a query's keys may span several tiles of one document (full tiles): merge them
        out[:, :, tile.q_index], lse[:, :, tile.q_index] = merge_masked(
            out[:, :, tile.q_index], lse[:, :, tile.q_index], o, l)
    return out, lse


def block_backward(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                   out_BNSH: torch.Tensor, dout_BNSH: torch.Tensor, lse_BNS: torch.Tensor,
                   block: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash-attention backward of one block under a dense per-row mask, given the rows'
    final output and log-sum-exp (finite: every token sees itself): ``dq``, ``dk``, ``dv`` in
    fp32; or under tiles (added back: a tile's queries and keys belong to its documents only;
    only a document's full tiles share rows)."""
    if not isinstance(block, tuple):
        return attend_block_backward_math(q_BNSH, k_BKSH, v_BKSH, out_BNSH, dout_BNSH, lse_BNS,
                                          False, block)
    dq = torch.zeros(q_BNSH.shape, dtype=torch.float32, device=q_BNSH.device)
    dk = torch.zeros(k_BKSH.shape, dtype=torch.float32, device=k_BKSH.device)
    dv = torch.zeros_like(dk)
    for tile in block:
        qi, ki = tile.q_index, tile.k_index
        args = (q_BNSH[:, :, qi], k_BKSH[:, :, ki], v_BKSH[:, :, ki], out_BNSH[:, :, qi],
                dout_BNSH[:, :, qi], lse_BNS[:, :, qi].contiguous())
        if tile.kernel == "masked":
            dq_t, dk_t, dv_t = attend_block_backward_math(*args, False, tile.allowed)
        else:
            dq_t, dk_t, dv_t = attend_block_backward(*args, tile.kernel == "causal")
        dq.index_add_(2, qi, dq_t)  # full tiles of one document share rows
        dk.index_add_(2, ki, dk_t)
        dv.index_add_(2, ki, dv_t)
    return dq, dk, dv


class _DocumentRing(torch.autograd.Function):
    """``ring_attention._RingAttention`` with a mask per ring step instead of zig-zag halves:
    the same hops, tags and travelling dK/dV sum."""

    @staticmethod
    def forward(ctx: Any, q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                ring: Ring, masks: tuple[Any, ...]) -> torch.Tensor:
        with torch.autocast(q_BNSH.device.type, enabled=False):  # fp32 softmax statistics
            B, N, S, Hd = q_BNSH.shape
            out = torch.zeros(B, N, S, Hd, dtype=torch.float32, device=q_BNSH.device)
            lse = torch.full((B, N, S), float("-inf"), dtype=torch.float32, device=q_BNSH.device)
            for step, kv in ring_hops(ring, torch.stack([k_BKSH, v_BKSH]).contiguous()):
                if masks[step] is not None:
                    out, lse = merge_masked(out, lse, *block_forward(q_BNSH, kv[0], kv[1],
                                                                     masks[step]))
        ctx.ring, ctx.masks = ring, masks
        ctx.save_for_backward(q_BNSH, k_BKSH, v_BKSH, out, lse)
        return out.to(q_BNSH.dtype)

    @staticmethod
    def backward(ctx: Any, dout_BNSH: torch.Tensor):
        with torch.autocast(dout_BNSH.device.type, enabled=False):
            q_BNSH, k_BKSH, v_BKSH, out, lse = ctx.saved_tensors
            dq = torch.zeros_like(out)
            relay = GradientRelay(ctx.ring)  # the block's dK/dV, on to its owner
            for step, kv in ring_hops(ctx.ring, torch.stack([k_BKSH, v_BKSH]).contiguous()):
                dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
                if ctx.masks[step] is not None:
                    dq_b, dkv[0], dkv[1] = block_backward(
                        q_BNSH, kv[0], kv[1], out, dout_BNSH, lse, ctx.masks[step])
                    dq += dq_b
                relay.add(step, dkv)
            own = relay.total()
        return (dq.to(q_BNSH.dtype), own[0].to(k_BKSH.dtype), own[1].to(v_BKSH.dtype), None,
                None)


def document_ring_attention(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                            ring: Ring, keys: DocumentKeys) -> torch.Tensor:
    """Attention inside each document of this ring group's tokens against the whole ring's
    (module docstring); ``keys`` from ``document_keys`` of the same forward."""
    return _DocumentRing.apply(q_BNSH, k_BKSH, v_BKSH, ring, keys.block_masks)


__all__ = ["DocumentKeys", "PAD_KEY", "PAD_SLOT", "TILE_TOKENS", "Tile", "block_backward",
           "block_forward", "document_keys", "document_ring_attention", "document_shard_indices",
           "document_tiles", "merge_masked", "run_ordinals", "take_shard", "window_keys"]
