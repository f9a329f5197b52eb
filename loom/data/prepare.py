"""``loom data prepare``: tokenize a source once, in parallel, into a memory-mapped token file.

A prepared directory holds

* ``tokens.bin``: every document's ids (``tokenizer.encode_documents``: the tokenizer's own BOS
  and one end-of-sequence token per document), concatenated, as ``uint16`` when the vocabulary
  fits, else ``uint32``; read with ``numpy.memmap``, never loaded;
* ``doc_index.bin``: ``int64`` offsets of the document starts, plus the total at the end
  (``num_docs + 1`` entries), so document boundaries survive for training that wants them;
* ``tokenizer/``: a copy of the tokenizer, so the directory is self-describing (and can be named by
  ``data.tokenizer``);
* ``prepared.json``, written last: format, tokenizer identity (``tokenizer_identity``), dtype,
  counts and the source's fingerprint. Its presence marks the directory complete.

``data.source`` accepts such a directory directly: training memory-maps ``tokens.bin`` in place (no
re-tokenization, no copy) after checking that the run's tokenizer has the manifest's identity.

The worker pool is hand-rolled on ``multiprocessing`` rather than ``Pool.imap`` for one reason: the
order of documents must be kept *and* reading must not run ahead of tokenizing (``imap`` queues
the whole input), so at most ``2 * workers`` batches are in flight and results are taken back in
submission order. Each worker holds its own tokenizer and encodes batches single-threaded, so
``--workers N`` uses N cores; the output does not depend on N.
"""

from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import signal
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from loom.data.corpus import fingerprint, list_files
from loom.data.sources import (DEFAULT_EXTENSIONS, PREPARED, PREPARED_MANIFEST, RECORDS, SAVED,
                               TEXT, Source, check_readable, iter_texts, record_val_count,
                               resolve_source)
from loom.data.tokenizer import (Tokenizer, build_tokenizer, encode_documents, tokenizer_identity,
                                  tokenizer_vocab_size)
from loom.errors import ConfigError, InputFileError, read_input_json
from loom.files import as_created

FORMAT = "loom-prepared"
VERSION = 1
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "doc_index.bin"
TOKENIZER_DIR = "tokenizer"
INDEX_DTYPE = "int64"
# A task for a worker: this many characters of text or this many documents, whichever comes first.
# Sized by text, not rows: one row may be a tweet or a whole book, and a batch of a thousand long
# documents would leave the other workers idle.
TASK_CHARS = 1 << 18
TASK_DOCS = 1024


