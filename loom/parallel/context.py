"""Context parallelism on the ``cp`` mesh axis: the sequence of every sample is split over cp ranks.

Four modes, one layout ``CPLayout(size=cp, ulysses=u)`` with ``cp = u * r``:

=========  ====  ====  ==========================================================================
mode       u     r     attention
=========  ====  ====  ==========================================================================
ulysses    cp    1     all-to-all sequence shards -> head shards, local causal attention, back
ring       1     cp    ring attention over zig-zag shards (``loom.parallel.ring_attention``)
hybrid     u     cp/u  Ulysses inside groups of u consecutive cp ranks, ring across the r groups
allgather  1     cp    the ring's zig-zag shards, keys and values all-gathered at once
                       (``loom.parallel.allgather_attention``; ``CPLayout.gather``)
=========  ====  ====  ==========================================================================

Sharding (``sequence_positions``): the sequence is cut into ``2r`` chunks, ring group ``j`` holds
chunks ``j`` and ``2r-1-j`` (zig-zag, so causal work is balanced) and the ``u`` ranks of the
group hold consecutive ``1/u`` slices of that pair. For ``r = 1`` this is plain contiguous
sharding, which is what Ulysses wants: its all-to-all gathers the group's tokens in rank order,
so the gathered sequence is in global order and the ordinary causal mask is right. Inputs and
targets are sharded identically; RoPE gets the global ``positions``.

Collectives per layer, per rank (S_loc = S/cp tokens, fp32 4-byte elements, N/K query/kv heads
local to the cp group, Hd head dim), all counted in the ``CommLedger`` under axis ``cp``:

* Ulysses forward: 4 all-to-alls (q, k, v, out) of ``B*S_loc*(2N+2K)*Hd`` elements in all;
  backward: the same 4 inverse all-to-alls on the gradients. Wire bytes ``(u-1)/u`` of that.
* ring forward: ``r-1`` sends of the key/value block ``2*B*(K/u)*(S/r)*Hd``; backward
  ``2(r-1)`` sends of that size (key/value again, and the travelling dK/dV sum).
* MoE layers (dropless): one all-reduce per MoE layer per forward of the balancing loss's
  per-sequence statistics f and P (``[2, B, E]`` fp32, 8*B*E bytes, wire ``2(cp-1)/cp`` of that),
  averaged over cp (``SequenceStatisticsMean``); nothing in backward (see there). With
  documents, each document's assignment and token counts summed instead
  (``DocumentCountsSum``: ``[B, documents, E + 1]`` fp32 per MoE layer, plus one scalar
  all-reduce per forward).
* Gradients of the (replicated) parameters: averaged over cp, by ``reduce_gradients_over_cp``
  (one all-reduce per parameter) or, in the trainer, by the data-parallel reducer over the flattened ``dp x cp`` group.

The loss is the mean over local tokens; every cp rank has the same token count, so the mean of
the cp ranks' losses is the global mean, and averaging gradients over cp gives its gradient.

Documents (``data.packing = pack | varlen``; ``loom.parallel.context_documents``): rows are cut
per document, not per row (``shard_documents``: each document zig-zag over the ring groups,
padding only where a varlen microbatch or uneven document lengths need it, kept out of
attention and out of the loss), and the core gets the shard's ``DocumentMask`` (ids and
positions). Ulysses alone runs the ordinary document attention on the gathered row; the ring
(and hybrid) masks each block by ``same document and position_k <= position_q``, and so does
all-gather for each gathered rank's block (``document_allgather_attention``). Added
communication: one all-gather over cp of the shard's (id, position) pairs per forward,
``2*B*S_loc`` int64 per rank, shared by every layer; the all-to-alls and ring sends are the
ones above. Ranks then hold different numbers of real tokens, so the trainer's loss is the
token-weighted one of packed rows: each rank's sum over its real tokens, divided by the
step's real tokens counted over dp x cp (one scalar all-reduce) and multiplied by dp x cp,
which the gradient average over dp x cp turns into the step's token mean. Under ``data.balance
= zeppelin`` (``new_cp_groups(sub_rings=True)``) a varlen microbatch's shards are the Zeppelin
placement's (whole documents on one rank, long ones over an aligned group), unpadded, and the
core runs ``zeppelin_cp.sub_ring_attention``: each group's ring on its own process group,
nothing sent for whole documents.

Sliding-window attention (``model.sliding_window``): the Ulysses core sees the whole sequence
in global order and applies the window there. A ring (or all-gather) of degree > 1 runs each
block under the window too: the blocks' masks come from the tokens' positions
(``context_documents.window_keys`` for concatenated rows, the documents' own masks otherwise),
so a block wholly past the window is skipped (its keys still travel) and one wholly inside it
keeps torch's kernel; only the window's edge runs as a masked fp32 tile.

Degree 1: ``apply_context_parallel`` returns the model untouched; nothing is communicated.
Why hand-written: torch's context parallelism has no CPU backward and no causal load balancing
we can run on gloo. The model never imports any of this: only ``Attention.core`` is swapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import weakref

import torch
import torch.distributed as dist
from torch import nn

from loom.data.packing import DocumentBatch
from loom.layout import CPLayout, check_layout  # noqa: F401 (re-exported)
from loom.models.document_attention import DocumentMask
from loom.models.layers import sdpa_causal
from loom.models.moe import MoEFeedForward
from loom.parallel import comm
from loom.parallel.allgather_attention import (allgather_attention,
                                               document_allgather_attention)
from loom.parallel.comm import CommLedger
from loom.parallel.context_documents import (DocumentKeys, document_keys, document_ring_attention,
                                             document_shard_indices, take_shard, window_keys)
from loom.parallel.ring_attention import Ring, ring_attention, zigzag_positions
from loom.parallel.zeppelin_cp import (SubRingKeys, new_sub_rings, sub_ring_attention,
                                       sub_ring_keys)

def sequence_positions(seq_len: int, cp_rank: int, layout: CPLayout) -> torch.Tensor:
    """Global positions (int64 ``[seq_len / cp]``) of the tokens ``cp_rank`` holds, in order."""
    ring_rank, ulysses_rank = divmod(cp_rank, layout.ulysses)
    pair = zigzag_positions(seq_len, ring_rank, layout.ring)  # r=1: the whole sequence
    return pair.chunk(layout.ulysses)[ulysses_rank]


def shard_sequence(tokens_BS: torch.Tensor, cp_rank: int,
                   layout: CPLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens (``[B, S/cp]``) and their global positions (for RoPE). Shard targets
    with the same call."""
    positions = sequence_positions(tokens_BS.shape[1], cp_rank, layout).to(tokens_BS.device)
    return tokens_BS[:, positions], positions


