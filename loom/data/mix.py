"""Mixing sources by weight (``data.mix = "path_a:0.7,path_b:0.3"``), deterministically and
resumably.

``MixSampler`` has the interface of ``loader.GlobalBatchSampler`` and keeps its two guarantees: the
dataset sample behind global index g is a pure function of (seed, g), so the loader's whole state
is still the count of consumed samples, and a run resumes at the same sample at any data-parallel
degree (rank slices of a global batch are contiguous, as before). How g is mapped:

* **which source**: the global stream is cut into blocks of ``BLOCK`` samples; every block holds
  exactly ``quota[s]`` samples of source s (the weights apportioned to ``BLOCK`` by largest
  remainder, so proportions are exact to 1/``BLOCK`` per block), in an order shuffled by
  ``(seed, block)``. The count of earlier samples of the same source is then
  ``block * quota[s] + (its rank inside the block)``: no history has to be replayed on resume.
* **which sample of that source**: the c-th draw from source s is position c % n_s of that
  source's own epoch c // n_s, a permutation seeded by ``(seed, s, epoch)``: each source is
  traversed without replacement and reshuffled when it is exhausted, independently of the others
  (a small source is repeated, a large one is not exhausted, as the weights say).

``MixedSequences`` presents the sources' packed samples as one index space (source s's samples
after those of sources < s) for the loader; ``interleaved_order`` orders validation samples
the same way but without shuffling or repetition, so evaluation sees the mixture too.

Hand-written because nothing in ``torch.utils.data`` or ``datasets`` gives a stateless,
index-addressable mixture (``interleave_datasets`` is an iterator whose position is its history).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from loom.data.packing import DocumentBatch, stack_rows
from loom.data.samples import BatchSampler, WindowedSamples
from loom.errors import ConfigError, path_error, shortened

BLOCK = 10_000
_TAG_BLOCK, _TAG_SOURCE = 0x6D6978, 0x737263  # separate the two kinds of seeded streams


@dataclass(frozen=True)
class MixEntry:
    path: str
    weight: float


def parse_mix(spec: str) -> list[MixEntry]:
    """``"path_a:0.7,path_b:0.3"`` -> entries; ConfigError naming ``data.mix`` for a malformed
    entry, a weight that is not a finite number or is negative, weights that do not sum to a
    positive finite number, or a positive weight too small to get one sample in ``BLOCK``. The
    paths are not looked at (``check_mix_paths``). A path may hold ':' (the weight is after the
    last one), not ','."""
    entries = []
    for raw in spec.split(","):
        item = raw.strip()
        path, sep, weight_text = item.rpartition(":")
        if not item or not sep or not path.strip():
            raise ConfigError("data.mix", spec, f"entry {item!r} is not path:weight (write"
                              " data.mix=\"path_a:0.7,path_b:0.3\")")
        try:
            weight = float(weight_text)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ConfigError("data.mix", spec, f"weight {weight_text.strip()!r} of"
                              f" {path.strip()!r} is not a finite number")
        if weight < 0:
            raise ConfigError("data.mix", spec, f"weight {weight:g} of {path.strip()!r} is"
                              " negative")
        entries.append(MixEntry(path.strip(), weight))
    total = sum(e.weight for e in entries)
    if total <= 0:
        raise ConfigError("data.mix", spec, "the weights must sum to a positive number")
    if not math.isfinite(total):  # every share would be w / inf = 0: the quotas a tie-break
        raise ConfigError("data.mix", spec, "the weights sum past the largest float; scale them"
                          " down (only their ratios matter)")
    quotas = block_quotas([e.weight for e in entries])
    for entry, quota in zip(entries, quotas):
        if entry.weight > 0 and quota == 0:
            raise ConfigError("data.mix", spec, f"weight {entry.weight:g} of {entry.path!r} is"
                              f" below 1/{BLOCK} of the total")
    return entries


def check_mix_paths(spec: str, entries: Sequence[MixEntry]) -> None:
    """ConfigError naming ``data.mix`` for a path that does not exist ("stdlib" exists)."""
    for entry in entries:
        why = path_error(entry.path)
        if why:
            raise ConfigError("data.mix", shortened(spec), f"path {shortened(entry.path)!r} {why}")
        if entry.path != "stdlib" and not os.path.exists(os.path.expanduser(entry.path)):
            raise ConfigError("data.mix", spec, f"path {entry.path!r} does not exist")


def block_quotas(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
    """Samples of each source per block: the weights apportioned to ``block`` by largest
    remainder (ties to the earlier source), summing to ``block``."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block
    quotas = np.floor(exact).astype(np.int64)
    short = block - int(quotas.sum())
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[:short]:
        quotas[i] += 1
    return quotas


