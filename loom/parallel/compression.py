"""Gradient compression for synchronous data parallelism: a pluggable step of ``GradientReducer``.

``parallel.grad_compression`` picks what one bucket of gradients puts on the wire; the reducer
(``loom.parallel.data``) hands each ready bucket to ``GradCompressor.launch`` instead of its fp32
all-reduce and calls ``complete`` at ``finish``. Every compressor keeps *error feedback*: the part
of ``g + e`` (gradient plus the previous residual) it did not send stays in the residual ``e`` and
is added to the next step's gradient, so nothing is lost, only delayed (1-bit SGD, Seide et al.;
Karimireddy et al. 2019). For P fp32 gradient elements per rank at data-parallel degree n, in
``comm.py``'s conventions (the ledger's payload of an all-gather is its gathered output):

=========  ==========================================  ======================  ==================
mode       collectives per bucket                      ledger payload          wire bytes / rank
=========  ==========================================  ======================  ==================
none       one fp32 all-reduce (today's, unchanged)    4 P                     8 (n-1)/n P
int8       one all-gather: fp32 scales, int8 values    n (P + 4 ceil(P/1024))  (n-1) (P + ...)
topk       one all-gather: fp32 values, int32 offsets  8 n k                   8 (n-1) k
powersgd   two fp32 all-reduces: the Ps, then the Qs   4 (sum (rows + cols) r  2 (n-1)/n x payload
                                                       + P_uncompressed)
=========  ==========================================  ======================  ==================

(k = sum over tensors of ceil(ratio numel).) Measured on the tiny preset at dp = 2 (3.3 M
parameters; bytes per step, wire): none 13.2 MB, int8 3.3 MB, topk 1% 0.27 MB, powersgd rank 4
0.34 MB, powersgd rank 4 + lgreco 0.15-0.17 MB (with the SVD error measure L-GreCo had before
session 21).

* **int8** (the 8-bit approximation of Dettmers 2016, with error feedback): ``g + e`` cut into
  chunks of 1024 elements, each scaled by its max magnitude / 127 and rounded. A sum of int8
  values overflows and gloo has no int8 sum with a per-rank scale, so every rank all-gathers the
  others' int8 payloads and scales and decodes and averages them itself, in rank order (every
  rank computes the same fp32 numbers). Wire bytes per rank ``(n-1) (P + scales)`` against the
  fp32 all-reduce's ``8 (n-1)/n P``: 4x fewer at n = 2, break-even at n = 8; past that a
  two-phase scheme (all-to-all of int8 slices, local sum, re-quantized all-gather: ZeRO++'s qgZ)
  would pay, at the price of a second quantization error on the owner's slice (not built).
* **topk** (Stich et al. 2018, with error feedback): each tensor keeps its ``k = ceil(ratio
  numel)`` largest-magnitude elements of ``g + e``; the values and their bucket offsets are
  all-gathered and every rank adds each rank's values in rank order (sparse vectors do not sum
  in an all-reduce without densifying).
* **powersgd** (Vogels et al. 2019, rank ``compression_rank``): each matrix gradient (a tensor of
  ndim >= 2, viewed as ``[shape[0], -1]``) ``M = g + e`` is approximated as ``P Q^T``: ``P = M Q``
  with the warm-started ``Q`` (seeded, identical on every rank), all-reduced, orthonormalized
  (QR); ``Q = M^T P``, all-reduced and averaged; the average gradient is ``P Q^T`` and the
  residual ``e = M - P Q^T``. Vectors, and matrices where ``(rows + cols) r`` is not at least
  ``min_compression_rate`` times smaller than ``rows cols`` (torch's rule), ride uncompressed in
  the first all-reduce, as torch's hook sends them. Why not torch's ``powerSGD_hook``: it is a
  DDP communication hook that takes the ``GradBucket`` of DDP's C++ reducer (not constructible
  from Python, and DDP rejects the DTensor parameters Loom's reducer serves under TP), it issues
  its all-reduces itself (the ledger could not count them), and its ``PowerSGDState`` holds one
  rank for every matrix, which L-GreCo's per-layer ranks need to vary. The numerics are its own
  (error feedback, warm start, the compressibility rule), written against ``comm.py``; unlike
  the hook it compresses from the first step (no ``start_powerSGD_iter`` of plain all-reduces:
  error feedback carries what the first, poor warm-start Qs miss).

**L-GreCo** (``compression_adaptive = lgreco``, Alimohammadi et al. 2023) on top of powersgd or
topk: each tensor ("layer") may use one of five levels around the configured one (PowerSGD ranks
r/4, r/2, r, 2r, 4r; top-k ratios ratio/4 ... 4 ratio). Every ``compression_refresh`` steps the
compressor measures, on that step's ``g + e``, each layer's squared error at each level: for top-k
the tail of its sorted squared magnitudes (what it drops); for PowerSGD the error of the compressor
itself, one power iteration from the warm-started Q on this rank's ``g + e``. The best rank-r
error (the tail of the squared singular values, one SVD per matrix) was the first measure and a
worse one: a single warm-started power iteration does not reach it, plausibly least at the ranks
whose columns of Q have not been in use, so the program bought error at high ranks that the
compressor did not deliver (bench/lowcomm_convergence.py, 96 steps at reference rank 4, seed
1234: 2.714 validation loss at 130 bytes/token with the SVD, 2.646 at 118 with the compressor's
own error; docs/benchmarks.md). The table is summed over the data-parallel group (one small
all-reduce, so every rank decides alike), and ``choose_levels`` picks per layer the level
minimizing the total bytes subject to the total error staying within that of the uniform
configured level (a knapsack solved by dynamic programming over discretized error, never worse
than the uniform choice). The new levels apply from the next step.

bf16 parameters (``train.dtype = bf16``): the reducer hands the compressor each parameter's fp32
``main_grad`` (``mixed_precision.gradient_of``), the residuals are fp32, and the average is
written back into ``main_grad`` for the masters' step (``grad_reduce_dtype`` stays fp32 with
compression: the config refuses bf16, the compressors send their own formats).

State (training state, saved in checkpoints by the trainer under this rank's key; a resume under
another parallel config restarts it at zero residuals and the seeded Q): every tensor's residual,
PowerSGD's Q (held at the largest level's rank; a level uses its first columns, so a level change
keeps the warm start), the chosen levels and the step count. Gradient accumulation and pipeline
flushes are the reducer's: a compressor sees each bucket once per optimizer step.

Expert parallelism: the dense gradients are the reducer's over dp x ep as usual; the expert
shards take their own reduction over the data-parallel ranks outside ep
(``expert.reduce_gradients``), where a second compressor of the same spec, built for them by the
trainer (``Trainer._expert_compressor``), averages them in one bucket; its state is saved beside
the reducers'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from loom.layout import CompressionSpec
from loom.parallel import comm
from loom.parallel.comm import local_shard

METHODS = ("none", "powersgd", "int8", "topk")
ADAPTIVE = ("none", "lgreco")
INT8_CHUNK = 1024  # elements per int8 scale: 0.4% of the payload in scales
LEVEL_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)  # L-GreCo's candidate levels around the configured one
REFERENCE_LEVEL = LEVEL_FACTORS.index(1.0)
DP_BINS = 1000  # error resolution of L-GreCo's dynamic program (budget / DP_BINS per bin)


def _clean(tensor: torch.Tensor) -> torch.Tensor:
    """A residual without non-finite values: a skipped non-finite step must not poison every
    later step through the error feedback."""
    return torch.nan_to_num(tensor, nan=0.0, posinf=0.0, neginf=0.0)


def choose_levels(errors: torch.Tensor, sizes: torch.Tensor, reference: int,
                  bins: int = DP_BINS) -> list[int]:
    """L-GreCo's choice: per layer (row) one level (column) minimizing the total size subject to
    the total error <= the total error of every layer at level ``reference``.

    A 0/1 knapsack over layers, by dynamic programming on the error discretized into ``bins``
    units of ``budget / bins``, each rounded *up* (so every solution the program admits is within
    the true budget); ``O(layers x levels x bins)``. Rounding can make the program miss a better
    solution or even the uniform one, so the uniform choice is kept whenever it is not beaten."""
    errors, sizes = errors.double(), sizes.double()
    layers, levels = errors.shape
    uniform = [reference] * layers
    budget = float(errors[:, reference].sum())
    if layers == 0 or not math.isfinite(budget):  # nothing to choose, or a non-finite step
        return uniform
    if budget <= 0:  # only exact levels fit: the cheapest of those per layer
        exact = torch.where(errors <= 0, sizes, torch.full_like(sizes, math.inf))
        return [int(i) for i in exact.argmin(dim=1)]
    unit = budget / bins
    # beyond the budget (or not finite): bins + 1, a level the program never takes
    weights = torch.ceil(errors / unit).clamp(min=0).nan_to_num(bins + 1).clamp(max=bins + 1)
    best = torch.full((bins + 1,), math.inf, dtype=torch.float64)
    best[0] = 0.0  # best[b]: least total size of the layers so far at discretized error b
    choices = torch.zeros((layers, bins + 1), dtype=torch.long)
    for layer in range(layers):
        candidates = torch.full((levels, bins + 1), math.inf, dtype=torch.float64)
        for level in range(levels):
            w = int(weights[layer, level])
            if w <= bins:
                candidates[level, w:] = best[:bins + 1 - w] + sizes[layer, level]
        best, choices[layer] = candidates.min(dim=0)
    if not torch.isfinite(best).any():
        return uniform
    b = int(best.argmin())
    picked = [0] * layers
    for layer in reversed(range(layers)):
        picked[layer] = int(choices[layer, b])
        b -= int(weights[layer, picked[layer]])
    uniform_size = float(sizes[:, reference].sum())
    chosen_size = float(sum(sizes[layer, level] for layer, level in enumerate(picked)))
    return picked if chosen_size < uniform_size else uniform


@dataclass
class _Bucket:
    """One bucket in flight: its tensors, the collective and what decoding needs."""

    grads: list[torch.Tensor]
    work: Any
    buffer: torch.Tensor
    extra: dict[str, Any]


class GradCompressor:
    """Compress each bucket's gradients, send them, write the averages back (one per reducer).

    ``launch(params, grads)`` runs in the bucket's hook: adds the residuals, compresses, starts
    the collective; ``complete(buckets)`` at the reducer's ``finish``: waits, decodes, averages
    into ``grads`` and keeps the residuals. Subclasses fill in the compression."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, size: int,
                 spec: CompressionSpec, *, ledger: comm.CommLedger | None = None,
                 axis: str = "dp", seed: int = 0) -> None:
        self.group, self.size, self.spec = group, size, spec
        self.ledger, self.axis, self.seed = ledger, axis, seed
        self.params = list(params)  # the reducer's order: the slot of each tensor's state
        self.slot = {id(p): i for i, p in enumerate(self.params)}
        # fp32 whatever the parameters' dtype: a bf16 parameter's gradient is reduced from its
        # fp32 accumulation (``main_grad``), and a residual rounded to bf16 would lose part of
        # what error feedback owes the next step
        self.residual = [torch.zeros_like(local_shard(p), dtype=torch.float32)
                         for p in self.params]
        self.level = torch.full((len(self.params),), REFERENCE_LEVEL, dtype=torch.long)
        self.steps = torch.zeros((), dtype=torch.long)
        self._errors: dict[int, torch.Tensor] = {}  # L-GreCo's measurements this step, by slot

    # -- the reducer's side ---------------------------------------------------------------------
    def launch(self, params: list[nn.Parameter], grads: list[torch.Tensor]) -> _Bucket:
        slots = [self.slot[id(p)] for p in params]
        sums = [g + self.residual[s] for g, s in zip(grads, slots)]  # g + e
        if self._measuring():
            for s, c in zip(slots, sums):
                if self._adaptive_layer(s):
                    self._errors[s] = self._level_errors(s, c)
        return self._launch(params, grads, slots, sums)

    def complete(self, buckets: list[_Bucket]) -> None:
        self._complete(buckets)
        if self._measuring():
            self._refresh_levels()
        self.steps += 1

    # -- L-GreCo --------------------------------------------------------------------------------
    def _measuring(self) -> bool:
        return self.spec.adaptive == "lgreco" and int(self.steps) % self.spec.refresh == 0

    def _adaptive_layer(self, slot: int) -> bool:
        return True

    def _level_errors(self, slot: int, accumulated: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def level_sizes(self, slot: int) -> list[int]:
        """Bytes this rank sends for the tensor at each candidate level."""
        raise NotImplementedError

    def _refresh_levels(self) -> None:
        """Sum the measured error tables over the group (every rank then decides alike) and
        choose the levels of the next steps."""
        measured, self._errors = self._errors, {}
        slots = sorted(measured)
        if not slots:
            return
        errors = torch.stack([measured[s] for s in slots]).to(self.residual[0].device)
        comm.all_reduce(errors, self.group, axis=self.axis, ledger=self.ledger)
        sizes = torch.tensor([self.level_sizes(s) for s in slots], dtype=torch.float64)
        for s, level in zip(slots, choose_levels(errors.cpu(), sizes, REFERENCE_LEVEL)):
            self.level[s] = level

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The live state tensors (checkpoints load into them in place), by slot."""
        state = {"steps": self.steps, "level": self.level}
        state.update({f"residual.{i}": r for i, r in enumerate(self.residual)})
        return state

    # -- subclasses -----------------------------------------------------------------------------
    def _launch(self, params: list[nn.Parameter], grads: list[torch.Tensor], slots: list[int],
                sums: list[torch.Tensor]) -> _Bucket:
        raise NotImplementedError

    def _complete(self, buckets: list[_Bucket]) -> None:
        raise NotImplementedError


def copy_back(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    """Write a flat buffer back into the gradients it was packed from, in order."""
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class Int8Compressor(GradCompressor):
    """Per-chunk int8 with error feedback; all-gather, then decode and average locally."""

    @staticmethod
    def quantize(flat: torch.Tensor, chunk: int = INT8_CHUNK
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, scales, sent)``: int8 values (one per element; the last chunk may be short),
        one fp32 scale per chunk, and the fp32 values the peers will decode (``flat - sent`` is
        the residual)."""
        chunks = max(1, math.ceil(flat.numel() / chunk))
        padded = torch.zeros(chunks * chunk, dtype=torch.float32, device=flat.device)
        padded[:flat.numel()] = flat
        rows = padded.view(chunks, chunk)
        scales = rows.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero chunk
        q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        sent = (q.float() * scales[:, None]).view(-1)[:flat.numel()]
        return q.view(-1)[:flat.numel()], scales, sent

    @staticmethod
    def payload_bytes(numel: int) -> int:
        """Bytes one rank contributes for a bucket of ``numel`` elements."""
        return numel + 4 * max(1, math.ceil(numel / INT8_CHUNK))

    def _launch(self, params: list[nn.Parameter], grads: list[torch.Tensor],
                slots: list[int], sums: list[torch.Tensor]) -> _Bucket:
        flat = torch.cat([c.reshape(-1) for c in sums]).float()
        q, scales, sent = self.quantize(flat)
        copy_back(_clean(flat - sent), [self.residual[s] for s in slots])
        payload = torch.cat([scales.view(torch.int8), q])  # one message: scales, then values
        gathered = torch.empty(self.size * payload.numel(), dtype=torch.int8, device=q.device)
        work = comm.all_gather_into_tensor(gathered, payload, self.group, axis=self.axis,
                                           ledger=self.ledger, async_op=True)
        return _Bucket(grads, work, gathered,
                       {"values": q.numel(), "chunks": scales.numel()})

    def _complete(self, buckets: list[_Bucket]) -> None:
        for bucket in buckets:
            bucket.work.wait()
            values, chunks = bucket.extra["values"], bucket.extra["chunks"]
            total = torch.zeros(chunks * INT8_CHUNK, dtype=torch.float32,
                                device=bucket.buffer.device)
            decoded = torch.zeros_like(total)
            for part in bucket.buffer.view(self.size, -1):  # rank order: the same sum everywhere
                scales = part[:4 * chunks].clone().view(torch.float32)  # a part may be unaligned
                decoded[:values] = part[4 * chunks:]
                total += (decoded.view(chunks, -1) * scales[:, None]).view(-1)
            copy_back(total[:values].div_(self.size), bucket.grads)


class TopKCompressor(GradCompressor):
    """Per-tensor top-k with error feedback; values and indices all-gathered."""

    def ratios(self) -> list[float]:
        """The fraction sent at each level (without L-GreCo every tensor stays at the reference
        level: the configured ratio)."""
        base = self.spec.topk_ratio
        return [min(1.0, base * f) for f in LEVEL_FACTORS]

    def k_of(self, slot: int, level: int | None = None) -> int:
        numel = self.residual[slot].numel()
        ratio = self.ratios()[int(self.level[slot]) if level is None else level]
        return max(1, min(numel, math.ceil(ratio * numel)))

    def level_sizes(self, slot: int) -> list[int]:
        return [8 * self.k_of(slot, level) for level in range(len(LEVEL_FACTORS))]

    def _level_errors(self, slot: int, accumulated: torch.Tensor) -> torch.Tensor:
        squares = accumulated.double().reshape(-1).square().sort(descending=True).values
        kept = torch.cat([squares.new_zeros(1), squares.cumsum(0)])
        total = kept[-1]
        return torch.stack([total - kept[self.k_of(slot, level)]
                            for level in range(len(LEVEL_FACTORS))]).clamp(min=0)

    @staticmethod
    def select(accumulated: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest-magnitude elements of the flattened tensor: (indices, values)."""
        flat = accumulated.reshape(-1)
        indices = flat.abs().topk(k, sorted=False).indices
        return indices, flat[indices]

    def _launch(self, params: list[nn.Parameter], grads: list[torch.Tensor],
                slots: list[int], sums: list[torch.Tensor]) -> _Bucket:
        values, indices, offset = [], [], 0
        for s, c in zip(slots, sums):
            index, value = self.select(c.float(), self.k_of(s))
            residual = c.float().reshape(-1).clone()
            residual[index] = 0.0  # what was sent leaves the residual; the rest waits
            self.residual[s].copy_(_clean(residual).view_as(self.residual[s]))
            values.append(value)
            indices.append(index + offset)
            offset += c.numel()
        value_part = torch.cat(values)
        payload = torch.cat([value_part.view(torch.int32), torch.cat(indices).to(torch.int32)])
        gathered = torch.empty(self.size * payload.numel(), dtype=torch.int32,
                               device=payload.device)
        work = comm.all_gather_into_tensor(gathered, payload, self.group, axis=self.axis,
                                           ledger=self.ledger, async_op=True)
        return _Bucket(grads, work, gathered, {"numel": offset, "k": value_part.numel()})

    def _complete(self, buckets: list[_Bucket]) -> None:
        for bucket in buckets:
            bucket.work.wait()
            k = bucket.extra["k"]
            total = torch.zeros(bucket.extra["numel"], dtype=torch.float32,
                                device=bucket.buffer.device)
            for part in bucket.buffer.view(self.size, -1):  # rank order: the same sum everywhere
                total.index_add_(0, part[k:].long(), part[:k].contiguous().view(torch.float32))
            copy_back(total.div_(self.size), bucket.grads)


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the columns (reduced QR; PowerSGD's orthogonalization)."""
    return torch.linalg.qr(matrix, mode="reduced").Q


class PowerSGDCompressor(GradCompressor):
    """Rank-r PowerSGD with warm start and error feedback (two all-reduces per bucket)."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, size: int,
                 spec: CompressionSpec, **kwargs: Any) -> None:
        super().__init__(params, group, size, spec, **kwargs)
        top = max(self.ranks())
        self.q: dict[int, torch.Tensor] = {}
        for slot, residual in enumerate(self.residual):
            if residual.dim() >= 2:  # the warm-start Q, seeded: the same on every rank
                rows, cols = residual.shape[0], math.prod(residual.shape[1:])
                generator = torch.Generator().manual_seed(self.seed * 100_003 + slot)
                q = torch.randn(cols, min(top, rows, cols), generator=generator)
                self.q[slot] = q.to(residual.device)

    def ranks(self) -> list[int]:
        """The rank of each level (all the configured one without L-GreCo)."""
        base = self.spec.rank
        if self.spec.adaptive != "lgreco":
            return [base] * len(LEVEL_FACTORS)
        return [max(1, int(base * f)) for f in LEVEL_FACTORS]

    def rank_of(self, slot: int, level: int | None = None) -> int | None:
        """The rank the matrix in ``slot`` is sent at, or None: uncompressed (a vector, or a
        matrix too small to pay)."""
        shape = self.residual[slot].shape
        if len(shape) < 2:
            return None
        rows, cols = shape[0], math.prod(shape[1:])
        rank = min(self.ranks()[int(self.level[slot]) if level is None else level],
                   self.q[slot].shape[1])
        if (rows + cols) * rank * self.spec.min_compression_rate >= rows * cols:
            return None
        return rank

    def _adaptive_layer(self, slot: int) -> bool:
        return self.residual[slot].dim() >= 2

    def level_sizes(self, slot: int) -> list[int]:
        shape = self.residual[slot].shape
        rows, cols = shape[0], math.prod(shape[1:])
        sizes = []
        for level in range(len(LEVEL_FACTORS)):
            rank = self.rank_of(slot, level)
            sizes.append(4 * rows * cols if rank is None else 4 * (rows + cols) * rank)
        return sizes

    def _level_errors(self, slot: int, accumulated: torch.Tensor) -> torch.Tensor:
        # The squared error of the compressor itself at each rank: one power iteration from the
        # warm-started Q on this rank's g + e, as the step runs it (before the group's sum of
        # the Ps). Its approximation is the projection B B^T M onto B = orth(M Q_r), so its error
        # is ||M||^2 - ||B^T M||^2; the first r columns of the QR of M Q_top span M Q_r, so one QR
        # at the largest rank serves every level. A non-finite gradient (a step about to be
        # skipped) is measured as zeros.
        matrix = _clean(accumulated.double().reshape(accumulated.shape[0], -1))
        ranks = [self.rank_of(slot, level) for level in range(len(LEVEL_FACTORS))]
        top = max((r for r in ranks if r is not None), default=0)
        basis = orthonormalize(matrix @ self.q[slot][:, :top].double())
        captured = torch.cat([matrix.new_zeros(1), (basis.t() @ matrix).square().sum(1).cumsum(0)])
        total = matrix.square().sum()
        return torch.stack([(total - captured[r]).clamp(min=0) if r is not None
                            else total.new_zeros(()) for r in ranks])

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = super().state_dict()
        state.update({f"q.{slot}": q for slot, q in self.q.items()})
        return state

    def _launch(self, params: list[nn.Parameter], grads: list[torch.Tensor],
                slots: list[int], sums: list[torch.Tensor]) -> _Bucket:
        dense, factors, matrices = [], [], []
        for s, c in zip(slots, sums):
            rank = self.rank_of(s)
            if rank is None:  # sent whole: nothing is left behind
                dense.append(c.reshape(-1).float())
                self.residual[s].zero_()
                continue
            matrix = c.float().reshape(c.shape[0], -1)
            factors.append(matrix @ self.q[s][:, :rank])
            matrices.append((s, matrix, rank))
        buffer = torch.cat(dense + [p.reshape(-1) for p in factors])  # a bucket is never empty
        work = comm.all_reduce(buffer, self.group, axis=self.axis, ledger=self.ledger,
                               async_op=True)
        return _Bucket(grads, work, buffer,
                       {"dense": sum(d.numel() for d in dense), "matrices": matrices,
                        "compressed": [self.rank_of(s) is not None for s in slots]})

    def _complete(self, buckets: list[_Bucket]) -> None:
        # Phase 2 of every bucket is issued before any is waited for: the Q all-reduces overlap.
        second = []
        for bucket in buckets:
            bucket.work.wait()
            offset, bases, qs = bucket.extra["dense"], [], []
            for s, matrix, rank in bucket.extra["matrices"]:
                p = bucket.buffer[offset:offset + matrix.shape[0] * rank].view(-1, rank)
                offset += p.numel()
                basis = orthonormalize(p)
                bases.append(basis)
                qs.append(matrix.t() @ basis)
            q_buffer = torch.cat([q.reshape(-1) for q in qs]) if qs else bucket.buffer[:0]
            work = comm.all_reduce(q_buffer, self.group, axis=self.axis, ledger=self.ledger,
                                   async_op=True) if qs else None
            second.append((work, q_buffer, bases))
        for bucket, (work, q_buffer, bases) in zip(buckets, second):
            if work is not None:
                work.wait()
            dense = bucket.buffer[:bucket.extra["dense"]].div(self.size)
            offset, approximations = 0, []
            for (s, matrix, rank), basis in zip(bucket.extra["matrices"], bases):
                q = q_buffer[offset:offset + matrix.shape[1] * rank].view(-1, rank).div(self.size)
                offset += q.numel()
                approximation = basis @ q.t()
                self.residual[s].copy_(_clean(matrix - approximation).view_as(self.residual[s]))
                # warm start: the averaged Q, unless degenerate (a zero or non-finite gradient)
                keep = torch.isfinite(q).all() & q.ne(0).any()
                self.q[s][:, :rank] = torch.where(keep, q, self.q[s][:, :rank])
                approximations.append(approximation)
            dense_offset, matrix_index = 0, 0
            for grad, compressed in zip(bucket.grads, bucket.extra["compressed"]):
                if compressed:
                    grad.copy_(approximations[matrix_index].view_as(grad))
                    matrix_index += 1
                else:
                    grad.copy_(dense[dense_offset:dense_offset + grad.numel()].view_as(grad))
                    dense_offset += grad.numel()


_COMPRESSORS = {"int8": Int8Compressor, "topk": TopKCompressor, "powersgd": PowerSGDCompressor}


def build_compressor(params: Sequence[nn.Parameter], group: Any, size: int,
                     spec: CompressionSpec | None, *, ledger: comm.CommLedger | None = None,
                     axis: str = "dp", seed: int = 0) -> GradCompressor | None:
    """The compressor of ``spec.method`` for a reducer's ``params`` (its order), or None for
    ``none`` (the reducer's own fp32 all-reduce, bit for bit)."""
    if spec is None or spec.method == "none":
        return None
    if spec.method not in _COMPRESSORS:
        raise ValueError(f"grad_compression={spec.method!r}: one of {METHODS}")
    if spec.adaptive == "lgreco" and spec.method == "int8":
        raise ValueError("compression_adaptive=lgreco needs powersgd or topk levels, not int8")
    return _COMPRESSORS[spec.method](params, group, size, spec, ledger=ledger, axis=axis,
                                     seed=seed)


__all__ = ["CompressionSpec", "GradCompressor", "Int8Compressor", "TopKCompressor",
           "PowerSGDCompressor", "build_compressor", "choose_levels", "METHODS", "ADAPTIVE"]
