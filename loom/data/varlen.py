"""Variable-length microbatches (``data.packing = "varlen"``): token budgets of whole documents.

``pack`` (``loom.data.packing``) lays documents into fixed rows and pads what is left;
``varlen`` has no rows and no padding. Its terms:

* **Pieces** (``split_pieces``). A document of L tokens gives L - 1 predictions; they are cut
  into pieces of at most ``data.seq_len`` predictions (the *split length*: RoPE positions
  restart at each piece and stay below ``model.max_seq_len``). Each piece is attended as a
  document of its own. A piece is the sampling unit: the pieces of a token range are drawn in a
  seeded order, a fresh permutation per epoch (``loader.GlobalBatchSampler``'s), so a long
  document's pieces land in different steps, like ``concat``'s windows.
* **A step** is ``N = train.global_batch_tokens / data.tokens_per_microbatch`` microbatches
  (*bins*) of at most ``B = data.tokens_per_microbatch`` predictions each. ``plan_step`` takes
  the next pieces in the sampling order, each into the first bin with room for it (first fit);
  the step ends before the first piece no bin has room for (so a step is always a prefix of the
  sampling order). ``B >= seq_len`` (a config rule) so every bin holds at least one piece, and
  a step holds at most ``global_batch_tokens`` predictions. The
  bins depend on the two token budgets and the data only, never on the layout: **every layout
  trains the same documents, and even the same microbatches, in the same step.**
* **Data-parallel ranks.** Rank r of d takes bins ``[r*M, (r+1)*M)`` with ``M = N / d``
  microbatches (the config requires ``d`` to divide ``N``): every rank, and every pipeline, runs
  the same number of microbatches (the schedule is built once), each of its own token count.
* **``data.balance``.** ``none``: the bins as filled above. ``tokens`` (the simple baseline of
  Zeppelin, Chen et al. 2025): the same step's pieces, longest first, each dealt to the bin with
  the fewest predictions so far (ties: the lowest bin), so every microbatch, and so every rank,
  gets nearly equal tokens. The deal is still layout-independent. ``zeppelin`` deals the bins
  the same way; what differs is how each microbatch is placed over the cp ranks
  (``loom.parallel.zeppelin_cp``). Should it put more than ``B``
  predictions in a bin (possible only when the step's pieces nearly fill every bin), that step
  keeps the ``none`` bins: the budget is a hard bound (it is what sizes activation memory).
* **A microbatch** (``VarlenDocuments.microbatch``) is one row ``[1, T]`` (T its predictions):
  ``inputs``, ``targets``, ``positions`` (restarting at every piece) and ``document_ids`` (the
  piece's ordinal inside the microbatch, so neighbours always differ), a
  ``packing.DocumentBatch``. The model's document attention (``loom.models.document_attention``)
  takes it as it is: per piece SDPA on the CPU, a ``BlockMask`` on GPUs; no ``[T, T]`` mask.

The loss is the mean over the step's predictions, however they are spread (the trainer divides
each microbatch's summed loss by the step's prediction count); with no padding every prediction
is real. Hand-written, not ``torch.utils.data``: the plan must be a pure function of (seed,
consumed pieces), identical on every rank without communication, and its state one number.
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from loom.data.budgets import BALANCES, balance_tokens, first_fit, token_budgets  # noqa: F401
from loom.data.packing import DocumentBatch, DocumentTokens

class PieceOrder(Protocol):
    """The seeded sampling order over pieces: ``loader.GlobalBatchSampler`` is one (a protocol,
    because the loader imports this module to build varlen datasets)."""

    num_samples: int
    seed: int

    def indices(self, start: int, count: int) -> np.ndarray: ...


class Pieces(NamedTuple):
    """Piece p is ``length[p]`` predictions of document ``document[p]`` from its token
    ``offset[p]`` (int64 arrays)."""

    document: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def split_pieces(document_lengths: Sequence[int] | np.ndarray, split_len: int) -> Pieces:
    """Every document's predictions (its tokens - 1) cut into pieces of at most ``split_len``,
    in order; a one-token document predicts nothing and gives none."""
    if split_len < 1:
        raise ValueError(f"split length {split_len} must be >= 1")
    predictions = np.maximum(np.asarray(document_lengths, dtype=np.int64) - 1, 0)
    counts = -(-predictions // split_len)  # pieces per document
    document = np.repeat(np.arange(len(predictions), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # index of each document's first piece
    index = np.arange(len(document), dtype=np.int64) - np.repeat(first, counts)
    offset = index * split_len
    length = np.minimum(predictions[document] - offset, split_len)
    return Pieces(document, offset, length)


class StepPlan(NamedTuple):
    """One step's pieces (dataset piece indices, in sampling order) and the bin of each."""

    pieces: np.ndarray
    bins: np.ndarray
    num_bins: int

    def microbatch_pieces(self, first_bin: int, count: int) -> list[np.ndarray]:
        """The pieces of bins ``first_bin .. first_bin + count - 1``, each in sampling order."""
        return [self.pieces[self.bins == b] for b in range(first_bin, first_bin + count)]


