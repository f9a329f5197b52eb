"""Ring attention: causal attention over a sequence sharded zig-zag across the ranks of a ring.

Mesh axis: ``cp`` (the whole cp group for ``mode="ring"``, the ring sub-group of a hybrid layout).

Layout. The sequence is cut into ``2r`` equal chunks and ring rank ``j`` holds chunks ``j`` and
``2r-1-j`` (zig-zag), concatenated in that order: every rank then owns the same amount of causal
work, and each step of the ring is one of three block shapes (``block_kind``):

* step 0, own keys: ``diagonal``, plain causal attention on the local ``2c`` tokens (the local
  order is increasing in global position, so the usual lower triangle is the right mask);
* keys from a lower ring rank: ``kv_first_half``, every local query sees the sender's first chunk
  in full and none of its second one;
* keys from a higher ring rank: ``q_second_half``, only the local second chunk attends, to all
  of the sender's keys, unmasked.

Each non-diagonal step is exactly half of a full block, so there is no idle half-masked work.

Forward: ``r`` steps; at each one the key/value block travels one hop around the ring
(``isend`` to the next rank, ``irecv`` from the previous, posted *before* the block is computed so
transfer overlaps compute), and the block's output is merged into the running output with the
online softmax (running log-sum-exp). ``r-1`` sends of ``2 * B*K*S_loc*Hd`` elements per layer.

Backward (the flash/ring-attention backward): blocks are recomputed from the saved queries, keys,
values, output and final log-sum-exp; ``dQ`` accumulates locally; the key/value blocks go around
the ring again (``r-1`` sends), and the ``dK, dV`` of the block a rank holds travels with it as a
running sum that reaches its owner after ``r-1`` hops (``r-1`` sends of the same size): the owner's
own diagonal contribution never leaves it. Per layer and step, ring traffic is therefore
``3 (r-1)`` sends of ``2 * B*K*S_loc*Hd`` elements per rank.

Keys and values are *not* repeated to the query heads (the model hands them over un-repeated), so
the ring carries ``K`` heads, a factor ``N/K`` less than repeated keys would; the block math
broadcasts each key head over its ``N/K`` query heads.

Degree 1: ``ring_attention`` is plain causal attention (one diagonal block), no communication.

Documents (packed rows, varlen microbatches): ``loom.parallel.context_documents`` runs the same
ring (same hops, tags, travelling dK/dV sum and bytes) over shards cut zig-zag *per document*,
with each block masked by document id and position instead of the halves above (a block with
no shared document is skipped; its keys still travel).

Why hand-written: torch's context-parallel attention (``torch.distributed.tensor.experimental``)
has no CPU backward and no causal load balancing we could test on gloo; this file is the block
math (torch's CPU flash kernels, which expose the log-sum-exp, or plain fp32 torch elsewhere),
the online-softmax merge and point-to-point messages through ``loom.parallel.comm``. The plain
torch path takes query rows in tiles of ``SCORE_TILE_BYTES`` of fp32 scores, so its memory per
block grows with the keys, not with the block's square; it is still math, not a fused kernel
(on a GPU the flash and memory-efficient kernels' log-sum-exp variants are the next step).

Shape legend: B batch, N query heads, K key/value heads, G = N/K, Sq/Sk query/key tokens of a
block, Hd head dim, r ring size, c chunk length (S_loc = 2c tokens per rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Literal

import torch

from loom.parallel import comm
from loom.parallel.comm import CommLedger

BlockKind = Literal["diagonal", "kv_first_half", "q_second_half"]
KV_TAG, DKV_TAG = 0, 1  # separate tags keep key/value blocks and gradient sums from crossing


def zigzag_positions(seq_len: int, ring_rank: int, ring_size: int) -> torch.Tensor:
    """Global positions held by ``ring_rank``: chunks ``j`` and ``2r-1-j`` of ``2r``, in order."""
    if seq_len % (2 * ring_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * ring size "
                         f"{2 * ring_size} (zig-zag needs 2 equal chunks per rank)")
    chunk = seq_len // (2 * ring_size)
    first, second = ring_rank * chunk, (2 * ring_size - 1 - ring_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def block_kind(q_rank: int, kv_rank: int) -> BlockKind:
    """Which part of a zig-zag block is causal-visible (see the module docstring)."""
    if q_rank == kv_rank:
        return "diagonal"
    return "kv_first_half" if kv_rank < q_rank else "q_second_half"


def block_slices(kind: BlockKind, local_len: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal?) of a block of ``local_len`` queries and keys."""
    half, every = local_len // 2, slice(None)
    if kind == "diagonal":
        return every, every, True
    if kind == "kv_first_half":
        return every, slice(0, half), False
    return slice(half, None), every, False


