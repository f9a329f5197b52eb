"""Token files, packed sequences and the resumable, data-parallel batch sampler.

Pipeline: ``check_source`` (config validation, nothing written) refuses a corpus without a readable
text file or with too little text for one sample; ``prepare_data`` (once, in the launcher) reads the
corpus, splits it, builds the tokenizer and writes ``train.bin`` / ``val.bin`` (every document
followed by end-of-document) into the run's data directory, or raises ``ConfigError`` before
publishing any file when the training split is shorter than one sample. Each worker then
memory-maps them as ``PackedSequences`` (non-overlapping windows of ``seq_len + 1`` tokens; with
``data.packing = "pack"``, ``packing.PackedDocuments``: rows of whole documents) and draws batches
through a ``DistributedLoader``.

Two variants describe their token ranges as ``parts`` in ``data_meta.json`` instead: a source
prepared by ``loom data prepare`` (``loom.data.prepare``) is not copied, its ``tokens.bin`` is
memory-mapped in place, a range for each split; and ``data.mix`` (``loom.data.mix``) gives each
mixed source its own files or ranges and samples them through a ``MixSampler``. ``DataFiles``
builds the datasets and the sampler for either (``train_set``, ``val_set``, ``sampler``).

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
import hashlib
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
from loom.data.corpus import (STDLIB_SOURCE, Document, SourceFile, fingerprint, first_text_file,
                              list_files, read_documents, split_documents)
from loom.data.hf_tokenizer import CONFIG_FILE as HF_CONFIG_FILE
from loom.data.hf_tokenizer import SPECIAL_TOKENS_FILE as HF_SPECIAL_TOKENS_FILE
from loom.data.mix import MixedSequences, MixSampler, check_mix_paths, interleaved_order, parse_mix
from loom.data.packing import DocumentBatch, PackedDocuments, document_offsets
from loom.data.prepare import PreparedData
from loom.data.samples import BatchSampler, WindowedSamples, rank_slice
from loom.data.varlen import MixedPieces, VarlenDocuments
from loom.data.sources import (PREPARED, TEXT, Source, check_text_field, read_source_documents,
                               record_val_count, resolve_source, split_records)
from loom.data.tokenizer import (Tokenizer, build_tokenizer, encode_documents, identity_of,
                                 is_builtin, load_tokenizer)

TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
META_FILE = "data_meta.json"
FORMAT_VERSION = 1
_ENCODE_CHUNK = 256  # documents per encode_batch call: parallel in Rust, bounded memory
# A batch: (inputs, targets), or a DocumentBatch under data.packing = "pack"
Batch = tuple[torch.Tensor, torch.Tensor] | DocumentBatch


# -- Preparing the token files -----------------------------------------------------------------


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
        parts = meta.get("parts")
        first = parts[0] if parts else None
        return cls(
            directory=directory,
            train_path=_part_path(directory, first["train"]) if first else directory / TRAIN_FILE,
            val_path=_part_path(directory, first["val"]) if first else directory / VAL_FILE,
            dtype=meta["dtype"],
            vocab_size=meta["vocab_size"],
            eos_id=meta["eos_id"],
            meta=meta,
        )

    def tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.directory)

    @property
    def mixed(self) -> bool:
        """True when the run mixes sources (``data.mix``): sample with ``sampler``."""
        return bool(self.meta.get("mix"))

    def _datasets(self, split: str, seq_len: int,
                  packing: str = "concat") -> list["PackedSequences | PackedDocuments"]:
        parts = self.meta.get("parts")
        if not parts:
            path = self.train_path if split == "train" else self.val_path
            if packing != "concat":
                return [self._documents(path, self.dtype, 0, None, False, seq_len, packing)]
            return [PackedSequences(path, seq_len, self.dtype)]
        if packing != "concat":  # an absolute path is a range of a prepared tokens.bin
            return [self._documents(_part_path(self.directory, p[split]), p[split]["dtype"],
                                    p[split]["start"], p[split]["end"],
                                    Path(p[split]["path"]).is_absolute(), seq_len, packing)
                    for p in parts]
        return [PackedSequences(_part_path(self.directory, p[split]), seq_len, p[split]["dtype"],
                                start=p[split]["start"], end=p[split]["end"]) for p in parts]

    def _documents(self, path: Path, dtype: str, start: int, end: int | None, prepared: bool,
                   seq_len: int, packing: str = "pack") -> PackedDocuments | VarlenDocuments:
        """Tokens [start, end) of ``path`` as packed documents (or, ``varlen``, pieces of
        documents: ``loom.data.varlen``): a prepared source's doc index, or the
        end-of-document ids of a file Loom wrote (``loom.data.packing``)."""
        tokens = _map_tokens(path, np.dtype(dtype))[start:end]
        offsets = document_offsets(tokens, self.eos_id, (start, end) if prepared else None, path)
        documents = VarlenDocuments if packing == "varlen" else PackedDocuments
        return documents(tokens, offsets, seq_len, name=str(path))

    def _weights(self, parts: Sequence[Any] = ()) -> list[float]:
        """``data.mix``'s weights, per sample of ``parts``. They are shares of tokens: a row of
        ``concat`` or ``pack`` is ``seq_len`` tokens whatever its source, so they apply to rows
        as written; a ``varlen`` piece is as long as its document allows, so each source's
        weight is divided by its mean piece length (a source of short documents would
        otherwise get its weight in pieces but far less of the tokens)."""
        weights = [float(p["weight"]) for p in self.meta["parts"]]
        if parts and isinstance(parts[0], VarlenDocuments):
            weights = [w / float(p.lengths.mean()) if len(p) else 0.0
                       for w, p in zip(weights, parts)]
        return weights

    def train_set(self, seq_len: int, packing: str = "concat"
                  ) -> "PackedSequences | PackedDocuments | MixedSequences | MixedPieces":
        """The training samples: one packed token range, or the mixed sources' as one index
        space (dataset index = offset of the source + its sample). ``packing`` is
        ``data.packing``: ``pack`` gives rows of whole documents (``loom.data.packing``),
        ``varlen`` pieces of them (``loom.data.varlen``)."""
        parts = self._datasets("train", seq_len, packing)
        if not self.mixed:
            return parts[0]
        return MixedPieces(parts) if packing == "varlen" else MixedSequences(parts)

    def val_set(self, seq_len: int, packing: str = "concat"
                ) -> "PackedSequences | PackedDocuments | MixedSequences | MixedPieces":
        """The validation samples; mixed sources in mixture order (``interleaved_order``)."""
        parts = self._datasets("val", seq_len, packing)
        if not self.mixed:
            return parts[0]
        order = interleaved_order([len(p) for p in parts], self._weights(parts))
        return MixedPieces(parts, order) if packing == "varlen" else MixedSequences(parts, order)

    def sampler(self, dataset: Any, global_batch_size: int,
                seed: int) -> "GlobalBatchSampler | MixSampler":
        """The global sampler of ``train_set``'s samples: shuffled epochs, or the mixture."""
        if self.mixed:
            return MixSampler([len(p) for p in dataset.parts], self._weights(dataset.parts),
                              global_batch_size, seed)
        return GlobalBatchSampler(len(dataset), global_batch_size, seed)


