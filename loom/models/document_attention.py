"""Causal attention that never crosses a document boundary (``data.packing = "pack"``).

A packed row holds several documents; ``DocumentMask`` describes them by per-token document ids
``[B, S]``. A document is a maximal run of equal ids in a row (padding is one more run), so
ids need only differ between neighbours. Each query sees the keys of its own run at or before
it (and, with a sliding window W, only the last W of those).

Which kernel, and why (torch 2.13):

* ``segments`` (the CPU path, and any device): every run is attended on its own with the same
  causal SDPA the unmasked model uses (``sdpa_causal``), the rows whose runs have the same
  ``(start, end)`` batched into one call (a batch that is one document per row is one plain
  call). It is exact, has forward and backward everywhere, does ``sum(s_i^2)`` work and builds
  no ``[S, S]`` mask (a sliding window keeps ``sdpa_causal``'s own mask, per document); it costs
  one kernel call per distinct span, which suits rows of a few documents.
* ``flex`` (the CUDA path): ``torch.nn.attention.flex_attention`` (compiled) with a
  ``BlockMask`` made from the runs, built once per forward and shared by every layer: fully
  masked blocks are skipped and no ``[S, S]`` mask exists. In torch 2.13 FlexAttention has no
  backward on the CPU (eager or compiled: "FlexAttention does not support backward on CPU"),
  which is why the CPU takes ``segments``; its forward runs there in eager mode, which the
  tests use to check this path's mask against ``segments``. On a GPU (tests/gpu, run on an
  H200 with torch 2.11) it equals ``segments`` forward and backward, and the trainer with
  packed rows on the GPU equals the CPU's. The kernel is compiled for static shapes, so a
  sequence runs padded to a power of two (``flex_length``; the padding fully masked): varlen
  microbatches (``loom.data.varlen``), of a new length almost every time, would otherwise
  recompile at every step until torch's recompile limit sends them to the slow eager kernel
  (measured on an H100, torch 2.11: steps of 0.3 to 15 s instead of tens of ms).
  ``torch.nn.attention.varlen.varlen_attn`` (cumulative sequence lengths, Flash Attention) is
  CUDA-only and half precision only, so it could not serve fp32 parity runs; not used.
* A dense boolean ``[S, S]`` mask through SDPA is not used: its memory grows with ``S^2``.

The unmasked model (no document ids) never comes here: it keeps ``sdpa_causal``'s ``is_causal``
kernel, bit for bit. Under context parallelism the shard's mask (ids and ``known_positions``)
goes to the cp core instead (``loom.parallel.context_documents``), which applies this class's
``attention`` to the whole row after Ulysses' all-to-all, or masks ring blocks by id and position.

Shape legend: B batch, S sequence, N query heads, K key/value heads, Hd head dim.
"""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from loom.models.layers import sdpa_causal

Kernel = Literal["auto", "segments", "flex"]
FLEX_BLOCK = 128  # FlexAttention's default block size