def shard_documents(batch: DocumentBatch, cp_rank: int, layout: CPLayout) -> DocumentBatch:
    """This rank's part of packed rows or a varlen microbatch (``[B, S]`` each): documents cut
    zig-zag per document, padded where needed (``loom.parallel.context_documents``); the same
    length on every cp rank. Its positions are the tokens' positions in their documents."""
    index = document_shard_indices(batch.document_ids, layout.ring, layout.ulysses, cp_rank)
    return take_shard(batch, index)


# -- Ulysses all-to-all -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    group: Any
    ledger: CommLedger | None
    axis: str = "cp"


def _all_to_all(send: torch.Tensor, g: _Group) -> torch.Tensor:
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, g.group, axis=g.axis, ledger=g.ledger)
    return received


def _seq_to_heads(x_BNSH: torch.Tensor, g: _Group) -> torch.Tensor:
    """[B, N, S/u, Hd] (all heads, my tokens) -> [B, N/u, S, Hd] (my heads, the group's tokens)."""
    B, N, S, Hd = x_BNSH.shape
    u = dist.get_world_size(g.group)
    send = x_BNSH.reshape(B, u, N // u, S, Hd).transpose(0, 1).contiguous()  # chunk i -> rank i
    received = _all_to_all(send, g)  # received[i]: rank i's tokens of my heads
    return received.permute(1, 2, 0, 3, 4).reshape(B, N // u, u * S, Hd)


def _heads_to_seq(x_BNSH: torch.Tensor, g: _Group) -> torch.Tensor:
    """The inverse: [B, N/u, S, Hd] -> [B, N, S/u, Hd]."""
    B, N, S, Hd = x_BNSH.shape
    u = dist.get_world_size(g.group)
    send = x_BNSH.reshape(B, N, u, S // u, Hd).permute(2, 0, 1, 3, 4).contiguous()
    received = _all_to_all(send, g)  # received[i]: my tokens of rank i's heads
    return received.transpose(0, 1).reshape(B, u * N, S // u, Hd)


class _Redistribute(torch.autograd.Function):
    """One all-to-all layout change; its backward is the inverse change of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, g: _Group, to_heads: bool) -> torch.Tensor:
        ctx.g, ctx.to_heads = g, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad, ctx.g), None, None


# -- groups and the attention core --------------------------------------------------------------
@dataclass(frozen=True)
class CPGroups:
    """This rank's context-parallel process groups. ``ulysses``/``ring`` are ``None`` at degree 1."""

    layout: CPLayout
    cp_rank: int
    cp: Any
    ulysses: Any
    ring: Any
    ring_ranks: tuple[int, ...]
    sub_rings: Any = None  # zeppelin_cp.SubRings: data.balance = zeppelin's sub-ring groups


def new_cp_groups(cp_rank_groups: Sequence[Sequence[int]], layout: CPLayout,
                  rank: int, sub_rings: bool = False) -> CPGroups:
    """Create the cp, Ulysses and ring groups of every cp group (e.g. ``RankGrid.groups("cp")``,
    each listing global ranks in cp order), and with ``sub_rings`` (ring mode) the group of
    every aligned block of cp ranks (``zeppelin_cp.new_sub_rings``). Collective: every rank of
    the default group must call it with the same arguments (``new_group`` is; gloo has no
    ``split_group``)."""
    if layout.size == 1:  # nothing to create; the model is left untouched
        return CPGroups(layout, 0, None, None, None, (rank,))
    u, r = layout.ulysses, layout.ring
    mine: dict[str, Any] = {}
    for ranks in cp_rank_groups:
        ranks = list(ranks)
        if len(ranks) != layout.size:
            raise ValueError(f"cp group {ranks} has {len(ranks)} ranks, layout says {layout.size}")
        cp_group = dist.new_group(ranks)
        if rank in ranks:
            mine.update(cp=cp_group, cp_rank=ranks.index(rank))
        for i in range(r):  # Ulysses: u consecutive cp ranks
            members = ranks[i * u:(i + 1) * u]
            group = dist.new_group(members) if u > 1 else None
            if rank in members:
                mine["ulysses"] = group
        for t in range(u):  # ring: every u-th cp rank
            members = ranks[t::u]
            group = dist.new_group(members) if r > 1 else None
            if rank in members:
                mine.update(ring=group, ring_ranks=tuple(members))
    if sub_rings:
        if u > 1:
            raise ValueError(f"sub-rings run on a ring of cp ranks, not Ulysses (u = {u})")
        mine["sub_rings"] = new_sub_rings(cp_rank_groups, rank)
    return CPGroups(layout=layout, **mine)


class ContextParallelAttention:
    """A drop-in ``Attention.core``: queries ``[B, N, S/cp, Hd]``, un-repeated keys/values
    ``[B, K, S/cp, Hd]`` of this rank's shard -> its attention output ``[B, N, S/cp, Hd]``.
    ``window`` > 0: sliding-window attention, in every cp mode (module docstring). With
    ``documents`` (the shard's ``DocumentMask``, ids and positions from ``shard_documents``)
    attention stays inside each document (``loom.parallel.context_documents``)."""

    def __init__(self, groups: CPGroups, ledger: CommLedger | None = None, axis: str = "cp",
                 window: int = 0):
        self.window = window
        # concatenated rows' block tiles under the window, by (group tokens, device)
        self._window_keys: dict[tuple[int, Any], DocumentKeys] = {}
        # Attention.forward hands packed rows' documents to a core that says so (an instance
        # attribute: selective recompute's functools.wraps copies it onto its wrapper)
        self.takes_documents = True
        self.layout, self.cp, self.ledger, self.axis = groups.layout, groups.cp, ledger, axis
        self.sub_rings = groups.sub_rings  # varlen rows run on them (zeppelin_cp)
        # one forward's document keys, shared by its layers (and by recomputation)
        self._keys: weakref.WeakKeyDictionary[DocumentMask, DocumentKeys] = (
            weakref.WeakKeyDictionary())
        self.ulysses = _Group(groups.ulysses, ledger, axis) if groups.layout.ulysses > 1 else None
        self.ring = None
        if groups.layout.ring > 1:
            self.ring = Ring(groups.ring, groups.ring_ranks,
                             groups.cp_rank // groups.layout.ulysses, ledger, axis)

    def __call__(self, q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                 documents: DocumentMask | None = None) -> torch.Tensor:
        keys = None
        if documents is not None:
            keys = self._keys.get(documents)
            if keys is None and self.sub_rings is not None and documents.shape[0] == 1:
                keys = self._keys[documents] = sub_ring_keys(documents, self.sub_rings, self.cp,
                                                             self.ledger, self.axis, self.window)
            if keys is None:  # the forward's first layer: one all-gather of ids and positions
                ring_index = self.ring.index if self.ring is not None else 0
                keys = self._keys[documents] = document_keys(
                    documents, self.cp, self.layout.ring, self.layout.ulysses, ring_index,
                    self.ledger, self.axis, self.window)
        if isinstance(keys, SubRingKeys):  # whole documents local, grouped ones on sub-rings
            return sub_ring_attention(q_BNSH, k_BKSH, v_BKSH, keys)
        if self.ulysses is not None:
            q_BNSH, k_BKSH, v_BKSH = (_Redistribute.apply(t, self.ulysses, True)
                                      for t in (q_BNSH, k_BKSH, v_BKSH))
        if keys is None and self.window and self.ring is not None:
            keys = self._windowed_rows(q_BNSH.shape[2], q_BNSH.device)
        if keys is not None and self.ring is not None and self.layout.gather:
            out_BNSH = document_allgather_attention(q_BNSH, k_BKSH, v_BKSH, self.ring, keys)
        elif keys is not None and self.ring is not None:
            out_BNSH = document_ring_attention(q_BNSH, k_BKSH, v_BKSH, self.ring, keys)
        elif keys is not None:  # Ulysses only: the whole row in global order, for my heads
            out_BNSH = keys.whole.attention(q_BNSH, k_BKSH, v_BKSH, self.window)
        elif self.ring is not None and self.layout.gather:  # one all-gather, not r-1 hops
            out_BNSH = allgather_attention(q_BNSH, k_BKSH, v_BKSH, self.ring)
        elif self.ring is not None:
            out_BNSH = ring_attention(q_BNSH, k_BKSH, v_BKSH, self.ring)
        else:  # Ulysses only: the whole sequence, in global order, for my heads
            out_BNSH = sdpa_causal(q_BNSH, k_BKSH, v_BKSH, window=self.window)
        if self.ulysses is not None:
            out_BNSH = _Redistribute.apply(out_BNSH, self.ulysses, False)
        return out_BNSH

    def _windowed_rows(self, group_tokens: int, device: torch.device) -> DocumentKeys | None:
        """The ring's block tiles for concatenated rows under the sliding window; None when
        the window spans the whole sequence (plain causal attention is then exact)."""
        seq_len = group_tokens * self.ring.size
        if self.window >= seq_len:
            return None
        key = (group_tokens, device)
        if key not in self._window_keys:
            self._window_keys[key] = window_keys(seq_len, self.ring.size, self.ring.index,
                                                 self.window, device)
        return self._window_keys[key]


# -- mixture of experts: the balancing loss's statistics of split sequences --------------------
class _MeanOverParts(torch.autograd.Function):
    """Forward: the mean over the cp group (all-reduce, / cp). Backward: the identity.

    Why the identity: every cp rank's objective holds the same balancing loss, and the gradients
    are then averaged over cp. With the true backward of the mean (the gradient / cp on each
    rank, for its own tokens), that average would scale the loss's gradient by 1/cp; the
    identity (cp x 1/cp) makes the averaged gradient exactly one process's.
    """

    @staticmethod
    def forward(ctx: Any, stats: torch.Tensor, g: _Group, size: int) -> torch.Tensor:
        out = stats.detach().clone()  # never reduce a tensor autograd still holds, in place
        comm.all_reduce(out, g.group, axis=g.axis, ledger=g.ledger)
        return out.div_(size)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None, None


class SequenceStatisticsMean:
    """``MoEFeedForward.sequence_statistics`` under cp: the balancing loss's per-sequence f and
    P (``[2, B, E]``) of this rank's equal share of every sequence -> the whole sequence's (their
    mean over the cp group). One all-reduce of 8*B*E bytes per call."""

    def __init__(self, groups: CPGroups, ledger: CommLedger | None = None, axis: str = "cp"):
        self.g, self.size = _Group(groups.cp, ledger, axis), groups.layout.size

    def __call__(self, stats_2BE: torch.Tensor) -> torch.Tensor:
        return _MeanOverParts.apply(stats_2BE, self.g, self.size)


class DocumentCountsSum:
    """``MoEFeedForward.document_counts`` under cp: a document's expert assignments and token
    count summed over the cp ranks that hold its parts (``loom.models.moe``). Per forward, one
    all-reduce (max) of the rows' largest document id, shared by its MoE layers (and by
    recomputation: the same ``DocumentMask``); per MoE layer, one all-reduce of ``4 * B *
    documents * (E + 1)`` bytes. Counts carry no gradient, so nothing in backward."""

    def __init__(self, groups: CPGroups, ledger: CommLedger | None = None, axis: str = "cp"):
        self.g = _Group(groups.cp, ledger, axis)
        self._slots: weakref.WeakKeyDictionary[DocumentMask, int] = weakref.WeakKeyDictionary()

    def slots(self, documents: DocumentMask) -> int:
        if documents not in self._slots:
            top = documents.document_ids.max().long().reshape(1) + 1
            comm.all_reduce(top, self.g.group, axis=self.g.axis, ledger=self.g.ledger,
                            op=dist.ReduceOp.MAX)
            self._slots[documents] = int(top.item())
        return self._slots[documents]

    def __call__(self, counts_BDX: torch.Tensor) -> torch.Tensor:
        # in place: the caller's fresh counts, which carry no gradient
        comm.all_reduce(counts_BDX, self.g.group, axis=self.g.axis, ledger=self.g.ledger)
        return counts_BDX


def apply_context_parallel(model: nn.Module, groups: CPGroups,
                           ledger: CommLedger | None = None) -> nn.Module:
    """Swap every attention core of ``model`` for the cp one, and give every MoE layer the
    statistics mean over cp (rows) and the document counts' sum (documents); identity at cp
    degree 1."""
    if groups.layout.size == 1:
        return model
    core = ContextParallelAttention(groups, ledger, window=model.args.sliding_window)
    for layer in model.layers.values():
        layer.attention.core = core
    statistics = SequenceStatisticsMean(groups, ledger)
    counts = DocumentCountsSum(groups, ledger)
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.sequence_statistics, module.document_counts = statistics, counts
    return model


def reduce_gradients_over_cp(model: nn.Module, groups: CPGroups,
                             ledger: CommLedger | None = None) -> None:
    """Average every gradient over the cp group (sum / cp): each rank's loss is the mean over its
    own equal share of tokens. In the trainer, the data-parallel reducer over the flattened dp x cp group does this."""
    if groups.layout.size == 1:
        return
    for param in model.parameters():
        if param.grad is not None:
            comm.all_reduce(param.grad, groups.cp, axis="cp", ledger=ledger)
            param.grad.div_(groups.layout.size)