class MixSampler(BatchSampler):
    """Global sample indices of a mixture (see the module docstring); the interface of
    ``GlobalBatchSampler``. Dataset index = ``offsets[s] + local sample of source s``."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], global_batch_size: int,
                 seed: int = 0) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError("one weight per source, and at least one source")
        super().__init__(global_batch_size, seed)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.quotas = block_quotas(weights)
        empty = [i for i in range(len(sizes)) if self.quotas[i] > 0 and self.sizes[i] < 1]
        if empty:
            raise ValueError(f"mixed source(s) {empty} have a weight but no sample")
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]])
        self.num_samples = int(self.sizes.sum())
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each position of block b, its rank among that source's positions)."""
        if b not in self._blocks:
            if len(self._blocks) >= 2:  # a batch spans at most two blocks
                self._blocks.pop(min(self._blocks))
            rng = np.random.default_rng((self.seed, _TAG_BLOCK, b))
            source = rng.permutation(np.repeat(np.arange(len(self.quotas)), self.quotas))
            rank = np.empty(BLOCK, dtype=np.int64)
            for s in range(len(self.quotas)):
                where = np.flatnonzero(source == s)
                rank[where] = np.arange(len(where))
            self._blocks[b] = (source, rank)
        return self._blocks[b]

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        key = (s, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2 * len(self.sizes):
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng((self.seed, _TAG_SOURCE, s, epoch))
            self._perms[key] = rng.permutation(int(self.sizes[s]))
        return self._perms[key]

    def draws(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw count c from that source) of global indices start .. start+count-1."""
        g = np.arange(start, start + count, dtype=np.int64)
        blocks, pos = np.divmod(g, BLOCK)
        source = np.empty_like(g)
        nth = np.empty_like(g)
        for b in np.unique(blocks):
            sel = blocks == b
            src, rank = self.block(int(b))
            source[sel] = src[pos[sel]]
            nth[sel] = int(b) * self.quotas[src[pos[sel]]] + rank[pos[sel]]
        return source, nth

    def indices(self, start: int, count: int) -> np.ndarray:
        source, nth = self.draws(start, count)
        epochs, positions = np.divmod(nth, self.sizes[source])
        out = np.empty_like(source)
        for s, e in sorted(set(zip(source.tolist(), epochs.tolist()))):
            sel = (source == s) & (epochs == e)
            out[sel] = self.offsets[s] + self._permutation(s, e)[positions[sel]]
        return out


def interleaved_order(sizes: Sequence[int], weights: Sequence[float], seed: int = 0) -> np.ndarray:
    """Dataset indices of the sources' samples in mixture order, each at most once and in order
    within its source, up to the first source that runs out (sources without a sample are left
    out). For validation: every evaluation sees the same samples, mixed as training is."""
    sizes = np.asarray(sizes, dtype=np.int64)
    live = [i for i in range(len(sizes)) if sizes[i] > 0 and weights[i] > 0]
    if not live:
        return np.zeros(0, dtype=np.int64)
    sampler = MixSampler([int(sizes[i]) for i in live], [weights[i] for i in live], 1, seed)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = []
    start = 0
    while True:
        source, nth = sampler.draws(start, BLOCK)
        over = np.flatnonzero(nth >= sampler.sizes[source])
        stop = int(over[0]) if len(over) else BLOCK
        out.append(offsets[np.asarray(live)[source[:stop]]] + nth[:stop])
        if stop < BLOCK:
            return np.concatenate(out)
        start += BLOCK


class MixedSequences(WindowedSamples):
    """Packed datasets (``loader.PackedSequences``, or ``packing.PackedDocuments`` under
    ``data.packing = "pack"``) as one index space, optionally reordered: sample j is
    ``order[j]`` of the concatenation when ``order`` is given."""

    def __init__(self, parts: Sequence, order: np.ndarray | None = None) -> None:
        if not parts or len({(p.seq_len, p.packing) for p in parts}) != 1:
            raise ValueError("mixed datasets need at least one part, all of one seq_len and"
                             " one packing")
        self.parts = list(parts)
        self.seq_len = parts[0].seq_len
        self.packing = parts[0].packing
        self.ends = np.cumsum([len(p) for p in parts])
        self.order = order

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    def __len__(self) -> int:
        return int(self.ends[-1]) if self.order is None else len(self.order)

    def _locate(self, i: int) -> tuple[int, int]:
        """(part, sample of that part) of sample i."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} mixed samples")
        j = int(self.order[i]) if self.order is not None else i
        part = int(np.searchsorted(self.ends, j, side="right"))
        start = int(self.ends[part - 1]) if part else 0
        return part, j - start

    def window(self, i: int) -> np.ndarray:
        part, local = self._locate(i)
        return self.parts[part].window(local)

    def row(self, i: int) -> tuple[np.ndarray, ...]:
        """Packed row i (``PackedDocuments.row``) of the part it comes from."""
        part, local = self._locate(i)
        return self.parts[part].row(local)

    def __getitem__(self, i: int):
        if self.packing == "pack":
            return DocumentBatch(*(torch.from_numpy(a) for a in self.row(int(i))))
        return super().__getitem__(i)

    def batch(self, indices: Sequence[int] | np.ndarray):
        if self.packing == "pack":
            return stack_rows([self.row(int(i)) for i in indices], self.seq_len)
        return super().batch(indices)

