"""All-gather context parallelism: every rank gathers the whole sequence's keys and values at once.

Mesh axis: ``cp`` (``parallel.cp_mode = "allgather"``; Megatron-LM's ``--cp-comm-type
all_gather``, the context parallelism Llama 3 trained its long-context stage with).

Layout: the ring's (``loom.parallel.ring_attention``): the sequence cut into ``2r`` chunks, rank
``j`` holding chunks ``j`` and ``2r-1-j``, so every rank owns the same causal work. What differs
is how the keys meet the queries:

* forward: one all-gather over the cp group of this rank's stacked keys and values
  (``[2, B, K, S_loc, Hd]``), then every rank's block against the local queries with the same
  three block shapes and online-softmax merge as the ring (``block_kind``, ``attend_block``,
  ``merge_block``), in rank order;
* backward: the keys and values are gathered again (not saved: under GQA the gathered pair is
  ``2K/N * r`` times the local queries, per layer, which would multiply the attention's saved
  bytes; a second all-gather is the price), every block's ``dQ`` accumulates locally, its
  ``dK, dV`` land in a full-sequence buffer, and one reduce-scatter sums every rank's
  contribution onto the owner of each block.

Per layer and step, per rank: two all-gathers of ``r * 2*B*K*S_loc*Hd`` elements (wire
``(r-1)/r`` of that) and one reduce-scatter of the same size (fp32 gradients), against the ring's
``3 (r-1)`` point-to-point sends of ``2*B*K*S_loc*Hd``: the same bytes on the wire, in three
collectives instead of ``3 (r-1)`` dependent hops, so no step waits for a neighbour that is
late, at the price of memory for the gathered blocks during each layer's attention. With few
key/value heads (GQA) the gathered tensors are small, which is why Llama 3 chose it.

Documents (``data.packing = pack | varlen``; ``document_allgather_attention``): the shards are the
document ring's (``loom.parallel.context_documents``: each document zig-zag over the cp ranks),
and so are the block masks, one per key owner (``DocumentKeys.block_masks``: same document and
``position_k <= position_q``, or per-document tiles for a varlen microbatch; ``None`` where no
query of this rank sees a key of that owner, which then costs nothing but its share of the
gathered tensor). The collectives are the three above, unchanged; the masks come from the one
all-gather of (document id, position) pairs per forward that every cp mode's document path
makes. This is the combination Llama 3 trained its long-context stage with: all-gather context
parallelism under document masks.

Why hand-written: torch's context parallelism has no CPU backward; this reuses the ring's block
math, so only the communication pattern is new.
"""

from __future__ import annotations

from typing import Any

import torch

from loom.parallel import comm
from loom.parallel.context_documents import (DocumentKeys, block_backward, block_forward,
                                             merge_masked)
from loom.parallel.ring_attention import Ring, attend_kind, backward_kind, block_kind


def _gather(kv: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Every rank's stacked keys and values ``[r, 2, B, K, S_loc, Hd]``, in ring order."""
    gathered = torch.empty((ring.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype,
                           device=kv.device)  # gloo wants the ranks' parts along dim 0
    comm.all_gather_into_tensor(gathered, kv.contiguous(), ring.group, axis=ring.axis,
                                ledger=ring.ledger)
    return gathered.view(ring.size, *kv.shape)


class _AllGatherAttention(torch.autograd.Function):
    """Concatenated rows (``masks`` None): each gathered block is one of the zig-zag ring's
    causal kinds. Documents: each is masked by the document ring's mask for its owner
    (``masks[step]``, None where this rank's queries see none of its keys)."""

    @staticmethod
    def forward(ctx: Any, q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                ring: Ring, masks: tuple[Any, ...] | None) -> torch.Tensor:
        with torch.autocast(q_BNSH.device.type, enabled=False):  # fp32 softmax statistics
            B, N, S, Hd = q_BNSH.shape
            out = torch.zeros(B, N, S, Hd, dtype=torch.float32, device=q_BNSH.device)
            lse = torch.full((B, N, S), float("-inf"), dtype=torch.float32, device=q_BNSH.device)
            gathered = _gather(torch.stack([k_BKSH, v_BKSH]), ring)
            for step, owner in enumerate(_order(ring)):
                kv = gathered[owner]
                if masks is None:
                    attend_kind(q_BNSH, kv, out, lse, block_kind(ring.index, owner))
                elif masks[step] is not None:
                    out, lse = merge_masked(out, lse, *block_forward(q_BNSH, kv[0], kv[1],
                                                                     masks[step]))
        ctx.ring, ctx.masks = ring, masks
        ctx.save_for_backward(q_BNSH, k_BKSH, v_BKSH, out, lse)
        return out.to(q_BNSH.dtype)

    @staticmethod
    def backward(ctx: Any, dout_BNSH: torch.Tensor):
        with torch.autocast(dout_BNSH.device.type, enabled=False):
            ring: Ring = ctx.ring
            q_BNSH, k_BKSH, v_BKSH, out, lse = ctx.saved_tensors
            gathered = _gather(torch.stack([k_BKSH, v_BKSH]), ring)
            dq = torch.zeros_like(out)
            dkv = torch.zeros(gathered.shape, dtype=torch.float32, device=gathered.device)
            for step, owner in enumerate(_order(ring)):  # dkv in rank order
                kv = gathered[owner]
                if ctx.masks is None:
                    dkv[owner] = backward_kind(q_BNSH, kv, out, dout_BNSH, lse, dq,
                                               block_kind(ring.index, owner))
                elif ctx.masks[step] is not None:
                    dq_b, dkv[owner, 0], dkv[owner, 1] = block_backward(
                        q_BNSH, kv[0], kv[1], out, dout_BNSH, lse, ctx.masks[step])
                    dq += dq_b
            own = torch.empty(dkv.shape[1:], dtype=torch.float32, device=dkv.device)
            comm.reduce_scatter_tensor(own, dkv.flatten(0, 1), ring.group, axis=ring.axis,
                                       ledger=ring.ledger)
        return (dq.to(q_BNSH.dtype), own[0].to(k_BKSH.dtype), own[1].to(v_BKSH.dtype), None,
                None)


def _order(ring: Ring) -> list[int]:
    """The blocks in the ring's order (own block first, then the ranks before it): the online
    softmax merges them in ``ring_attention``'s order (the dK/dV sums run in the
    reduce-scatter's)."""
    return [(ring.index - step) % ring.size for step in range(ring.size)]


def allgather_attention(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                        ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard against every cp rank's keys and values,
    gathered in one collective (module docstring)."""
    return _AllGatherAttention.apply(q_BNSH, k_BKSH, v_BKSH, ring, None)


def document_allgather_attention(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor,
                                 v_BKSH: torch.Tensor, ring: Ring,
                                 keys: DocumentKeys) -> torch.Tensor:
    """Attention inside each document of this rank's shard against every cp rank's keys and
    values, gathered in one collective; ``keys`` from ``document_keys`` of the same forward
    (module docstring)."""
    return _AllGatherAttention.apply(q_BNSH, k_BKSH, v_BKSH, ring, keys.block_masks)


__all__ = ["allgather_attention", "document_allgather_attention"]
