"""Token files, packed sequences and the resumable, data-parallel batch sampler.

Pipeline: ``check_source`` (config validation, nothing written) refuses a corpus without a readable
text file or with too little text for one sample; ``prepare_data`` (once, in the launcher) reads the
corpus, splits it, builds the tokenizer and writes ``train.bin`` / ``val.bin`` (every document
followed by end-of-document) into the run's data directory, or raises ``ConfigError`` before
publishing any file when the training split is shorter than one sample. Each worker then
memory-maps them as ``PackedSequences`` (non-overlapping windows of ``seq_len + 1`` tokens) and
draws batches through a ``DistributedLoader``.

Packing and sampling are Loom's own rather than ``torch.utils.data`` because of what they must
guarantee: the order of samples is a pure function of (seed, global sample index), so

* data-parallel rank r of d takes the r-th contiguous slice of each step's global batch, and the
  slices concatenated in rank order are exactly the one-process batch (the parity tests rely on it);
* the loader's whole state is one number, the count of consumed global samples, so a resumed run
  continues with exactly the next batch, even when it resumes with a different data-parallel degree.

A ``DataLoader`` with a ``DistributedSampler`` shards per rank by striding and keeps its position in
iterator state, which gives neither property.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from loom.errors import ConfigError
from loom.data.corpus import (
    STDLIB_SOURCE,
    Document,
    SourceFile,
    fingerprint,
    first_text_file,
    list_files,
    read_documents,
    split_documents,
)
from loom.data.tokenizer import Tokenizer, build_tokenizer, load_tokenizer

TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
META_FILE = "data_meta.json"
FORMAT_VERSION = 1
_ENCODE_CHUNK = 256  # documents per encode_batch call: parallel in Rust, bounded memory


# ---------------------------------------------------------------------------------------------
# Preparing the token files
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataFiles:
    """The prepared token files of a run and what is needed to read them."""

    directory: Path
    train_path: Path
    val_path: Path
    dtype: str  # numpy dtype name of the token files: "uint16" or "int32"
    vocab_size: int
    eos_id: int
    meta: dict[str, Any]

    @classmethod
    def open(cls, directory: str | Path) -> "DataFiles":
        """The files ``prepare_data`` wrote in ``directory`` (for workers, which do not prepare)."""
        directory = Path(directory)
        meta = _read_meta(directory)
        if meta is None or not _files_complete(directory, meta):
            raise FileNotFoundError(f"no prepared data in {str(directory)!r}; run prepare_data first")
        return cls._from_meta(directory, meta)

    @classmethod
    def _from_meta(cls, directory: Path, meta: dict[str, Any]) -> "DataFiles":
        return cls(
            directory=directory,
            train_path=directory / TRAIN_FILE,
            val_path=directory / VAL_FILE,
            dtype=meta["dtype"],
            vocab_size=meta["vocab_size"],
            eos_id=meta["eos_id"],
            meta=meta,
        )

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.directory)


def token_dtype(vocab_size: int) -> str:
    """Smallest file dtype for the ids: uint16 halves the files and page cache when it fits."""
    return "uint16" if vocab_size < 2**16 else "int32"


def _recipe(cfg: Any, files: Sequence[SourceFile]) -> dict[str, Any]:
    """Everything that determines the token files; equal recipes mean the files can be reused."""
    return {
        "format_version": FORMAT_VERSION,
        "source": str(cfg.source),
        # The stdlib corpus is always .py files, so data.extensions does not change it.
        "extensions": None if str(cfg.source) == STDLIB_SOURCE else list(cfg.extensions),
        "max_bytes": int(cfg.max_bytes),
        "corpus_fingerprint": fingerprint(files),  # names + sizes: catches an edited corpus
        "val_fraction": float(cfg.val_fraction),
        "tokenizer": cfg.tokenizer,
        "bpe_vocab_size": int(cfg.bpe_vocab_size) if cfg.tokenizer == "bpe" else None,
        "seq_len": int(cfg.seq_len),
    }


def _read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / META_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _files_complete(directory: Path, meta: dict[str, Any]) -> bool:
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name, key in ((TRAIN_FILE, "train_tokens"), (VAL_FILE, "val_tokens")):
        path = directory / name
        if not path.is_file() or path.stat().st_size != meta[key] * itemsize:
            return False
    return True


def _encode_docs(tok: Tokenizer, docs: Sequence[Document]) -> Iterator[np.ndarray]:
    """Token ids of each document, in order, with the end-of-document id appended."""
    eos = np.array([tok.eos_id], dtype=np.int32)
    batch_encode = getattr(tok, "encode_batch", None)
    for start in range(0, len(docs), _ENCODE_CHUNK):
        chunk = [d.text for d in docs[start : start + _ENCODE_CHUNK]]
        encoded = batch_encode(chunk) if batch_encode else [tok.encode(t) for t in chunk]
        for ids in encoded:
            yield np.concatenate([np.asarray(ids, dtype=np.int32), eos])


def _write_tokens(path: Path, tok: Tokenizer, docs: Sequence[Document], dtype: str) -> int:
    """Stream the documents' tokens to ``path``; returns the number of tokens written."""
    count = 0
    with path.open("wb") as f:
        for ids in _encode_docs(tok, docs):
            f.write(ids.astype(dtype).tobytes())
            count += len(ids)
    return count


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move every file of ``tmp`` into ``out_dir`` with atomic renames, the meta file last.

    The old meta goes first and the new one arrives last, so at every instant either no meta exists
    or it describes files that are complete: a crash can cost a rebuild, never a silent mix.
    """
    (out_dir / META_FILE).unlink(missing_ok=True)
    for path in sorted(tmp.iterdir()):
        if path.name != META_FILE:
            os.replace(path, out_dir / path.name)
    os.replace(tmp / META_FILE, out_dir / META_FILE)


def _build(
    cfg: Any, files: Sequence[SourceFile], recipe: dict[str, Any], out_dir: Path
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Temp dir inside out_dir: same filesystem, so the final renames are atomic.
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    try:
        train_docs, val_docs = split_documents(read_documents(files), cfg.val_fraction)
        tok = build_tokenizer(cfg.tokenizer, cfg.bpe_vocab_size, train_docs)
        dtype = token_dtype(tok.vocab_size)
        meta = {
            "recipe": recipe,
            "kind": tok.kind,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "dtype": dtype,
            "seq_len": int(cfg.seq_len),
            "source": str(cfg.source),
            "train_docs": len(train_docs),
            "val_docs": len(val_docs),
            "train_tokens": _write_tokens(tmp / TRAIN_FILE, tok, train_docs, dtype),
            "val_tokens": _write_tokens(tmp / VAL_FILE, tok, val_docs, dtype),
        }
        check_seq_len(cfg.seq_len, meta["train_tokens"])  # refused before anything is published
        tok.save(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _publish(tmp, out_dir)
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_seq_len(seq_len: int, n_tokens: int, *, at_most: bool = False) -> None:
    """A training sample needs seq_len + 1 consecutive tokens (inputs plus shifted targets);
    ConfigError naming ``data.seq_len`` otherwise (``at_most``: ``n_tokens`` is an upper bound)."""
    if n_tokens < seq_len + 1:
        raise ConfigError(
            "data.seq_len", seq_len,
            f"exceeds the corpus' {'at most ' if at_most else ''}{n_tokens} training tokens (a"
            f" sample needs seq_len + 1 tokens); use data.seq_len <= {max(n_tokens - 1, 0)}"
            f" or a larger data.source / data.max_bytes")


# A corpus this small is read and split to bound its training tokens before anything is written.
SMALL_CORPUS_BYTES = 1 << 20


def check_source(cfg: Any) -> None:
    """Before anything is written: ``cfg.source`` (a ``DataConfig``'s) has a regular, non-empty,
    readable text file and enough training text for one sample; ConfigError naming the field.

    Cheap: the corpus is listed, not tokenized; only a small one (<= 1 MiB) is read, to bound its
    training split's tokens by its UTF-8 bytes (exact for the byte tokenizer, an upper bound for
    byte-level BPE). The stdlib corpus is not checked. ``prepare_data`` still refuses (before it
    publishes a file) a split too short after tokenizing.
    """
    if str(cfg.source) == STDLIB_SOURCE:
        return
    where = os.path.abspath(os.path.expanduser(str(cfg.source)))
    try:
        info = os.stat(where)
        identity = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)
    except OSError:
        identity = None
    # cached: the planner resolves many layouts of one config (a refusal raises, never cached)
    _check_source(str(cfg.source), tuple(cfg.extensions), int(cfg.max_bytes),
                  float(cfg.val_fraction), int(cfg.seq_len), identity)


@functools.lru_cache(maxsize=32)
def _check_source(source: str, extensions: tuple[str, ...], max_bytes: int, val_fraction: float,
                  seq_len: int, identity: tuple | None) -> None:
    files = list_files(source, extensions, max_bytes)
    first_text_file(source, files)
    total = sum(f.size for f in files)
    if total <= SMALL_CORPUS_BYTES:
        train, _ = split_documents(read_documents(files), val_fraction)
        bound = sum(len(d.text.encode("utf-8")) + 1 for d in train)  # + end-of-document
    else:
        bound = 3 * total + len(files)  # an undecodable byte becomes U+FFFD, 3 UTF-8 bytes
    check_seq_len(seq_len, bound, at_most=True)


def prepare_data(cfg: Any, out_dir: str | Path) -> DataFiles:
    """Tokenize the corpus described by ``cfg`` (a ``DataConfig``) into ``out_dir``.

    Reuses the files already there when their recipe (source, corpus fingerprint, split, tokenizer,
    seq_len) matches; otherwise rebuilds them atomically. Call once, before workers start.
    Raises ``ConfigError`` naming ``data.source`` (no usable file) or ``data.seq_len`` (a training
    split shorter than one sample), in the second case before any file is published.
    """
    out_dir = Path(out_dir)
    files = list_files(cfg.source, cfg.extensions, cfg.max_bytes)
    recipe = _recipe(cfg, files)
    meta = _read_meta(out_dir)
    if meta is None or meta.get("recipe") != recipe or not _files_complete(out_dir, meta):
        meta = _build(cfg, files, recipe, out_dir)
    check_seq_len(cfg.seq_len, meta["train_tokens"])
    return DataFiles._from_meta(out_dir, meta)


# ---------------------------------------------------------------------------------------------
# Packed sequences
# ---------------------------------------------------------------------------------------------


class PackedSequences:
    """A token file as non-overlapping training samples of ``seq_len`` inputs and targets.

    Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1]: inputs are its first seq_len tokens,
    targets the last seq_len (shifted by one). Documents run into each other separated by the
    end-of-document token, so no token is wasted on padding.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str | np.dtype) -> None:
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be >= 1")
        self.path = Path(path)
        self.seq_len = seq_len
        self.tokens = _map_tokens(self.path, np.dtype(dtype))

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def window(self, i: int) -> np.ndarray:
        """The seq_len + 1 tokens of sample i as int64."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples of {self.path}")
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.window(int(i))
        return torch.from_numpy(w[:-1].copy()), torch.from_numpy(w[1:].copy())

    def batch(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets [len(indices), seq_len] (int64) of the given samples, in order."""
        if len(indices) == 0:
            empty = torch.empty(0, self.seq_len, dtype=torch.int64)
            return empty, empty.clone()
        windows = torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _map_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"{str(path)!r} has {size} bytes, not a whole number of {dtype} tokens")
    if size == 0:  # np.memmap refuses empty files; an empty validation split is legitimate
        return np.zeros(0, dtype=dtype)
    # Memory-mapped: workers share the page cache instead of each holding the corpus.
    return np.memmap(path, dtype=dtype, mode="r")