# The plain-torch block math holds a tile's fp32 scores (and their exponent) at once: query rows
# are taken in tiles of at most this many score bytes, so a block's memory grows with its keys,
# not with the square of its length (off the CPU, where no kernel returns the log-sum-exp)
SCORE_TILE_BYTES = 256 * 2**20


def query_tiles(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor,
                tile_bytes: int = SCORE_TILE_BYTES) -> list[slice]:
    """Query-row ranges whose fp32 scores against all of the block's keys fit ``tile_bytes``."""
    B, N, Sq, _ = q_BNSH.shape
    rows = max(1, tile_bytes // max(1, 4 * B * N * k_BKSH.shape[2]))
    return [slice(start, min(start + rows, Sq)) for start in range(0, Sq, rows)]


def _scores(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, causal: bool,
            allowed_BQK: torch.Tensor | None = None, row_offset: int = 0) -> torch.Tensor:
    """Scaled scores ``[B, K, G, Sq, Sk]`` (fp32); each key head broadcasts over its G queries.
    ``-inf`` above the diagonal when ``causal`` (these queries being rows ``row_offset`` on of
    the block), and where ``allowed_BQK`` (a per-row mask of the block: context parallelism's
    document ring) forbids."""
    B, N, Sq, Hd = q_BNSH.shape
    K = k_BKSH.shape[1]
    q_BKGSH = q_BNSH.float().view(B, K, N // K, Sq, Hd)
    scores = q_BKGSH @ k_BKSH.float().unsqueeze(2).transpose(-1, -2) / math.sqrt(Hd)
    if causal:
        Sk = k_BKSH.shape[2]
        future = torch.ones(Sq, Sk, dtype=torch.bool, device=scores.device).triu(1 + row_offset)
        scores = scores.masked_fill(future, float("-inf"))
    if allowed_BQK is not None:
        scores = scores.masked_fill(~allowed_BQK[:, None, None], float("-inf"))
    return scores


def finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a row that sees no key) as 0, so ``exp(scores - it)`` is 0 there."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def attend_block_math(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                      causal: bool, allowed_BQK: torch.Tensor | None = None,
                      tile_bytes: int = SCORE_TILE_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block: output ``[B, N, Sq, Hd]`` and log-sum-exp ``[B, N, Sq]``,
    both fp32, in plain torch (the reference, the path off the CPU, and the document ring's
    masked blocks), query rows in tiles of ``tile_bytes`` of scores (``query_tiles``; every
    row's result is the untiled one's). A row that sees no key gets output 0 and log-sum-exp
    ``-inf``."""
    B, N, Sq, Hd = q_BNSH.shape
    out = torch.empty(B, N, Sq, Hd, dtype=torch.float32, device=q_BNSH.device)
    lse = torch.empty(B, N, Sq, dtype=torch.float32, device=q_BNSH.device)
    for rows in query_tiles(q_BNSH, k_BKSH, tile_bytes):
        scores = _scores(q_BNSH[:, :, rows], k_BKSH, causal,
                         None if allowed_BQK is None else allowed_BQK[:, rows], rows.start)
        tile_lse = scores.logsumexp(-1)
        tile_out = torch.exp(scores - finite(tile_lse).unsqueeze(-1)) @ v_BKSH.float().unsqueeze(2)
        out[:, :, rows] = tile_out.reshape(B, N, -1, Hd)
        lse[:, :, rows] = tile_lse.reshape(B, N, -1)
    return out, lse


# torch's CPU flash-attention kernels return and accept the log-sum-exp the ring needs; ~10x the
# plain math above at S=2048 (bench/context_parallel.py). Private ops, hence the fallback.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten,
                              "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_flash(q_BNSH: torch.Tensor) -> bool:
    return q_BNSH.device.type == "cpu" and _FLASH_CPU_BACKWARD is not None


def _repeat_heads(x_BKSH: torch.Tensor, group: int) -> torch.Tensor:
    return x_BKSH.float().repeat_interleave(group, dim=1).contiguous()


def attend_block(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend_block_math``'s result, from torch's flash kernel where there is one."""
    if not _use_flash(q_BNSH):
        return attend_block_math(q_BNSH, k_BKSH, v_BKSH, causal)
    group = q_BNSH.shape[1] // k_BKSH.shape[1]
    out, lse = _FLASH_CPU(q_BNSH.float().contiguous(), _repeat_heads(k_BKSH, group),
                          _repeat_heads(v_BKSH, group), 0.0, causal)[:2]
    return out, lse


def merge_block(out_BNSH: torch.Tensor, lse_BNS: torch.Tensor, block_out_BNSH: torch.Tensor,
                block_lse_BNS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax: combine two partial attentions over disjoint key sets. A running
    ``lse = -inf`` (no keys yet) takes the block as it is."""
    lse = torch.logaddexp(lse_BNS, block_lse_BNS)
    out = (out_BNSH * torch.exp(lse_BNS - lse).unsqueeze(-1)
           + block_out_BNSH * torch.exp(block_lse_BNS - lse).unsqueeze(-1))
    return out, lse


def attend_block_backward_math(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                               out_BNSH: torch.Tensor, dout_BNSH: torch.Tensor,
                               lse_BNS: torch.Tensor, causal: bool,
                               allowed_BQK: torch.Tensor | None = None,
                               tile_bytes: int = SCORE_TILE_BYTES,
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the rows' *final* output and log-sum-exp (the flash-attention
    backward): ``dq [B,N,Sq,Hd]``, ``dk, dv [B,K,Sk,Hd]``, fp32; the block masked as
    ``_scores`` masks it; query rows in tiles as ``attend_block_math`` takes them (dK and dV
    summed over the tiles)."""
    B, N, Sq, Hd = q_BNSH.shape
    K, Sk = k_BKSH.shape[1], k_BKSH.shape[2]
    G = N // K
    k_BK1SH, v_BK1SH = k_BKSH.float().unsqueeze(2), v_BKSH.float().unsqueeze(2)
    dq = torch.empty(B, N, Sq, Hd, dtype=torch.float32, device=q_BNSH.device)
    dk = torch.zeros(B, K, Sk, Hd, dtype=torch.float32, device=q_BNSH.device)
    dv = torch.zeros_like(dk)
    for rows in query_tiles(q_BNSH, k_BKSH, tile_bytes):
        n = rows.stop - rows.start
        q_t, dout_t = q_BNSH[:, :, rows], dout_BNSH[:, :, rows].float()
        delta = (dout_t * out_BNSH[:, :, rows].float()).sum(-1)  # = sum_k P dP, per query row
        probs = torch.exp(_scores(q_t, k_BKSH, causal,
                                  None if allowed_BQK is None else allowed_BQK[:, rows],
                                  rows.start)
                          - lse_BNS[:, :, rows].reshape(B, K, G, n, 1))
        dout_BKGSH = dout_t.reshape(B, K, G, n, Hd)
        dv += (probs.transpose(-1, -2) @ dout_BKGSH).sum(2)
        dprobs = dout_BKGSH @ v_BK1SH.transpose(-1, -2)
        dscores = probs * (dprobs - delta.reshape(B, K, G, n, 1)) / math.sqrt(Hd)
        dq[:, :, rows] = (dscores @ k_BK1SH).reshape(B, N, n, Hd)
        dk += (dscores.transpose(-1, -2) @ q_t.float().reshape(B, K, G, n, Hd)).sum(2)
    return dq, dk, dv


def attend_block_backward(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                          out_BNSH: torch.Tensor, dout_BNSH: torch.Tensor, lse_BNS: torch.Tensor,
                          causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attend_block_backward_math``'s result, from torch's flash kernel where there is one."""
    if not _use_flash(q_BNSH):
        return attend_block_backward_math(q_BNSH, k_BKSH, v_BKSH, out_BNSH, dout_BNSH, lse_BNS,
                                          causal)
    B, N, Sq, Hd = q_BNSH.shape
    K, Sk = k_BKSH.shape[1], k_BKSH.shape[2]
    dq, dk, dv = _FLASH_CPU_BACKWARD(
        dout_BNSH.float().contiguous(), q_BNSH.float().contiguous(),
        _repeat_heads(k_BKSH, N // K), _repeat_heads(v_BKSH, N // K),
        out_BNSH.float().contiguous(), lse_BNS.float().contiguous(), 0.0, causal)
    # Each key head served N/K query heads: its gradient is the sum over them.
    return dq, dk.view(B, K, N // K, Sk, Hd).sum(2), dv.view(B, K, N // K, Sk, Hd).sum(2)


def attend_kind(q_BNSH: torch.Tensor, kv: torch.Tensor, out_BNSH: torch.Tensor,
                lse_BNS: torch.Tensor, kind: BlockKind) -> None:
    """Merge the ``kind`` block of the stacked keys and values ``kv`` (``[2, B, K, S, Hd]``)
    into the running fp32 output and log-sum-exp of this rank's zig-zag queries, in place."""
    rows, cols, causal = block_slices(kind, q_BNSH.shape[2])
    block_out, block_lse = attend_block(q_BNSH[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                        causal)
    out_BNSH[:, :, rows], lse_BNS[:, :, rows] = merge_block(out_BNSH[:, :, rows],
                                                            lse_BNS[:, :, rows], block_out,
                                                            block_lse)


def backward_kind(q_BNSH: torch.Tensor, kv: torch.Tensor, out_BNSH: torch.Tensor,
                  dout_BNSH: torch.Tensor, lse_BNS: torch.Tensor, dq_BNSH: torch.Tensor,
                  kind: BlockKind) -> torch.Tensor:
    """The ``kind`` block's backward from the rows' final output and log-sum-exp: its dQ added
    to ``dq_BNSH`` in place; returns its dK/dV, fp32 ``[2, B, K, S, Hd]`` (zero outside the
    block's columns)."""
    rows, cols, causal = block_slices(kind, q_BNSH.shape[2])
    dq_b, dk_b, dv_b = attend_block_backward(
        q_BNSH[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out_BNSH[:, :, rows],
        dout_BNSH[:, :, rows], lse_BNS[:, :, rows], causal)
    dq_BNSH[:, :, rows] += dq_b
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dkv[0][:, :, cols], dkv[1][:, :, cols] = dk_b, dv_b
    return dkv


@dataclass(frozen=True)
class Ring:
    """This rank's ring: the process group, its members' global ranks in ring order, and where
    messages are counted (``ledger`` under ``axis``)."""

    group: Any
    ranks: tuple[int, ...]
    index: int
    ledger: CommLedger | None = None
    axis: str = "cp"

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def send(self, tensor: torch.Tensor, tag: int) -> Any:
        return comm.isend(tensor, self.next, self.group, axis=self.axis, ledger=self.ledger, tag=tag)

    def recv(self, tensor: torch.Tensor, tag: int) -> Any:
        return comm.irecv(tensor, self.prev, self.group, axis=self.axis, ledger=self.ledger, tag=tag)

    def shift(self, tensor: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[Any]]:
        """Start passing ``tensor`` to the next rank; return the buffer the previous rank's
        tensor will land in and the requests to wait on."""
        buffer = torch.empty_like(tensor)
        return buffer, [self.send(tensor, tag), self.recv(buffer, tag)]


def wait_all(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def ring_hops(ring: Ring, kv: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Each step's key/value block, this rank's own first (step 0): the transfer of the next
    one is posted before a block is handed out, so it overlaps the caller's work on that block."""
    for step in range(ring.size):
        last = step == ring.size - 1
        if not last:
            incoming, requests = ring.shift(kv, KV_TAG)
        yield step, kv
        if not last:
            wait_all(requests)
            kv = incoming


class GradientRelay:
    """The dK/dV of the block each ring step holds, passed on as a running sum: after r-1 hops
    it reaches the block's owner. The owner's own contribution (step 0) never travels."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring
        self.own: torch.Tensor | None = None
        self.incoming: torch.Tensor | None = None
        self.pending: list[Any] = []  # irecv of the running dK/dV sum for the next block
        self.sends: list[tuple[Any, torch.Tensor]] = []  # keep sent tensors alive until delivered

    def add(self, step: int, dkv: torch.Tensor) -> None:
        """Add step ``step``'s block gradient (fp32, ``[2, B, K, Sk, Hd]``) and pass it on."""
        if step == 0:
            self.own = dkv
            return
        if step >= 2:  # the previous ranks' share of this block's gradient
            wait_all(self.pending)
            dkv += self.incoming
        self.sends.append((self.ring.send(dkv, DKV_TAG), dkv))
        self.incoming = torch.empty_like(dkv)
        self.pending = [self.ring.recv(self.incoming, DKV_TAG)]

    def total(self) -> torch.Tensor:
        """This rank's keys' dK/dV over every rank's queries; waits for every send too."""
        own = self.own
        if self.ring.size > 1:
            wait_all(self.pending)
            own = own + self.incoming
        wait_all([request for request, _ in self.sends])
        return own


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                ring: Ring) -> torch.Tensor:
        with torch.autocast(q_BNSH.device.type, enabled=False):  # fp32 softmax statistics
            B, N, S, Hd = q_BNSH.shape
            out = torch.zeros(B, N, S, Hd, dtype=torch.float32, device=q_BNSH.device)
            lse = torch.full((B, N, S), float("-inf"), dtype=torch.float32, device=q_BNSH.device)
            # one message per hop, not two
            for step, kv in ring_hops(ring, torch.stack([k_BKSH, v_BKSH]).contiguous()):
                attend_kind(q_BNSH, kv, out, lse,
                            block_kind(ring.index, (ring.index - step) % ring.size))
        ctx.ring = ring
        ctx.save_for_backward(q_BNSH, k_BKSH, v_BKSH, out, lse)
        return out.to(q_BNSH.dtype)

    @staticmethod
    def backward(ctx: Any, dout_BNSH: torch.Tensor):
        with torch.autocast(dout_BNSH.device.type, enabled=False):
            ring: Ring = ctx.ring
            q_BNSH, k_BKSH, v_BKSH, out, lse = ctx.saved_tensors
            dq = torch.zeros_like(out)
            relay = GradientRelay(ring)
            for step, kv in ring_hops(ring, torch.stack([k_BKSH, v_BKSH]).contiguous()):
                relay.add(step, backward_kind(q_BNSH, kv, out, dout_BNSH, lse, dq, block_kind(
                    ring.index, (ring.index - step) % ring.size)))
            own = relay.total()
        return (dq.to(q_BNSH.dtype), own[0].to(k_BKSH.dtype), own[1].to(v_BKSH.dtype), None)


def ring_attention(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                   ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's zig-zag shard against the whole ring's keys and values."""
    return _RingAttention.apply(q_BNSH, k_BKSH, v_BKSH, ring)