def prepared_dtype(vocab_size: int) -> str:
    """uint16 when every id fits (half the file and page cache), else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# -- Reading a prepared directory --------------------------------------------------------------


def check_offsets(offsets: np.ndarray, num_tokens: int, source: str) -> None:
    """ConfigError naming ``data.source`` unless ``offsets`` describe ``num_tokens`` tokens:
    from 0 to ``num_tokens``, every document at least one token long."""
    def refuse(why: str) -> None:
        raise ConfigError("data.source", source, f"its {INDEX_FILE} does not match its token"
                          f" file: {why}")

    if len(offsets) < 1 or offsets[0] != 0:
        refuse(f"the first offset is {offsets[0] if len(offsets) else 'missing'}, not 0")
    if offsets[-1] != num_tokens:
        refuse(f"the offsets end at {int(offsets[-1])}, the token file holds {num_tokens}"
               " tokens")
    empty = np.flatnonzero(np.diff(offsets) <= 0)
    if len(empty):
        refuse(f"document {int(empty[0])} has {int(np.diff(offsets)[empty[0]])} tokens"
               " (offsets must increase)")


_SCAN_CHUNK = 1 << 24  # tokens per read of ``PreparedData.check_token_ids``


@dataclass(frozen=True)
class PreparedData:
    """A complete ``loom data prepare`` directory (see the module docstring)."""

    directory: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, directory: str | Path, spec: str | None = None) -> "PreparedData":
        """The prepared data in ``directory``; ConfigError naming ``data.source`` when the
        manifest is unreadable or the files are not the sizes it records."""
        directory = Path(directory)
        spec = str(directory) if spec is None else spec

        def refuse(rule: str) -> None:
            raise ConfigError("data.source", spec, f"is not a complete `loom data prepare`"
                              f" directory: {rule}")

        try:
            manifest = read_input_json(directory / PREPARED_MANIFEST)
        except InputFileError as err:
            refuse(f"{PREPARED_MANIFEST} is unreadable ({err})")
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            refuse(f"{PREPARED_MANIFEST} is not a {FORMAT} manifest")
        if manifest.get("version") != VERSION:
            refuse(f"format version {manifest.get('version')!r}, this Loom reads {VERSION}")
        if manifest.get("dtype") not in ("uint16", "uint32"):  # what prepared_dtype writes
            refuse(f"{PREPARED_MANIFEST}'s dtype {manifest.get('dtype')!r} is not uint16 or"
                   " uint32")
        for key in ("num_tokens", "num_docs"):  # counts of a file on disk: int64 at most
            count = manifest.get(key)
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count < 2**62:
                refuse(f"{PREPARED_MANIFEST}'s {key} {count!r} is not a count")
        try:
            itemsize = np.dtype(manifest["dtype"]).itemsize
            sizes = {TOKENS_FILE: manifest["num_tokens"] * itemsize,
                     INDEX_FILE: (manifest["num_docs"] + 1) * np.dtype(INDEX_DTYPE).itemsize}
            manifest["tokenizer"]["identity"]
        except (KeyError, TypeError, ValueError) as err:
            refuse(f"{PREPARED_MANIFEST} lacks {err}")
        for name, size in sizes.items():
            path = directory / name
            if not path.is_file() or path.stat().st_size != size:
                refuse(f"{name} is missing or not the {size} bytes the manifest records")
        prepared = cls(directory.resolve(), manifest)
        # the split and the document packing index tokens.bin by these: a wrong one would
        # fail later as a missing file or an out-of-range read (8 bytes per document to check)
        check_offsets(np.asarray(prepared.doc_offsets(), dtype=np.int64), prepared.num_tokens,
                      spec)
        return prepared

    @property
    def tokens_path(self) -> Path:
        return self.directory / TOKENS_FILE

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def num_docs(self) -> int:
        return int(self.manifest["num_docs"])

    def tokens(self) -> np.ndarray:
        return np.memmap(self.tokens_path, dtype=self.dtype, mode="r")

    def doc_offsets(self) -> np.ndarray:
        """Offsets of the document starts, then the total: ``num_docs + 1`` int64 values."""
        return np.memmap(self.directory / INDEX_FILE, dtype=INDEX_DTYPE, mode="r")

    def split(self, val_fraction: float) -> tuple[tuple[int, int], tuple[int, int]]:
        """Token ranges [start, end) of the training and validation documents: the last
        ``record_val_count`` documents validate, as for a record source read on the fly."""
        cut_doc = self.num_docs - record_val_count(self.num_docs, val_fraction)
        cut = int(self.doc_offsets()[cut_doc])
        return (0, cut), (cut, self.num_tokens)

    def check_tokenizer(self, identity: str | None, kind: str) -> None:
        """ConfigError naming ``data.tokenizer`` unless the run's tokenizer is the one the
        tokens were made with."""
        made = self.manifest["tokenizer"]
        if identity is None or identity != made["identity"]:
            use = self.directory / TOKENIZER_DIR if made.get("kind") == "hf" else made.get("kind")
            raise ConfigError("data.tokenizer", kind, f"is not the tokenizer"
                              f" {str(self.directory)!r} was prepared with ({made.get('kind')},"
                              f" identity {str(made['identity'])[:12]}); use"
                              f" --data.tokenizer={use}")
        self.check_token_ids(tokenizer_vocab_size(kind, 0))

    def check_token_ids(self, vocab_size: int) -> None:
        """ConfigError naming ``data.source`` when tokens.bin holds an id ``>= vocab_size``
        (the embedding would raise an IndexError at whichever step first drew it). A scan in
        chunks of 64 MiB (uint32), about 0.1 s per GB from the page cache; skipped when the
        file's dtype cannot hold such an id, and when this process already scanned the same
        file (by device, inode, size and modification time) for the same vocabulary: the
        launch checks a source before it starts and again while it prepares the run."""
        if np.iinfo(self.dtype).max < vocab_size or self.num_tokens == 0:
            return
        found = _first_id_at_or_above(self.tokens_path, _file_identity(self.tokens_path),
                                      self.dtype, vocab_size)
        if found is not None:
            position, token = found
            raise ConfigError("data.source", str(self.directory), f"its {TOKENS_FILE} holds"
                              f" token id {token} at position {position}, not"
                              f" below the tokenizer's vocabulary of {vocab_size}")


def _file_identity(path: Path) -> tuple[int, int, int, int]:
    """What says a file is unchanged since it was last read: device, inode, size, mtime (ns)."""
    status = os.stat(path)
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _first_id_at_or_above(path: Path, identity: tuple[int, int, int, int], dtype: str,
                          vocab_size: int) -> tuple[int, int] | None:
    """The position and value of the first id ``>= vocab_size`` in the token file, or None.
    Cached by the file's ``identity`` (part of the key, so a rewritten file is scanned again):
    a result depends on nothing else."""
    tokens = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start:start + _SCAN_CHUNK]
        if int(chunk.max()) >= vocab_size:
            at = int(np.argmax(chunk >= vocab_size))
            return start + at, int(chunk[at])
    return None


# -- Tokenizing in worker processes ------------------------------------------------------------


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(kind: str) -> None:
    global _WORKER_TOKENIZER
    # A forked worker inherits its parent's handlers (see _default_sigterm); Ctrl-C is the
    # parent's to handle: it stops the pool.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One core per worker: the library's own thread pool would oversubscribe the machine.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = build_tokenizer(kind, 0, [])


def _encode(tok: Tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The documents' ids concatenated (int32) and their lengths."""
    docs = encode_documents(tok, texts)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    ids = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int32)
    return ids, lengths


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None, "worker not initialised"
    return _encode(_WORKER_TOKENIZER, texts)


