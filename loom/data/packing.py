"""Document boundaries and packed rows (``data.packing``).

``concat`` (the default) cuts the token stream into windows that run across documents
(``loader.PackedSequences``). ``pack`` keeps documents apart:

* **The index.** Every token range gets document offsets (``num_docs + 1`` int64, from 0 to the
  range's length): from the ``doc_index.bin`` a ``loom data prepare`` directory holds
  (``prepared_offsets``; checked against its ``tokens.bin``), or, for the token files Loom
  writes itself (``train.bin``, ``val.bin``, ``mix*.bin``), from the end-of-document id that
  ``tokenizer.encode_documents`` puts after every document (``offsets_from_eos``). (With a
  Hugging Face tokenizer whose special tokens are matched in raw text, a document whose text
  spells out the end-of-sequence token is cut there too.)
* **The rows** (``pack_rows``). A document of L tokens gives L - 1 predictions (input token
  i, target token i + 1); documents are laid into rows of ``seq_len`` predictions in order. A
  document that fits in a row but not in what is left of the current one starts the next row
  (the rest is padding), so it stays whole; one longer than a row is split anyway, so it fills
  what is left and runs on over the rows it needs (each piece is attended as a document of its
  own: it cannot see the rows before it).
* **A row** (``DocumentBatch``) carries ``inputs``, ``targets``, ``positions`` (0 at the start
  of every document or piece, so RoPE restarts) and ``document_ids`` (the document's number in
  its token range; ``PAD_DOCUMENT`` for padding). Padding inputs are token 0 (any id would do:
  padding attends only to padding) and its targets ``IGNORE_INDEX``, the default
  ``ignore_index`` of ``torch.nn.functional.cross_entropy``, so its mean is over real tokens.

Rows are a pure function of the index and ``seq_len``: sample i is the same in every run, which
keeps the loader's resumable, layout-independent sampling (``loader.GlobalBatchSampler``). The
layout is computed once per token range, one Python step per document.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch

from loom.data.prepare import INDEX_FILE, PreparedData, check_offsets
from loom.errors import ConfigError

IGNORE_INDEX = -100  # target of a padding position: F.cross_entropy's default ignore_index
PAD_DOCUMENT = -1  # document id of padding positions


class DocumentBatch(NamedTuple):
    """Packed rows: four int64 tensors ``[B, S]`` (or ``[S]`` for one row)."""

    inputs: torch.Tensor
    targets: torch.Tensor  # IGNORE_INDEX at padding
    positions: torch.Tensor  # 0 at every document start
    document_ids: torch.Tensor  # PAD_DOCUMENT at padding

    def to(self, device: str | torch.device) -> "DocumentBatch":
        return DocumentBatch(*(t.to(device) for t in self))


def offsets_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Document offsets of a Loom-written token stream: a document ends after each
    end-of-document id; trailing tokens without one form a last document."""
    ends = np.flatnonzero(np.asarray(tokens) == eos_id) + 1
    offsets = np.concatenate([[0], ends]).astype(np.int64)
    if offsets[-1] != len(tokens):
        offsets = np.append(offsets, len(tokens))
    return offsets


def prepared_offsets(tokens_path: str | Path, start: int, end: int) -> np.ndarray:
    """Document offsets of tokens [start, end) of a prepared ``tokens.bin``, from the
    ``doc_index.bin`` beside it; ConfigError naming ``data.source`` when the index does not
    match the token file or the range does not fall on document boundaries."""
    prepared = PreparedData.open(Path(tokens_path).parent)
    source = str(prepared.directory)
    offsets = np.asarray(prepared.doc_offsets(), dtype=np.int64)
    check_offsets(offsets, prepared.num_tokens, source)
    first, last = np.searchsorted(offsets, [start, end])
    if first >= len(offsets) or offsets[first] != start or last >= len(offsets) \
            or offsets[last] != end:
        raise ConfigError("data.source", source, f"the token range [{start}, {end}) does not"
                          f" start and end on a document boundary of its {INDEX_FILE}")
    return offsets[first:last + 1] - start


class RowLayout(NamedTuple):
    """Where every row's pieces come from: piece p is ``piece_length[p]`` predictions of
    document ``piece_document[p]`` from its token ``piece_offset[p]``; row r holds pieces
    ``row_start[r]`` to ``row_start[r + 1]``, in order."""

    piece_document: np.ndarray
    piece_offset: np.ndarray
    piece_length: np.ndarray
    row_start: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.row_start) - 1