def plan_step(order: Callable[[int, int], np.ndarray], start: int, lengths: np.ndarray,
              num_bins: int, budget: int, balance: str = "none",
              available: int | None = None) -> tuple[StepPlan, int] | None:
    """The step that begins at sampling position ``start`` (module docstring): its plan and
    how many pieces it took. ``order(start, count)`` gives the dataset pieces at sampling
    positions ``start ..``; ``lengths`` every piece's predictions. ``available`` bounds the
    positions (evaluation: a split read once, in order); None when they run out before the
    step's last bin is reached (no partial step)."""
    count = max(64, 2 * num_bins)
    while True:
        if available is not None:
            count = min(count, available - start)
        pieces = order(start, count)
        taken, bins = first_fit(lengths[pieces], num_bins, budget)
        if taken < len(pieces):
            break
        if available is not None and start + count >= available:
            return None
        count *= 2
    pieces = pieces[:taken]
    if balance in ("tokens", "zeppelin"):  # zeppelin: the same bins, placed over cp later
        dealt = balance_tokens(lengths[pieces], num_bins, budget)
        bins = dealt if dealt is not None else bins
    elif balance != "none":
        raise ValueError(f"data.balance={balance!r}: must be one of {', '.join(BALANCES)}")
    return StepPlan(pieces, bins, num_bins), taken


class VarlenBatch(NamedTuple):
    """One rank's microbatches of a step (``DocumentBatch``es of shape ``[1, T_i]``) and the
    step's predictions over every rank."""

    microbatches: tuple[DocumentBatch, ...]
    step_tokens: int

    def to(self, device: str | torch.device) -> "VarlenBatch":
        return VarlenBatch(tuple(mb.to(device) for mb in self.microbatches), self.step_tokens)


class VarlenDocuments(DocumentTokens):
    """A token range as pieces of documents (``data.packing = "varlen"``; module docstring).

    ``tokens`` the range (memory-mapped), ``offsets`` its document offsets (``num_docs + 1``
    values from 0 to ``len(tokens)``), ``seq_len`` the split length. A sample is a piece.
    """

    packing = "varlen"

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int,
                 name: str = "") -> None:
        super().__init__(tokens, offsets, seq_len, name)
        self.pieces = split_pieces(np.diff(self.offsets), seq_len)

    @property
    def lengths(self) -> np.ndarray:
        """Every piece's predictions."""
        return self.pieces.length

    def __len__(self) -> int:
        return len(self.pieces.length)

    def piece(self, p: int) -> np.ndarray:
        """Piece ``p``'s tokens: its predictions' inputs and, one further, their targets."""
        doc, n = int(self.pieces.document[p]), int(self.pieces.length[p])
        first = int(self.offsets[doc] + self.pieces.offset[p])
        return np.asarray(self.tokens[first:first + n + 1], dtype=np.int64)

    def microbatch(self, pieces: Sequence[int] | np.ndarray) -> DocumentBatch:
        """The given pieces, in order, as one row ``[1, T]`` (T their predictions)."""
        return _row([self.piece(p) for p in np.asarray(pieces, dtype=np.int64).tolist()])

    def rank_batch(self, plan: StepPlan, dp_rank: int, dp_size: int) -> VarlenBatch:
        return _rank_batch(self, plan, dp_rank, dp_size)