def _part_path(directory: Path, token_range: dict[str, Any]) -> Path:
    """A part's token file: relative to the data directory, or absolute (a prepared source)."""
    return directory / token_range["path"]  # an absolute path stays absolute


def token_dtype(vocab_size: int) -> str:
    """Smallest file dtype for the ids: uint16 halves the files and page cache when it fits."""
    return "uint16" if vocab_size < 2**16 else "int32"


def _recipe(cfg: Any, files: Sequence[SourceFile]) -> dict[str, Any]:
    """Everything that determines the token files; equal recipes mean the files can be reused."""
    recipe = {
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
    # Keys added only where they apply, so that existing runs of a text corpus keep their recipe.
    if not is_builtin(cfg.tokenizer):  # the same path may hold another tokenizer.json later
        recipe["tokenizer_identity"] = identity_of(cfg.tokenizer)
    return recipe


def _read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / META_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _files_complete(directory: Path, meta: dict[str, Any]) -> bool:
    if meta.get("parts"):
        for part in meta["parts"]:
            for split in ("train", "val"):
                rng = part[split]
                path = _part_path(directory, rng)
                itemsize = np.dtype(rng["dtype"]).itemsize
                local = not Path(rng["path"]).is_absolute()  # whole file, or a range of one
                want = (rng["end"] - rng["start"]) * itemsize if local else rng["end"] * itemsize
                if not path.is_file() or (path.stat().st_size != want if local
                                          else path.stat().st_size < want):
                    return False
        return True
    itemsize = np.dtype(meta["dtype"]).itemsize
    for name, key in ((TRAIN_FILE, "train_tokens"), (VAL_FILE, "val_tokens")):
        path = directory / name
        if not path.is_file() or path.stat().st_size != meta[key] * itemsize:
            return False
    return True


def _encode_docs(tok: Tokenizer, docs: Sequence[Document]) -> Iterator[np.ndarray]:
    """Token ids of each document, in order, with the end-of-document id appended."""
    for start in range(0, len(docs), _ENCODE_CHUNK):
        yield from encode_documents(tok, [d.text for d in docs[start : start + _ENCODE_CHUNK]])


def _write_tokens(path: Path, tok: Tokenizer, docs: Sequence[Document], dtype: str) -> int:
    """Stream the documents' tokens to ``path``; returns the number of tokens written."""
    count = 0
    with path.open("wb") as f:
        for ids in _encode_docs(tok, docs):
            f.write(ids.astype(dtype).tobytes())
            count += len(ids)
    return count


# Tokenizer files that only some tokenizers have: a rebuild must not leave a previous one's.
_OPTIONAL_TOKENIZER_FILES = (HF_CONFIG_FILE, HF_SPECIAL_TOKENS_FILE)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move every file of ``tmp`` into ``out_dir`` with atomic renames, the meta file last.

    The old meta goes first and the new one arrives last, so at every instant either no meta exists
    or it describes files that are complete: a crash can cost a rebuild, never a silent mix.
    """
    (out_dir / META_FILE).unlink(missing_ok=True)
    for name in _OPTIONAL_TOKENIZER_FILES:
        if not (tmp / name).exists():
            (out_dir / name).unlink(missing_ok=True)
    for path in sorted(tmp.iterdir()):
        if path.name != META_FILE:
            os.replace(path, out_dir / path.name)
    os.replace(tmp / META_FILE, out_dir / META_FILE)


@dataclass(frozen=True)
class _Member:
    """One source of a run (the only one, or one entry of ``data.mix``), resolved."""

    name: str
    weight: float
    src: Source
    files: tuple[SourceFile, ...]
    prepared: PreparedData | None = None


def _members(cfg: Any) -> list[_Member]:
    """The run's sources with their weights: ``data.mix`` (zero weights left out) or
    ``data.source``. ConfigError naming the field at fault."""
    mix = getattr(cfg, "mix", "")
    pairs = [(str(cfg.source), 1.0)]
    if mix:
        entries = parse_mix(mix)
        check_mix_paths(mix, entries)
        pairs = [(e.path, e.weight) for e in entries if e.weight > 0]
    members = []
    for name, weight in pairs:
        src = resolve_source(name, cfg.extensions)
        if src.kind == PREPARED:
            prepared = PreparedData.open(src.path, name)
            members.append(_Member(name, weight, src, src.files, prepared))
        elif src.kind == TEXT:
            files = tuple(list_files(name, cfg.extensions, cfg.max_bytes))
            members.append(_Member(name, weight, src, files))
        else:
            members.append(_Member(name, weight, src, src.files))
    return members


def _member_recipe(cfg: Any, m: _Member) -> dict[str, Any]:
    if m.prepared is not None:  # the manifest describes the tokens; re-preparing rewrites it
        return {"source": m.name, "kind": PREPARED, "weight": m.weight,
                "manifest": hashlib.sha256(json.dumps(m.prepared.manifest, sort_keys=True)
                                           .encode()).hexdigest()[:16]}
    recipe = {"source": m.name, "kind": m.src.kind, "weight": m.weight,
              "fingerprint": fingerprint(m.files)}
    if m.src.kind != TEXT:
        recipe["text_field"] = getattr(cfg, "text_field", "text")
    return recipe


def _uses_parts(cfg: Any, members: Sequence[_Member]) -> bool:
    """Token ranges in ``parts`` (mixed or prepared sources) rather than train.bin / val.bin."""
    return bool(getattr(cfg, "mix", "")) or members[0].prepared is not None


def _run_recipe(cfg: Any, members: Sequence[_Member]) -> dict[str, Any]:
    if not _uses_parts(cfg, members):
        recipe = _recipe(cfg, members[0].files)
        if members[0].src.kind != TEXT:  # a record source: the column matters too
            recipe.update(_member_recipe(cfg, members[0]))
        return recipe
    recipe = _recipe(cfg, [])
    del recipe["corpus_fingerprint"]
    recipe["members"] = [_member_recipe(cfg, m) for m in members]
    recipe["mix"] = bool(getattr(cfg, "mix", ""))
    return recipe


def _source_splits(cfg: Any, m: _Member) -> tuple[list[Document], list[Document]]:
    """Training and validation documents of a text or record source."""
    if m.src.kind == TEXT:
        return split_documents(read_documents(m.files), cfg.val_fraction)
    docs = read_source_documents(m.src, text_field=getattr(cfg, "text_field", "text"),
                                 max_bytes=cfg.max_bytes)
    return split_records(docs, cfg.val_fraction)


def _build(
    cfg: Any, members: Sequence[_Member], recipe: dict[str, Any], out_dir: Path
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Temp dir inside out_dir: same filesystem, so the final renames are atomic.
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
    try:
        splits = [None if m.prepared else _source_splits(cfg, m) for m in members]
        train_docs = [d for s in splits if s is not None for d in s[0]]
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
        }
        if not _uses_parts(cfg, members):
            train_docs, val_docs = splits[0]
            meta.update({
                "train_docs": len(train_docs),
                "val_docs": len(val_docs),
                "train_tokens": _write_tokens(tmp / TRAIN_FILE, tok, train_docs, dtype),
                "val_tokens": _write_tokens(tmp / VAL_FILE, tok, val_docs, dtype),
            })
        else:
            meta.update(_write_parts(cfg, members, splits, tok, dtype, tmp))
        check_seq_len(cfg.seq_len, meta["train_tokens"])  # refused before anything is published
        tok.save(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _publish(tmp, out_dir)
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_parts(cfg: Any, members: Sequence[_Member], splits: Sequence[Any], tok: Tokenizer,
                 dtype: str, tmp: Path) -> dict[str, Any]:
    """The ``parts`` of a mixed or prepared run: token files written for text and record
    sources, ranges of ``tokens.bin`` for prepared ones. Each needs one training sample."""
    identity = identity_of(cfg.tokenizer) if members and any(m.prepared for m in members) else None
    parts = []
    for i, (m, split) in enumerate(zip(members, splits)):
        if m.prepared is not None:
            m.prepared.check_tokenizer(identity, cfg.tokenizer)
            (a, b), (c, d) = m.prepared.split(cfg.val_fraction)
            n_val = record_val_count(m.prepared.num_docs, cfg.val_fraction)
            ranges = {split_name: {"path": str(m.prepared.tokens_path), "dtype": m.prepared.dtype,
                                   "start": lo, "end": hi}
                      for split_name, (lo, hi) in (("train", (a, b)), ("val", (c, d)))}
            docs = {"train_docs": m.prepared.num_docs - n_val, "val_docs": n_val}
        else:
            ranges, docs = {}, {}
            for split_name, split_docs in zip(("train", "val"), split):
                name = f"mix{i}.{split_name}.bin"
                n = _write_tokens(tmp / name, tok, split_docs, dtype)
                ranges[split_name] = {"path": name, "dtype": dtype, "start": 0, "end": n}
                docs[f"{split_name}_docs"] = len(split_docs)
        train_tokens = ranges["train"]["end"] - ranges["train"]["start"]
        if len(members) > 1:  # each mixed source is sampled on its own: one sample at least
            check_seq_len(cfg.seq_len, train_tokens, what=f"data.mix entry {m.name!r}'s")
        parts.append({"source": m.name, "weight": m.weight, **ranges, **docs})
    return {
        "mix": bool(getattr(cfg, "mix", "")),
        "parts": parts,
        "train_docs": sum(p["train_docs"] for p in parts),
        "val_docs": sum(p["val_docs"] for p in parts),
        "train_tokens": sum(p["train"]["end"] - p["train"]["start"] for p in parts),
        "val_tokens": sum(p["val"]["end"] - p["val"]["start"] for p in parts),
    }


def check_seq_len(seq_len: int, n_tokens: int, *, at_most: bool = False,
                  what: str = "the corpus'") -> None:
    """A training sample needs seq_len + 1 consecutive tokens (inputs plus shifted targets);
    ConfigError naming ``data.seq_len`` otherwise (``at_most``: ``n_tokens`` is an upper bound)."""
    if n_tokens < seq_len + 1:
        raise ConfigError(
            "data.seq_len", seq_len,
            f"exceeds {what} {'at most ' if at_most else ''}{n_tokens} training tokens (a"
            f" sample needs seq_len + 1 tokens); use data.seq_len <= {max(n_tokens - 1, 0)}"
            f" or a larger data.source / data.max_bytes")


# A corpus this small is read and split to bound its training tokens before anything is written.
SMALL_CORPUS_BYTES = 1 << 20


def check_source(cfg: Any) -> None:
    """Before anything is written: the run's sources (``cfg``: a ``DataConfig``'s fields) can be
    read; ConfigError naming the field at fault.

    ``data.source`` (or each path of ``data.mix``, whose own errors name ``data.mix``) is checked
    by kind. A text corpus has a regular, non-empty, readable text file and enough training text
    for one sample: cheap, the corpus is listed, not tokenized; only a small one (<= 1 MiB) is
    read, to bound its training split's tokens by its UTF-8 bytes (exact for the byte tokenizer,
    an upper bound for byte-level BPE; not checked for a Hugging Face tokenizer, which may add
    tokens). A record source has the column ``data.text_field``. A prepared directory is complete,
    was made with the run's tokenizer (``data.tokenizer``) and has one training sample. The stdlib
    corpus is not checked. ``prepare_data`` still refuses (before it publishes a file) a split too
    short after tokenizing.
    """
    mix = getattr(cfg, "mix", "")
    if not mix:
        _check_member(cfg, str(cfg.source))
        return
    entries = parse_mix(mix)
    check_mix_paths(mix, entries)
    for entry in entries:
        try:
            _check_member(cfg, entry.path)
        except ConfigError as err:
            if err.field_name != "data.source":
                raise
            raise ConfigError("data.mix", mix, f"entry {entry.path!r} {err.rule}") from None


def _check_member(cfg: Any, source: str) -> None:
    if source == STDLIB_SOURCE:
        return
    src = resolve_source(source, cfg.extensions)
    if src.kind == PREPARED:
        prepared = PreparedData.open(src.path, source)
        prepared.check_tokenizer(identity_of(cfg.tokenizer), cfg.tokenizer)
        (start, end), _ = prepared.split(cfg.val_fraction)
        check_seq_len(cfg.seq_len, end - start)
        return
    where = os.path.abspath(os.path.expanduser(source))
    try:
        info = os.stat(where)
        identity = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)
    except OSError:
        identity = None
    # cached: the planner resolves many layouts of one config (a refusal raises, never cached)
    if src.kind == TEXT:
        _check_source(source, tuple(cfg.extensions), int(cfg.max_bytes),
                      float(cfg.val_fraction), int(cfg.seq_len), identity,
                      is_builtin(cfg.tokenizer))
    else:
        _check_records(src, getattr(cfg, "text_field", "text"), identity)


@functools.lru_cache(maxsize=32)
def _check_source(source: str, extensions: tuple[str, ...], max_bytes: int, val_fraction: float,
                  seq_len: int, identity: tuple | None, bound_tokens: bool = True) -> None:
    files = list_files(source, extensions, max_bytes)
    first_text_file(source, files)
    if not bound_tokens:
        return
    total = sum(f.size for f in files)
    if total <= SMALL_CORPUS_BYTES:
        train, _ = split_documents(read_documents(files), val_fraction)
        bound = sum(len(d.text.encode("utf-8")) + 1 for d in train)  # + end-of-document
    else:
        bound = 3 * total + len(files)  # an undecodable byte becomes U+FFFD, 3 UTF-8 bytes
    check_seq_len(seq_len, bound, at_most=True)


@functools.lru_cache(maxsize=32)
def _check_records(src: Source, text_field: str, identity: tuple | None) -> None:
    check_text_field(src, text_field)


def prepare_data(cfg: Any, out_dir: str | Path) -> DataFiles:
    """Tokenize the corpus described by ``cfg`` (a ``DataConfig``) into ``out_dir``.

    Reuses the files already there when their recipe (source, corpus fingerprint, split, tokenizer,
    seq_len) matches; otherwise rebuilds them atomically. Call once, before workers start.
    Raises ``ConfigError`` naming ``data.source`` (no usable file) or ``data.seq_len`` (a training
    split shorter than one sample), in the second case before any file is published. A prepared
    source is not copied: the run's meta records token ranges of its ``tokens.bin``.
    """
    out_dir = Path(out_dir)
    members = _members(cfg)
    recipe = _run_recipe(cfg, members)
    meta = _read_meta(out_dir)
    if meta is None or meta.get("recipe") != recipe or not _files_complete(out_dir, meta):
        meta = _build(cfg, members, recipe, out_dir)
    check_seq_len(cfg.seq_len, meta["train_tokens"])
    return DataFiles._from_meta(out_dir, meta)


# -- Packed sequences --------------------------------------------------------------------------


class PackedSequences(WindowedSamples):
    """A token file as non-overlapping training samples of ``seq_len`` inputs and targets.

    Sample i is tokens[i*seq_len : i*seq_len + seq_len + 1]: inputs are its first seq_len tokens,
    targets the last seq_len (shifted by one). Documents run into each other separated by the
    end-of-document token, so no token is wasted on padding. ``start`` / ``end`` restrict it to a
    token range of the file (a split of a prepared ``tokens.bin``), still memory-mapped.
    """

    def __init__(self, path: str | Path, seq_len: int, dtype: str | np.dtype, *,
                 start: int = 0, end: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be >= 1")
        self.path = Path(path)
        self.seq_len = seq_len
        self.tokens = _map_tokens(self.path, np.dtype(dtype))[start:end]  # a view, not a copy

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


def _map_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(f"{str(path)!r} has {size} bytes, not a whole number of {dtype} tokens")
    if size == 0:  # np.memmap refuses empty files; an empty validation split is legitimate
        return np.zeros(0, dtype=dtype)
    # Memory-mapped: workers share the page cache instead of each holding the corpus.
    return np.memmap(path, dtype=dtype, mode="r")


# -- Sampling and loading ----------------------------------------------------------------------


def _check_dp(dp_rank: int, dp_size: int, batch_size: int, name: str) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}) with dp_size >= 1")
    if batch_size % dp_size:
        nearest = max(dp_size, round(batch_size / dp_size) * dp_size)
        raise ValueError(
            f"{name}={batch_size} is not divisible by the data-parallel degree {dp_size}; "
            f"every rank needs the same number of samples (nearest valid: {nearest})"
        )


class GlobalBatchSampler(BatchSampler):
    """Maps global sample indices to dataset samples: one fresh permutation per epoch.

    Global index g is position g % num_samples of epoch g // num_samples; the permutation of epoch
    e comes from ``np.random.default_rng((seed, e))``, so it needs no state beyond the seed. A step
    consumes ``global_batch_size`` consecutive global indices.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int = 0) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: the dataset has no sample to draw")
        super().__init__(global_batch_size, seed)
        self.num_samples = num_samples
        self._perms: dict[int, np.ndarray] = {}

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most the current and next epoch
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> np.ndarray:
        g = np.arange(start, start + count, dtype=np.int64)
        epochs, positions = np.divmod(g, self.num_samples)
        out = np.empty_like(g)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.permutation(int(epoch))[positions[sel]]
        return out