# ---------------------------------------------------------------------------------------------
# Sampling and loading
# ---------------------------------------------------------------------------------------------


def _check_dp(dp_rank: int, dp_size: int, batch_size: int, name: str) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}) with dp_size >= 1")
    if batch_size % dp_size:
        nearest = max(dp_size, round(batch_size / dp_size) * dp_size)
        raise ValueError(
            f"{name}={batch_size} is not divisible by the data-parallel degree {dp_size}; "
            f"every rank needs the same number of samples (nearest valid: {nearest})"
        )


def rank_slice(indices: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
    """The dp_rank-th of dp_size contiguous, equal slices (rank slices concatenate to the whole)."""
    local = len(indices) // dp_size
    return indices[dp_rank * local : (dp_rank + 1) * local]


class GlobalBatchSampler:
    """Maps global sample indices to dataset samples: one fresh permutation per epoch.

    Global index g is position g % num_samples of epoch g // num_samples; the permutation of epoch
    e comes from ``np.random.default_rng((seed, e))``, so it needs no state beyond the seed. A step
    consumes ``global_batch_size`` consecutive global indices.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: the dataset has no sample to draw")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most the current and next epoch
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset sample indices of global indices start .. start + count - 1."""
        g = np.arange(start, start + count, dtype=np.int64)
        epochs, positions = np.divmod(g, self.num_samples)
        out = np.empty_like(g)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.permutation(int(epoch))[positions[sel]]
        return out

    def step_indices(self, consumed_samples: int) -> np.ndarray:
        """The global batch starting at global index ``consumed_samples``."""
        return self.indices(consumed_samples, self.global_batch_size)

    def rank_indices(self, consumed_samples: int, dp_rank: int, dp_size: int) -> np.ndarray:
        return rank_slice(self.step_indices(consumed_samples), dp_rank, dp_size)


class DistributedLoader:
    """Batches of one data-parallel rank; its state is the global count of consumed samples."""

    def __init__(
        self,
        dataset: PackedSequences,
        sampler: GlobalBatchSampler,
        dp_rank: int = 0,
        dp_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        check_seq_len(dataset.seq_len, dataset.num_tokens)
        if sampler.num_samples != len(dataset):
            raise ValueError(
                f"sampler.num_samples={sampler.num_samples} != {len(dataset)} samples in the dataset"
            )
        _check_dp(dp_rank, dp_size, sampler.global_batch_size, "train.global_batch_size")
        self.dataset = dataset
        self.sampler = sampler
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = torch.device(device)
        self.consumed_samples = 0

    @property
    def local_batch_size(self) -> int:
        return self.sampler.global_batch_size // self.dp_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.sampler.num_samples

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [global_batch_size / dp_size, seq_len] int64 on ``device``."""
        idx = self.sampler.rank_indices(self.consumed_samples, self.dp_rank, self.dp_size)
        inputs, targets = self.dataset.batch(idx)
        self.consumed_samples += self.sampler.global_batch_size
        return inputs.to(self.device), targets.to(self.device)

    def state_dict(self) -> dict[str, int]:
        return {
            "consumed_samples": self.consumed_samples,
            "seed": self.sampler.seed,
            "global_batch_size": self.sampler.global_batch_size,
            "num_samples": self.sampler.num_samples,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from the saved global sample index, whatever dp degree saved it.

        The seed and the dataset size must match (otherwise the "next" samples would be different
        ones); a changed global batch size is allowed and simply starts at the same global index.
        """
        if state["seed"] != self.sampler.seed:
            raise ValueError(
                f"resuming with seed={self.sampler.seed}, "
                f"but the data state was saved with seed={state['seed']}"
            )
        saved_n = state.get("num_samples", self.sampler.num_samples)
        if saved_n != self.sampler.num_samples:
            raise ValueError(
                f"resuming over {self.sampler.num_samples} samples, but the data state was saved "
                f"over {saved_n}: data.source, data.max_bytes or data.seq_len changed"
            )
        self.consumed_samples = int(state["consumed_samples"])


def eval_batches(
    dataset: PackedSequences,
    batch_size: int,
    max_batches: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation batches over the samples in order (no shuffle), sharded like training batches.

    ``batch_size`` is global; only full batches are used so every rank gets the same shapes.
    ``max_batches <= 0`` means all of them. Yields nothing when the split has under one batch.
    """
    # Validated here, not inside the generator, so a bad argument fails at the call.
    if batch_size < 1:
        raise ValueError(f"eval batch_size={batch_size} must be >= 1")
    _check_dp(dp_rank, dp_size, batch_size, "eval batch_size")
    n_batches = len(dataset) // batch_size
    if max_batches > 0:
        n_batches = min(n_batches, max_batches)
    return _eval_iter(dataset, batch_size, n_batches, dp_rank, dp_size, torch.device(device))


def _eval_iter(
    dataset: PackedSequences,
    batch_size: int,
    n_batches: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for b in range(n_batches):
        idx = rank_slice(np.arange(b * batch_size, (b + 1) * batch_size), dp_rank, dp_size)
        inputs, targets = dataset.batch(idx)
        yield inputs.to(device), targets.to(device)
