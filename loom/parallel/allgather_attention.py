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

Documents (packed rows, varlen) are not built on this mode (``loom.config_rules`` refuses them by
name): their per-document shards use the document ring (``loom.parallel.context_documents``).

Why hand-written: torch's context parallelism has no CPU backward; this reuses the ring's block
math, so only the communication pattern is new.
"""

from __future__ import annotations

from typing import Any

import torch

from loom.parallel import comm
from loom.parallel.ring_attention import Ring, attend_kind, backward_kind, block_kind


def _gather(kv: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Every rank's stacked keys and values ``[r, 2, B, K, S_loc, Hd]``, in ring order."""
    gathered = torch.empty((ring.size * kv.shape[0], *kv.shape[1:]), dtype=kv.dtype,
                           device=kv.device)  # gloo wants the ranks' parts along dim 0
    comm.all_gather_into_tensor(gathered, kv.contiguous(), ring.group, axis=ring.axis,
                                ledger=ring.ledger)
    return gathered.view(ring.size, *kv.shape)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                ring: Ring) -> torch.Tensor:
        with torch.autocast(q_BNSH.device.type, enabled=False):  # fp32 softmax statistics
            B, N, S, Hd = q_BNSH.shape
            out = torch.zeros(B, N, S, Hd, dtype=torch.float32, device=q_BNSH.device)
            lse = torch.full((B, N, S), float("-inf"), dtype=torch.float32, device=q_BNSH.device)
            gathered = _gather(torch.stack([k_BKSH, v_BKSH]), ring)
            for owner in _order(ring):
                attend_kind(q_BNSH, gathered[owner], out, lse, block_kind(ring.index, owner))
        ctx.ring = ring
        ctx.save_for_backward(q_BNSH, k_BKSH, v_BKSH, out, lse)
        return out.to(q_BNSH.dtype)

    @staticmethod
    def backward(ctx: Any, dout_BNSH: torch.Tensor):
        with torch.autocast(dout_BNSH.device.type, enabled=False):
            ring: Ring = ctx.ring
            q_BNSH, k_BKSH, v_BKSH, out, lse = ctx.saved_tensors
            gathered = _gather(torch.stack([k_BKSH, v_BKSH]), ring)
            dq = torch.zeros_like(out)
            by_owner: list[torch.Tensor] = [torch.empty(0)] * ring.size  # rank order
            for owner in _order(ring):
                by_owner[owner] = backward_kind(q_BNSH, gathered[owner], out, dout_BNSH, lse,
                                                dq, block_kind(ring.index, owner))
            dkv = torch.stack(by_owner)
            own = torch.empty(dkv.shape[1:], dtype=torch.float32, device=dkv.device)
            comm.reduce_scatter_tensor(own, dkv.flatten(0, 1), ring.group, axis=ring.axis,
                                       ledger=ring.ledger)
        return (dq.to(q_BNSH.dtype), own[0].to(k_BKSH.dtype), own[1].to(v_BKSH.dtype), None)


def _order(ring: Ring) -> list[int]:
    """The blocks in the ring's order (own block first, then the ranks before it): the online
    softmax merges them in ``ring_attention``'s order (the dK/dV sums run in the
    reduce-scatter's)."""
    return [(ring.index - step) % ring.size for step in range(ring.size)]


def allgather_attention(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                        ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard against every cp rank's keys and values,
    gathered in one collective (module docstring)."""
    return _AllGatherAttention.apply(q_BNSH, k_BKSH, v_BKSH, ring)


__all__ = ["allgather_attention"]