class MixedPieces:
    """Several sources' pieces (``data.mix`` with ``varlen``) as one index space: piece j of
    the concatenation is piece ``j - start`` of the source it falls in (source s's pieces after
    those of sources < s), or, with ``order``, ``order[j]`` of the concatenation (validation in
    mixture order, ``mix.interleaved_order``). The interface ``VarlenLoader`` and
    ``varlen_eval_batches`` read: ``lengths``, ``len``, ``microbatch``, ``rank_batch``; a
    microbatch may hold pieces of every source (document ordinals still run per row)."""

    packing = "varlen"

    def __init__(self, parts: Sequence[VarlenDocuments], order: np.ndarray | None = None) -> None:
        if not parts or len({p.seq_len for p in parts}) != 1:
            raise ValueError("mixed pieces need at least one source, all of one split length")
        self.parts = list(parts)
        self.seq_len = parts[0].seq_len
        self.name = " + ".join(p.name for p in parts)
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        self.order = None if order is None else np.asarray(order, dtype=np.int64)
        lengths = np.concatenate([p.lengths for p in parts])
        self._lengths = lengths if self.order is None else lengths[self.order]

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    def __len__(self) -> int:
        return len(self._lengths)

    def microbatch(self, pieces: Sequence[int] | np.ndarray) -> DocumentBatch:
        index = np.asarray(pieces, dtype=np.int64)
        if self.order is not None:
            index = self.order[index]
        source = np.searchsorted(self.starts, index, side="right") - 1
        return _row([self.parts[s].piece(int(j - self.starts[s]))
                     for s, j in zip(source.tolist(), index.tolist())])

    def rank_batch(self, plan: StepPlan, dp_rank: int, dp_size: int) -> VarlenBatch:
        return _rank_batch(self, plan, dp_rank, dp_size)


def _row(windows: list[np.ndarray]) -> DocumentBatch:
    """Pieces' token windows (each its inputs plus one target further) as one row ``[1, T]``:
    positions restart at every piece, document ids are the pieces' ordinals."""
    if not windows:
        raise ValueError("a varlen microbatch needs at least one piece")
    columns = [(w[:-1], w[1:], np.arange(len(w) - 1, dtype=np.int64),
                np.full(len(w) - 1, ordinal, dtype=np.int64)) for ordinal, w in enumerate(windows)]
    return DocumentBatch(*(torch.from_numpy(np.concatenate(column))[None]
                           for column in zip(*columns)))


def _rank_batch(dataset: VarlenDocuments | MixedPieces, plan: StepPlan, dp_rank: int,
                dp_size: int) -> VarlenBatch:
    """Data-parallel rank ``dp_rank``'s microbatches of ``plan``: its contiguous share of the
    bins."""
    per_rank = plan.num_bins // dp_size
    micro = [dataset.microbatch(p) for p in plan.microbatch_pieces(dp_rank * per_rank, per_rank)]
    return VarlenBatch(tuple(micro), int(dataset.lengths[plan.pieces].sum()))


def _check_split(dp_size: int, num_bins: int) -> None:
    if dp_size < 1 or num_bins % dp_size:
        raise ValueError(f"{num_bins} microbatches per step cannot be shared by {dp_size}"
                         " data-parallel ranks")