class DocumentMask:
    """The documents of a batch of rows, from their per-token ids ``[B, S]``.

    Built once per forward (``Transformer.forward``) and shared by every layer; the host-side
    spans (``segments``) and the ``BlockMask`` (``flex``) are computed on first use.
    """

    def __init__(self, document_ids_BS: torch.Tensor,
                 positions_BS: torch.Tensor | None = None) -> None:
        if document_ids_BS.dim() != 2:
            raise ValueError(f"document_ids must be [batch, seq], got shape"
                             f" {tuple(document_ids_BS.shape)}")
        self.document_ids = document_ids_BS
        # Each token's position in its document, as the caller gave it (None: not given). A
        # context-parallel shard holds parts of documents, which its ids alone cannot place;
        # its core (loom.parallel.context_documents) masks by these.
        self.known_positions = positions_BS
        starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
        starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
        self.starts_BS = starts_BS  # True where a run (a document, or the padding) begins
        self.run_BS = starts_BS.cumsum(dim=1)  # run number of every token inside its row
        self._block_masks: dict[int, BlockMask] = {}  # by sliding window (0: none)

    @property
    def shape(self) -> torch.Size:
        return self.document_ids.shape

    def positions(self) -> torch.Tensor:
        """Each token's position inside its run (0 at every document start), ``[B, S]``."""
        S = self.shape[1]
        index_BS = torch.arange(S, device=self.document_ids.device).expand(self.shape)
        run_start_BS = torch.where(self.starts_BS, index_BS, 0).cummax(dim=1).values
        return index_BS - run_start_BS

    @property
    def real_BS(self) -> torch.Tensor:
        """True at tokens of a document; a negative id is padding (``loom.data.packing``'s
        ``PAD_DOCUMENT``), which attends as a run of its own but is no document: MoE routes
        none of it (``loom.models.moe``)."""
        return self.document_ids >= 0

    @functools.cached_property
    def run_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's run as (first, last) token index inside its row, ``[B, S]`` each: for
        statistics over a whole document (MoE's routing groups)."""
        S = self.shape[1]
        index_BS = torch.arange(S, device=self.document_ids.device).expand(self.shape)
        first_BS = index_BS - self.positions()
        ends_BS = torch.ones_like(self.starts_BS)
        ends_BS[:, :-1] = self.starts_BS[:, 1:]  # a run ends where the next one starts
        last_BS = torch.where(ends_BS, index_BS, S).flip(1).cummin(dim=1).values.flip(1)
        return first_BS, last_BS

    @functools.cached_property
    def spans(self) -> list[tuple[int, int, torch.Tensor | None]]:
        """``(start, end, rows)`` of every distinct run span; ``rows`` None means every row."""
        starts = self.starts_BS.cpu().numpy()
        B, S = starts.shape
        grouped: dict[tuple[int, int], list[int]] = {}
        for b in range(B):
            bounds = np.append(np.flatnonzero(starts[b]), S)
            for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                grouped.setdefault((start, end), []).append(b)
        device = self.document_ids.device
        return [(start, end, None if len(rows) == B else torch.tensor(rows, device=device))
                for (start, end), rows in grouped.items()]

    def attention(self, q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                  window: int = 0, kernel: Kernel = "auto") -> torch.Tensor:
        """Causal attention inside each document (module docstring): ``sdpa_causal``'s
        arguments (un-repeated key/value heads). ``kernel`` ``auto`` is ``flex`` on CUDA and
        ``segments`` elsewhere."""
        if self.shape != (q_BNSH.shape[0], q_BNSH.shape[2]):
            raise ValueError(f"document_ids shape {tuple(self.shape)} does not match the"
                             f" queries' [batch, seq] = {(q_BNSH.shape[0], q_BNSH.shape[2])}")
        if kernel == "auto":
            kernel = "flex" if q_BNSH.device.type == "cuda" else "segments"
        if kernel == "flex":
            S = q_BNSH.shape[2]
            padded = flex_length(S)
            if padded == S:
                return _flex(q_BNSH, k_BKSH, v_BKSH, self.block_mask(window))
            # the compiled kernel sees a handful of lengths, not one per varlen microbatch:
            # zeros after the sequence, in fully masked rows and columns (never read)
            grow = (0, 0, 0, padded - S)
            out_BNSH = _flex(*(F.pad(t, grow) for t in (q_BNSH, k_BKSH, v_BKSH)),
                             self.block_mask(window))
            return out_BNSH[:, :, :S]
        if kernel != "segments":
            raise ValueError(f"unknown document attention kernel {kernel!r}; known: auto,"
                             " segments, flex")
        return _eager(DocumentMask._segments)(self, q_BNSH, k_BKSH, v_BKSH, window)

    def _segments(self, q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                  window: int) -> torch.Tensor:
        if len(self.spans) == 1:  # every row is one document: the plain kernel, no copies
            return sdpa_causal(q_BNSH, k_BKSH, v_BKSH, window)
        out_BNSH = q_BNSH.new_empty(q_BNSH.shape)  # every position lies in exactly one span
        for start, end, rows in self.spans:
            if rows is None:
                out_BNSH[:, :, start:end] = sdpa_causal(
                    q_BNSH[:, :, start:end], k_BKSH[:, :, start:end], v_BKSH[:, :, start:end],
                    window)
            else:
                out_BNSH[rows, :, start:end] = sdpa_causal(
                    q_BNSH[rows, :, start:end], k_BKSH[rows, :, start:end],
                    v_BKSH[rows, :, start:end], window)
        return out_BNSH

    def block_mask(self, window: int = 0) -> BlockMask:
        """FlexAttention's ``BlockMask``: same run, causal, and inside the window if any."""
        if window not in self._block_masks:
            self._block_masks[window] = self._make_block_mask(window)
        return self._block_masks[window]

    def _make_block_mask(self, window: int) -> BlockMask:
        B, S = self.shape
        padded = flex_length(S)
        # beyond S (flex_length's padding) run 0, which no token has: fully masked
        run_BS = F.pad(self.run_BS, (0, padded - S))

        def same_document(b, h, q_idx, kv_idx):
            allowed = (run_BS[b, q_idx] == run_BS[b, kv_idx]) & (kv_idx <= q_idx) \
                & (run_BS[b, q_idx] > 0)
            return allowed & (q_idx - kv_idx < window) if window > 0 else allowed

        on_gpu = run_BS.device.type != "cpu"
        return create_block_mask(same_document, B, None, padded, padded, device=run_BS.device,
                                 _compile=on_gpu)


@functools.cache
def _eager(function):
    """``function`` run eagerly under torch.compile (a clean graph break around it): the
    segments' spans are host-side integers that change with every batch, so a traced loop over
    them would recompile per batch until dynamo's limit; the block's code before and after
    still compiles. Wrapped on first use: ``torch.compiler.disable`` imports dynamo (and
    sympy), which the launcher's imports of the model must not pay."""
    return torch.compiler.disable(function)


def flex_length(S: int) -> int:
    """The length the ``flex`` kernel runs a sequence of S tokens at: S when it is a power of
    two of at least one block (128), else the next one. A kernel compiled for static shapes
    recompiles per length (torch's limit is 8), and varlen microbatches
    (``loom.data.varlen``) have a new length almost every time: this leaves a few lengths up
    to a microbatch's budget. The padding is fully masked (its blocks are skipped)."""
    return max(FLEX_BLOCK, 1 << (S - 1).bit_length())


def _flex(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
          block_mask: BlockMask) -> torch.Tensor:
    kernel = _compiled_flex() if q_BNSH.device.type != "cpu" else flex_attention
    return kernel(q_BNSH, k_BKSH, v_BKSH, block_mask=block_mask,
                  enable_gqa=k_BKSH.shape[1] != q_BNSH.shape[1])


@functools.cache
def _compiled_flex():
    """FlexAttention's fused kernel exists only compiled (eager is a slow reference)."""
    return torch.compile(flex_attention, dynamic=False)


__all__ = ["DocumentMask", "flex_length"]