def _tasks(batches: Iterable[list[str]], max_chars: int = TASK_CHARS,
           max_docs: int = TASK_DOCS) -> Iterator[list[str]]:
    """The documents of ``batches``, in order, regrouped into tasks of bounded size."""
    task: list[str] = []
    size = 0
    for batch in batches:
        for text in batch:
            task.append(text)
            size += len(text)
            if size >= max_chars or len(task) >= max_docs:
                yield task
                task, size = [], 0
    if task:
        yield task


def _pool_context() -> Any:
    # fork: the workers start at once and inherit the imported modules; they never touch torch.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _encoded_in_order(batches: Iterable[list[str]], kind: str,
                      workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode ``batches`` on ``workers`` processes, yielding results in input order, with at most
    ``2 * workers`` batches read ahead."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    # Inherited by forked workers before they first encode: no "forked after parallelism" warning.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with _default_sigterm():
            pool = _pool_context().Pool(workers, initializer=_init_worker, initargs=(kind,))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    finished = False
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        finished = True
    finally:
        if finished:  # the workers leave on the pool's sentinel: no signal needed
            pool.close()
        else:  # an error or an interrupt: stop them (SIGTERM, at its default: see above)
            pool.terminate()
        pool.join()


@contextlib.contextmanager
def _default_sigterm() -> Iterator[None]:
    """SIGTERM at its default action while the workers are forked. Forked children inherit the
    parent's dispositions, and a parent that ignores SIGTERM (a finished in-process `loom train`
    leaves it ignored) would make ``Pool.terminate()`` wait forever on a worker that ignores it;
    resetting it in the worker's initializer is too late for a worker terminated while it still
    starts. (Only the main thread may change dispositions; elsewhere they are left as they are.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Progress:
    """tqdm on stderr when it is installed, else one line every few seconds."""

    def __init__(self, total: int | None, enabled: bool) -> None:
        self.enabled, self.docs, self.tokens, self._last = enabled, 0, 0, 0.0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="doc", file=sys.stderr, dynamic_ncols=True,
                                 desc="tokenizing")
            except ImportError:
                self._start = time.monotonic()

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(docs)
            self._bar.set_postfix(tokens=f"{self.tokens:,}", refresh=False)
        elif self.enabled and time.monotonic() - self._last > 5:
            self._last = time.monotonic()
            rate = self.tokens / max(self._last - self._start, 1e-9)
            print(f"tokenizing: {self.docs:,} docs, {self.tokens:,} tokens ({rate:,.0f} tokens/s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# -- The command -------------------------------------------------------------------------------


def check_prepare_inputs(source: str, tokenizer: str, out: str | Path, *, text_field: str = "text",
                         extensions: Sequence[str] = DEFAULT_EXTENSIONS,
                         overwrite: bool = False) -> tuple[Source, Tokenizer]:
    """Everything ``prepare`` needs, checked before anything is written: ConfigError naming
    ``data.source``, ``data.text_field``, ``data.tokenizer`` or ``out``."""
    if tokenizer == "bpe":
        raise ConfigError("data.tokenizer", tokenizer, "bpe is trained inside each run; prepare"
                          " with byte or a Hugging Face tokenizer.json")
    src = resolve_source(source, extensions)
    if src.kind == PREPARED:
        raise ConfigError("data.source", source, "is already a prepared directory")
    check_readable(src, text_field, extensions, 0)
    tok = build_tokenizer(tokenizer, 0, [])
    out = Path(out)
    if out.exists() or os.path.lexists(out):
        if not out.is_dir():
            raise ConfigError("out", str(out), "exists and is not a directory")
        is_prepared = (out / PREPARED_MANIFEST).is_file()
        if any(out.iterdir()) and not (overwrite and is_prepared):
            raise ConfigError("out", str(out), "exists and is not empty" + (
                " (--overwrite replaces a prepared directory)" if is_prepared else ""))
    return src, tok


# ``--workers`` beyond this many per core is refused (``prepare``)
MAX_WORKERS_PER_CORE = 4


def prepare(source: str, tokenizer: str, out: str | Path, *, workers: int = 1,
            text_field: str = "text", extensions: Sequence[str] = DEFAULT_EXTENSIONS,
            batch_rows: int = 1024, progress: bool = True, overwrite: bool = False
            ) -> dict[str, Any]:
    """Tokenize ``source`` with ``tokenizer`` ("byte" or a Hugging Face tokenizer path) into the
    prepared directory ``out``; returns its manifest.

    Every input is checked first (``check_prepare_inputs``); the files are written in a temporary
    directory beside ``out`` that replaces it at the end, so ``out`` is never half-written.
    """
    if workers < 1:
        raise ConfigError("workers", workers, "must be >= 1")
    most = MAX_WORKERS_PER_CORE * (os.cpu_count() or 1)
    if workers > most:  # each is a forked tokenizer: 100,000 of them exhausted the memory
        raise ConfigError("workers", workers, f"must be at most {MAX_WORKERS_PER_CORE} x this"
                          f" machine's cores = {most} (more only add memory; the output does"
                          " not depend on the count)")
    src, tok = check_prepare_inputs(source, tokenizer, out, text_field=text_field,
                                    extensions=extensions, overwrite=overwrite)
    out = Path(out).resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.prepare-", dir=out.parent))
    except OSError as err:
        raise ConfigError("out", str(out), f"cannot write there: {err.strerror}") from None
    try:
        manifest = _write(src, tok, tokenizer, tmp, workers=workers, text_field=text_field,
                          extensions=extensions, batch_rows=batch_rows, progress=progress)
        _replace(tmp, out)
        return manifest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(src: Source, tok: Tokenizer, kind: str, tmp: Path, *, workers: int, text_field: str,
           extensions: Sequence[str], batch_rows: int, progress: bool) -> dict[str, Any]:
    dtype = prepared_dtype(tok.vocab_size)
    files = list_files(src.spec, extensions) if src.kind == TEXT else list(src.files)
    batches = _tasks(iter_texts(src, text_field=text_field, extensions=extensions,
                                batch_rows=batch_rows))
    if workers == 1:
        results: Iterable = (_encode(tok, batch) for batch in batches)
    else:
        results = _encoded_in_order(batches, kind, workers)
    bar = _Progress(len(files) if src.kind == TEXT else None, progress)
    total, n_docs = 0, 0
    try:
        with open(tmp / TOKENS_FILE, "wb") as tokens, open(tmp / INDEX_FILE, "wb") as index:
            index.write(np.zeros(1, dtype=INDEX_DTYPE).tobytes())
            for ids, lengths in results:
                tokens.write(ids.astype(dtype).tobytes())
                index.write((total + np.cumsum(lengths)).astype(INDEX_DTYPE).tobytes())
                total += int(lengths.sum())
                n_docs += len(lengths)
                bar.update(len(lengths), int(lengths.sum()))
    finally:
        bar.close()
    if n_docs == 0:
        raise ConfigError("data.source", src.spec, "has no non-empty document to tokenize")
    tok.save(tmp / TOKENIZER_DIR)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "source": str(src.path or src.spec),
        "source_kind": src.kind,
        "source_fingerprint": fingerprint(files),
        "text_field": text_field if src.kind in (RECORDS, SAVED) else None,
        "tokenizer": {"kind": tok.kind, "identity": tokenizer_identity(tok),
                      "source": getattr(tok, "spec", None) or kind,
                      "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
                      "bos_id": getattr(tok, "bos_id", None)},
        "dtype": dtype,
        "num_tokens": total,
        "num_docs": n_docs,
        "tokens_file": TOKENS_FILE,
        "doc_index_file": INDEX_FILE,
        "doc_index_dtype": INDEX_DTYPE,
    }
    (tmp / PREPARED_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _replace(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an old prepared ``out`` is removed only after."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        else:
            out.rmdir()
    as_created(tmp)  # mkdtemp made it 0700
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
