"""Tokenizers: byte-level by default, byte-level BPE trained locally, or a Hugging Face one.

The byte tokenizer is hand-written because it is three lines of numpy (ids 0..255 are the UTF-8
bytes, 256 ends a document) and has to be fast: the standard-library corpus is ~31 MB and is
tokenized with one ``np.frombuffer`` per document. BPE is not hand-written: it is trained with the
Hugging Face ``tokenizers`` library (Rust, deterministic for the same documents) on the training
split only, and saved in the run directory so a resumed run and every worker decode identically.

A third kind is any Hugging Face ``tokenizer.json`` named by path (``data.tokenizer=PATH``), loaded
offline by ``loom.data.hf_tokenizer``, which also reads the document-boundary policy (BOS, EOS) from
the tokenizer's configuration.

On disk a tokenizer is ``tokenizer_meta.json`` (kind, vocab size, end-of-document id) plus, for BPE
and Hugging Face tokenizers, the library's own ``tokenizer.json`` (and the latter's config files).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

from loom.data.corpus import Document
from loom.data.hf_tokenizer import KIND as HF_KIND
from loom.data.hf_tokenizer import HfTokenizer, load_hf_tokenizer
from loom.errors import InputFileError, read_input_json

META_FILE = "tokenizer_meta.json"
BPE_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
BYTE_VOCAB_SIZE = 257  # 256 byte values + end-of-document
KINDS = ("byte", "bpe")

# What encode() returns: int32 holds every id of any vocabulary Loom builds, and is half the memory
# of int64 while the whole corpus is being tokenized.
ID_DTYPE = np.int32


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the trainer need from a tokenizer."""

    kind: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, directory: str | Path) -> None: ...


def _as_id_array(ids: Iterable[int]) -> np.ndarray:
    """Accept a list, numpy array or (CPU) torch tensor of ids."""
    if hasattr(ids, "detach"):  # torch.Tensor, without importing torch here
        ids = ids.detach().cpu().numpy()
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def _meta(tok: Tokenizer) -> dict:
    return {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id}


def _write_meta(directory: Path, meta: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; id 256 marks the end of a document."""

    kind = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(ID_DTYPE)

    def decode(self, ids: Iterable[int]) -> str:
        arr = _as_id_array(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"byte tokenizer ids must be in [0, {self.vocab_size}), got {arr.min()}..{arr.max()}"
            )
        # End-of-document markers are dropped, like special tokens in the BPE decoder.
        return arr[arr != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        _write_meta(Path(directory), _meta(self))


class BpeTokenizer:
    """Byte-level BPE from the ``tokenizers`` library with one end-of-document special token.

    ``vocab_size`` is the configured size, an upper bound on the ids: on a small corpus training can
    stop with fewer merges, and the model's embedding is sized from the config before training.
    """

    kind = "bpe"

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self._tok = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_id = hf_tokenizer.token_to_id(EOS_TOKEN)
        actual = hf_tokenizer.get_vocab_size()
        if self.eos_id is None or actual > vocab_size:
            raise ValueError(
                f"not a Loom BPE tokenizer: eos={self.eos_id}, {actual} tokens > {vocab_size}"
            )

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BpeTokenizer":
        from tokenizers import Tokenizer as HfTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HfTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            # All 256 byte symbols from the start: any text is encodable, no unknown token.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok, vocab_size)

    @classmethod
    def load(cls, directory: Path, vocab_size: int) -> "BpeTokenizer":
        from tokenizers import Tokenizer as HfTokenizer

        return cls(HfTokenizer.from_file(str(directory / BPE_FILE)), vocab_size)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=ID_DTYPE)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Many documents at once; the library parallelizes this in Rust."""
        return [np.asarray(e.ids, dtype=ID_DTYPE) for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(_as_id_array(ids).tolist())

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(directory / BPE_FILE))
        _write_meta(directory, _meta(self))


def is_builtin(kind: str) -> bool:
    """True for Loom's own tokenizers ("byte", "bpe"); anything else names a tokenizer.json."""
    return kind in KINDS


def tokenizer_vocab_size(kind: str, bpe_vocab_size: int) -> int:
    """The model's vocabulary size for a tokenizer config, known before any data is read.

    ``kind`` is "byte", "bpe" or the path of a Hugging Face tokenizer (its largest id + 1; a path
    that holds none raises ConfigError naming ``data.tokenizer``)."""
    if not is_builtin(kind):
        return load_hf_tokenizer(kind).vocab_size
    if kind == "byte":
        return BYTE_VOCAB_SIZE
    if bpe_vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(
            f"data.bpe_vocab_size={bpe_vocab_size} must be at least {BYTE_VOCAB_SIZE} "
            f"(256 byte symbols + the end-of-document token)"
        )
    return bpe_vocab_size


def build_tokenizer(kind: str, bpe_vocab_size: int, train_docs: Sequence[Document]) -> Tokenizer:
    """A byte tokenizer, a BPE tokenizer trained on ``train_docs`` (the training split only), or
    the Hugging Face tokenizer at the path ``kind``."""
    if not is_builtin(kind):
        return load_hf_tokenizer(kind)
    vocab_size = tokenizer_vocab_size(kind, bpe_vocab_size)
    if kind == "byte":
        return ByteTokenizer()
    return BpeTokenizer.train((d.text for d in train_docs), vocab_size)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer saved in ``directory`` by ``Tokenizer.save``."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"no tokenizer in {str(directory)!r}: {META_FILE} is missing")
    try:
        meta = read_input_json(meta_path)
    except InputFileError as err:
        raise ValueError(f"{meta_path}: not a tokenizer description ({err})") from None
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind == HF_KIND:
        return load_hf_tokenizer(directory)
    if kind not in KINDS:
        raise ValueError(f"{meta_path}: kind={kind!r} is not one of {KINDS}")
    if kind == "byte":
        return ByteTokenizer()
    vocab_size = meta.get("vocab_size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not (
            260 <= vocab_size < 2 ** 31):
        raise ValueError(f"{meta_path}: vocab_size={vocab_size!r} must be an integer in"
                         " [260, 2**31) for a BPE tokenizer")
    return BpeTokenizer.load(directory, vocab_size)


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Token ids of each document, in order, each followed by the end-of-document id (int32).

    A Hugging Face tokenizer places its own boundaries (BOS, EOS) as its configuration says;
    Loom's byte and BPE tokenizers add nothing but the end-of-document id.
    """
    if isinstance(tok, HfTokenizer):
        return tok.encode_documents(texts)
    eos = np.array([tok.eos_id], dtype=np.int32)
    batch_encode = getattr(tok, "encode_batch", None)
    encoded = batch_encode(texts) if batch_encode else [tok.encode(t) for t in texts]
    return [np.concatenate([np.asarray(ids, dtype=np.int32), eos]) for ids in encoded]


def tokenizer_identity(tok: Tokenizer) -> str | None:
    """What token files prepared with ``tok`` are matched by: "byte", a Hugging Face tokenizer's
    SHA-256, or None for a run-trained BPE tokenizer (it exists only inside its run)."""
    if isinstance(tok, HfTokenizer):
        return tok.identity
    return "byte" if tok.kind == "byte" else None


def identity_of(kind: str) -> str | None:
    """``tokenizer_identity`` of the tokenizer a ``data.tokenizer`` value names, without data."""
    if kind == "bpe":
        return None
    return "byte" if kind == "byte" else load_hf_tokenizer(kind).identity