def pack_rows(document_lengths: Sequence[int] | np.ndarray, seq_len: int) -> RowLayout:
    """Lay documents of the given token lengths into rows of ``seq_len`` predictions (module
    docstring): in order; one that fits a row but not what is left of the current one starts
    the next, one longer than a row fills what is left and spans the rows it needs. A one-token
    document predicts nothing: left out."""
    if seq_len < 1:
        raise ValueError(f"data.seq_len={seq_len} must be >= 1")
    documents, offsets, lengths, row_start = [], [], [], [0]
    used = 0  # predictions already in the current row
    for doc, tokens in enumerate(np.asarray(document_lengths, dtype=np.int64).tolist()):
        left = tokens - 1
        if left <= 0:
            continue
        if used and used + left > seq_len and left <= seq_len:  # kept whole: the next row
            row_start.append(len(documents))
            used = 0
        offset = 0
        while left:
            take = min(left, seq_len - used)
            documents.append(doc)
            offsets.append(offset)
            lengths.append(take)
            used, offset, left = used + take, offset + take, left - take
            if used == seq_len:
                row_start.append(len(documents))
                used = 0
    if used:
        row_start.append(len(documents))
    return RowLayout(*(np.asarray(values, dtype=np.int64)
                       for values in (documents, offsets, lengths, row_start)))


class DocumentTokens:
    """A token range with its document boundaries: ``tokens`` (memory-mapped) and ``offsets``,
    its ``num_docs + 1`` document offsets from 0 to ``len(tokens)`` (checked). The base of the
    ``pack`` and ``varlen`` datasets."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int,
                 name: str = "") -> None:
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens):
            raise ValueError(f"document offsets of {name or 'the tokens'} must run from 0 to"
                             f" {len(tokens)}")
        self.tokens = tokens
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.seq_len = seq_len
        self.name = name

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class PackedDocuments(DocumentTokens):
    """A token range as rows of whole documents (``data.packing = "pack"``; module docstring).

    Same interface as ``loader.PackedSequences`` (``seq_len``, ``num_tokens``, ``len``,
    ``batch``) but samples are ``DocumentBatch``es.
    """

    packing = "pack"

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int,
                 name: str = "") -> None:
        super().__init__(tokens, offsets, seq_len, name)
        self.layout = pack_rows(np.diff(self.offsets), seq_len)

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.layout.num_rows

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Row i as int64 arrays ``[seq_len]``: inputs, targets, positions, document ids."""
        if not 0 <= i < len(self):
            raise IndexError(f"row {i} out of range for {len(self)} packed rows of"
                             f" {self.name or 'the tokens'}")
        S = self.seq_len
        inputs = np.zeros(S, dtype=np.int64)
        targets = np.full(S, IGNORE_INDEX, dtype=np.int64)
        positions = np.arange(S, dtype=np.int64)
        documents = np.full(S, PAD_DOCUMENT, dtype=np.int64)
        at = 0
        lay = self.layout
        for p in range(lay.row_start[i], lay.row_start[i + 1]):
            doc, n = int(lay.piece_document[p]), int(lay.piece_length[p])
            first = int(self.offsets[doc] + lay.piece_offset[p])
            piece = np.asarray(self.tokens[first:first + n + 1], dtype=np.int64)
            inputs[at:at + n], targets[at:at + n] = piece[:-1], piece[1:]
            positions[at:at + n] = np.arange(n)
            documents[at:at + n] = doc
            at += n
        positions[at:] = np.arange(S - at)  # the padding is one more run
        return inputs, targets, positions, documents

    def __getitem__(self, i: int) -> DocumentBatch:
        return DocumentBatch(*(torch.from_numpy(a) for a in self.row(int(i))))

    def batch(self, indices: Sequence[int] | np.ndarray) -> DocumentBatch:
        """Rows [len(indices), seq_len] (int64) of the given samples, in order."""
        return stack_rows([self.row(int(i)) for i in indices], self.seq_len)


def stack_rows(rows: Sequence[tuple[np.ndarray, ...]], seq_len: int) -> DocumentBatch:
    """Rows (``PackedDocuments.row``) as one ``DocumentBatch`` ``[len(rows), seq_len]``."""
    if not rows:
        return DocumentBatch(*(torch.empty(0, seq_len, dtype=torch.int64) for _ in range(4)))
    return DocumentBatch(*(torch.from_numpy(np.stack(column)) for column in zip(*rows)))


def document_offsets(tokens: np.ndarray, eos_id: int, prepared_range: tuple[int, int] | None,
                     tokens_path: str | Path) -> np.ndarray:
    """The offsets of a token range: a prepared source's index (``prepared_range``: the range
    of its ``tokens.bin``), else the end-of-document ids of a Loom-written file."""
    if prepared_range is not None:
        return prepared_offsets(tokens_path, *prepared_range)
    return offsets_from_eos(tokens, eos_id)


__all__ = ["DocumentBatch", "IGNORE_INDEX", "PAD_DOCUMENT", "PackedDocuments",
           "RowLayout", "check_offsets", "document_offsets", "offsets_from_eos", "pack_rows",
           "prepared_offsets"]