class VarlenLoader:
    """One data-parallel rank's varlen steps; its state is the count of consumed pieces.

    ``sampler`` is the training set's ``loader.GlobalBatchSampler`` over pieces (only its seeded
    ``indices``, ``num_samples`` and ``seed`` are read)."""

    def __init__(self, dataset: VarlenDocuments | MixedPieces, sampler: PieceOrder,
                 global_batch_tokens: int, tokens_per_microbatch: int, balance: str = "none",
                 dp_rank: int = 0, dp_size: int = 1,
                 device: str | torch.device = "cpu") -> None:
        if sampler.num_samples != len(dataset):
            raise ValueError(f"sampler.num_samples={sampler.num_samples} != {len(dataset)}"
                             " pieces in the dataset")
        self.num_bins = global_batch_tokens // tokens_per_microbatch
        _check_split(dp_size, self.num_bins)
        if int(dataset.lengths.sum()) <= global_batch_tokens:
            raise ValueError(f"{dataset.name or 'the training split'} holds"
                             f" {int(dataset.lengths.sum())} predictions, not more than one step"
                             f" of train.global_batch_tokens={global_batch_tokens}")
        self.dataset = dataset
        self.sampler = sampler
        self.global_batch_tokens = global_batch_tokens
        self.budget = tokens_per_microbatch
        self.balance = balance
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = torch.device(device)
        self.consumed_samples = 0
        self.last_step_tokens = 0  # the predictions of the last step drawn, over every rank

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.sampler.num_samples

    def next_batch(self) -> VarlenBatch:
        """This rank's ``num_bins / dp_size`` microbatches of the next step, on ``device``."""
        plan, taken = plan_step(self.sampler.indices, self.consumed_samples,
                                self.dataset.lengths, self.num_bins, self.budget, self.balance)
        self.consumed_samples += taken
        batch = self.dataset.rank_batch(plan, self.dp_rank, self.dp_size).to(self.device)
        self.last_step_tokens = batch.step_tokens
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "seed": self.sampler.seed,
                "global_batch_tokens": self.global_batch_tokens,
                "num_samples": self.sampler.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from the saved piece position, whatever layout saved it (seed and the
        piece count must match)."""
        if state["seed"] != self.sampler.seed:
            raise ValueError(f"resuming with seed={self.sampler.seed}, but the data state was"
                             f" saved with seed={state['seed']}")
        if state.get("num_samples", self.sampler.num_samples) != self.sampler.num_samples:
            raise ValueError(f"resuming over {self.sampler.num_samples} pieces, but the data"
                             f" state was saved over {state['num_samples']}: data.source,"
                             " data.max_bytes, data.seq_len or data.packing changed")
        self.consumed_samples = int(state["consumed_samples"])


def varlen_eval_batches(dataset: VarlenDocuments | MixedPieces, global_batch_tokens: int,
                        tokens_per_microbatch: int, balance: str = "none", max_batches: int = 0,
                        dp_rank: int = 0, dp_size: int = 1,
                        device: str | torch.device = "cpu") -> Iterator[VarlenBatch]:
    """Evaluation steps over the split's pieces in order (no shuffle), planned like training
    steps; only whole steps (a last one the pieces cannot fill is left out); ``max_batches``
    <= 0: all of them."""
    num_bins = global_batch_tokens // tokens_per_microbatch
    _check_split(dp_size, num_bins)
    device = torch.device(device)

    def in_order(first: int, count: int) -> np.ndarray:
        return np.arange(first, first + count, dtype=np.int64)

    def steps() -> Iterator[VarlenBatch]:
        start, done = 0, 0
        while max_batches <= 0 or done < max_batches:
            planned = plan_step(in_order, start, dataset.lengths, num_bins,
                                tokens_per_microbatch, balance, available=len(dataset))
            if planned is None:
                return
            plan, taken = planned
            start, done = start + taken, done + 1
            yield dataset.rank_batch(plan, dp_rank, dp_size).to(device)

    return steps()


__all__ = ["BALANCES", "Pieces", "StepPlan", "VarlenBatch", "VarlenDocuments", "VarlenLoader",
           "balance_tokens", "first_fit", "plan_step", "split_pieces", "token_budgets",
           "varlen_eval_batches"]