class DistributedLoader:
    """Batches of one data-parallel rank; its state is the global count of consumed samples."""

    def __init__(
        self,
        dataset: "PackedSequences | PackedDocuments | MixedSequences",
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
    def epoch(self) -> int:
        return self.consumed_samples // self.sampler.num_samples

    def next_batch(self) -> Batch:
        """(inputs, targets), each [global_batch_size / dp_size, seq_len] int64 on ``device``;
        a ``DocumentBatch`` (also positions and document ids) when the rows are packed."""
        idx = self.sampler.rank_indices(self.consumed_samples, self.dp_rank, self.dp_size)
        batch = self.dataset.batch(idx)
        self.consumed_samples += self.sampler.global_batch_size
        return _on_device(batch, self.device)

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
                f"over {saved_n}: data.source, data.mix, data.max_bytes, data.seq_len or"
                f" data.packing changed"
            )
        self.consumed_samples = int(state["consumed_samples"])


def eval_batches(
    dataset: "PackedSequences | PackedDocuments | MixedSequences",
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
    dataset: "PackedSequences | PackedDocuments | MixedSequences",
    batch_size: int,
    n_batches: int,
    dp_rank: int,
    dp_size: int,
    device: torch.device,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for b in range(n_batches):
        idx = rank_slice(np.arange(b * batch_size, (b + 1) * batch_size), dp_rank, dp_size)
        yield _on_device(dataset.batch(idx), device)


def _on_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, DocumentBatch):
        return batch.to(device)
    inputs, targets = batch
    return inputs.to(device), targets.to(device)
