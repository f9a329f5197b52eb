"""Where documents come from: what a ``data.source`` names, and reading its texts in order.

A source is one of

* ``"stdlib"``, a text file or a directory of text files (``loom.data.corpus``: a file is a
  document);
* a record file: JSON lines (``.jsonl``, ``.json``), Parquet (``.parquet``) or Arrow (``.arrow``),
  or a directory holding only such files (shards, read in sorted order); a row is a document, its
  text in the column ``data.text_field``;
* a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` of
  which the ``train`` split, or the only split, is read);
* a directory written by ``loom data prepare`` (``loom.data.prepare``): already tokenized.

Record files and saved datasets are read with the ``datasets`` library, never by hand: local files
only (files are streamed, nothing is converted into the Hugging Face cache), and ``datasets`` is
imported only here, when such a source is read, because it is a heavy optional dependency that the
default corpus does not need.

Record sources are split into training and validation by position: the last
``round(n * val_fraction)`` documents (at least one, when there are two or more) are for
validation. Unlike the per-name hash of text corpora, that keeps each split one contiguous range
of a prepared token file, so a prepared directory is trained on in place, without a copy, and gives
the same split as tokenizing the same rows on the fly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from loom.data.corpus import (STDLIB_SOURCE, Document, SourceFile, first_text_file, list_files,
                              read_documents, walk_sorted)
from loom.errors import ConfigError, suggest

TEXT, RECORDS, SAVED, PREPARED = "text", "records", "saved", "prepared"
# file suffix -> the datasets builder that reads it
RECORD_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
PREPARED_MANIFEST = "prepared.json"  # what marks a `loom data prepare` directory
DEFAULT_EXTENSIONS = (".py", ".txt", ".md")
_BATCH_ROWS = 1024  # rows per batch read from a record source


@dataclass(frozen=True)
class Source:
    """A resolved ``data.source``: its kind, and the files that make it up (none for stdlib
    text, which ``corpus.list_files`` lists)."""

    spec: str
    kind: str
    path: Path | None = None
    builder: str | None = None  # RECORDS: "json", "parquet" or "arrow"
    files: tuple[SourceFile, ...] = ()


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _record_builder(spec: str, files: Sequence[SourceFile]) -> str:
    builders = {RECORD_SUFFIXES[_suffix(f.path)] for f in files}
    if len(builders) > 1:
        raise ConfigError("data.source", spec, f"mixes record formats"
                          f" ({', '.join(sorted(builders))}); use one format per source (data.mix"
                          " combines sources)")
    return builders.pop()


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _files_under(root: Path) -> tuple[SourceFile, ...]:
    out = []
    for name, path in walk_sorted(root, ("",)):
        try:
            out.append(SourceFile(name, path, path.stat().st_size))
        except OSError:
            continue
    return tuple(out)


def resolve_source(source: str | os.PathLike[str],
                   extensions: Sequence[str] = DEFAULT_EXTENSIONS) -> Source:
    """What ``source`` is; ConfigError naming ``data.source`` when it does not exist, is not a
    regular file or directory, or is a directory of record files in several formats. Reads no
    file (lists them)."""
    spec = str(source)
    if spec == STDLIB_SOURCE:
        return Source(spec, TEXT)
    path = Path(source).expanduser()
    if path.is_file() and _suffix(path) in RECORD_SUFFIXES:
        files = (SourceFile(path.name, path.resolve(), path.stat().st_size),)
        return Source(spec, RECORDS, path.resolve(), RECORD_SUFFIXES[_suffix(path)], files)
    if path.is_dir():
        if (path / PREPARED_MANIFEST).is_file():
            return Source(spec, PREPARED, path.resolve(), None, _files_under(path))
        if _is_saved_dataset(path):
            return Source(spec, SAVED, path.resolve(), None, _files_under(path))
        records = [SourceFile(name, p, size)
                   for name, p in walk_sorted(path, tuple(RECORD_SUFFIXES))
                   if (size := p.stat().st_size) > 0]
        texts = walk_sorted(path, tuple(extensions)) if extensions else []
        if records and not texts:
            return Source(spec, RECORDS, path.resolve(), _record_builder(spec, records),
                          tuple(records))
    return Source(spec, TEXT, path.resolve() if path.exists() else None)  # corpus.py refuses


# -- Record sources, through the datasets library ----------------------------------------------


@contextlib.contextmanager
def _reading(src: Source) -> Iterator[None]:
    """Errors of the datasets library as one ConfigError naming ``data.source``; the library's
    own error log is silenced meanwhile, since the refusal says it in one line."""
    library_log = logging.getLogger("datasets")
    level = library_log.level
    library_log.setLevel(logging.CRITICAL)
    try:
        yield
    except ConfigError:
        raise
    except Exception as err:  # the library's errors have no common base class
        raise ConfigError("data.source", src.spec, f"cannot be read as a dataset:"
                          f" {_first_line(err)}") from None
    finally:
        library_log.setLevel(level)


# Nesting deeper than this is refused before pyarrow's JSON reader sees it: the reader recurses
# on the C stack and kills the process (a segfault, no exception) somewhere between 10^4 and
# 5 x 10^4 levels here. Python's own json module stops near 10^3, as this does.
MAX_JSON_DEPTH = 1000
_CHUNK_BYTES = 1 << 24


def _check_json_depth(src: Source) -> None:
    """ConfigError naming the file and line when a line of a JSON-lines file of ``src`` nests
    deeper than ``MAX_JSON_DEPTH`` (pyarrow parses each line on its own; a document spread over
    lines fails there with an error, not a crash). Only a line with more opening brackets than
    the limit can nest that deep, and only such a line is parsed, by Python's json module, whose
    C parser stops at its recursion limit with an exception. It reads the file once more, in
    about the time pyarrow's own parse takes (``bench/json_depth_check.py``)."""
    for file in src.files:
        line_number = 0
        with open(file.path, "rb") as handle:
            while chunk := handle.read(_CHUNK_BYTES):
                chunk += handle.readline()  # whole lines only
                if chunk.count(b"[") + chunk.count(b"{") <= MAX_JSON_DEPTH:
                    line_number += chunk.count(b"\n")
                    continue
                for line in chunk.split(b"\n"):
                    line_number += 1
                    if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH \
                            and _too_deep(line):
                        raise ConfigError("data.source", src.spec, f"{file.path.name} line"
                                          f" {line_number} nests deeper than {MAX_JSON_DEPTH}"
                                          " levels (pyarrow's JSON reader would crash on it)")
                line_number -= 1  # the piece after the chunk's last newline is no line


def _too_deep(line: bytes) -> bool:
    try:
        json.loads(line)
    except RecursionError:
        return True
    except ValueError:  # not JSON: pyarrow's error names it
        return False
    return False


def _open_records(src: Source) -> Any:
    """The rows of a record source or saved dataset: a ``datasets`` (Iterable)Dataset."""
    if src.kind == RECORDS and src.builder == "json":
        _check_json_depth(src)
    try:
        # Imported here, not at the top: ``datasets`` pulls in pyarrow, pandas and fsspec, which
        # the default corpus and every worker process would otherwise pay for at import.
        import datasets
    except ImportError:
        raise ConfigError("data.source", src.spec, "is a dataset file; reading it needs the"
                          " datasets library: pip install 'loom[data]'") from None
    datasets.disable_progress_bars()  # Loom draws its own; the library's would interleave
    with _reading(src):
        if src.kind == SAVED:
            ds = datasets.load_from_disk(str(src.path))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds and len(ds) != 1:
                    raise ConfigError("data.source", src.spec, "is a DatasetDict without a"
                                      f" 'train' split (splits: {', '.join(ds)}); save one split")
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            return ds
        # Streamed: the files are read in place, not converted into the Hugging Face cache.
        return datasets.load_dataset(src.builder, data_files=[str(f.path) for f in src.files],
                                     split="train", streaming=True)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


def _columns(src: Source) -> dict[str, str]:
    """Column name -> type name ("string", "int64", ...) of a record source's rows."""
    ds = _open_records(src)
    with _reading(src):
        features = ds.features
        if features is None:  # a stream whose schema is not inferred yet: look at its first row
            first = next(iter(ds), {})
            return {k: "string" if isinstance(v, str) else type(v).__name__
                    for k, v in first.items()}
        return {name: getattr(f, "dtype", type(f).__name__) for name, f in features.items()}


def check_text_field(src: Source, text_field: str) -> None:
    """A record source or saved dataset has a text column ``text_field``; ConfigError naming
    ``data.text_field`` when it has not (``data.source`` when it cannot be read). Reads at most
    the first batch of rows; writes nothing."""
    columns = _columns(src)
    if text_field not in columns:
        raise ConfigError("data.text_field", text_field, f"is not a column of {src.spec!r}"
                          f" (columns: {', '.join(columns) or 'none'})"
                          + suggest(text_field, list(columns)))
    if columns[text_field] not in ("string", "large_string"):
        raise ConfigError("data.text_field", text_field, f"column of {src.spec!r} holds"
                          f" {columns[text_field]}, not text")


def _record_texts(src: Source, text_field: str, batch_rows: int) -> Iterator[list[str]]:
    ds = _open_records(src)
    with _reading(src):  # a malformed line deep in the file, an unreadable shard
        for batch in ds.select_columns([text_field]).iter(batch_size=batch_rows):
            yield [t for t in batch[text_field] if isinstance(t, str) and t]


def iter_texts(src: Source, *, text_field: str = "text",
               extensions: Sequence[str] = DEFAULT_EXTENSIONS, max_bytes: int = 0,
               batch_rows: int = _BATCH_ROWS) -> Iterator[list[str]]:
    """The non-empty document texts of a text or record source, in order, in batches.

    A text source's documents are its files (``corpus.list_files``, one batch per file read);
    a record source's are its rows. ``max_bytes > 0`` stops after the leading documents whose
    UTF-8 sizes sum to at most that (at least one), as it caps a text corpus by file sizes.
    """
    if src.kind == TEXT:
        files = list_files(src.spec, extensions, max_bytes)
        for start in range(0, len(files), 64):
            yield [d.text for d in read_documents(files[start : start + 64])]
        return
    if src.kind not in (RECORDS, SAVED):
        raise ValueError(f"{src.spec!r} is {src.kind}, not a text or record source")
    total, first = 0, True
    for batch in _record_texts(src, text_field, batch_rows):
        if max_bytes > 0:
            kept = []
            for text in batch:
                size = len(text.encode("utf-8"))
                if not first and total + size > max_bytes:
                    if kept:
                        yield kept
                    return
                kept.append(text)
                total += size
                first = False
            batch = kept
        if batch:
            yield batch


def read_source_documents(src: Source, *, text_field: str = "text",
                          extensions: Sequence[str] = DEFAULT_EXTENSIONS,
                          max_bytes: int = 0) -> list[Document]:
    """All documents of a text or record source, in order (record rows are named ``#<row>``)."""
    if src.kind == TEXT:
        return read_documents(list_files(src.spec, extensions, max_bytes))
    texts = [t for batch in iter_texts(src, text_field=text_field, max_bytes=max_bytes)
             for t in batch]
    if not texts:
        raise ConfigError("data.source", src.spec, f"has no non-empty text in column"
                          f" {text_field!r}")
    return [Document(f"#{i}", t) for i, t in enumerate(texts)]


def check_readable(src: Source, text_field: str, extensions: Sequence[str],
                   max_bytes: int) -> list[SourceFile]:
    """Config validation of a text or record source, writing nothing: a text source has a
    readable text file; a record source has the text column. Returns the files listed."""
    if src.kind == TEXT:
        files = list_files(src.spec, extensions, max_bytes)
        first_text_file(src.spec, files)
        return files
    check_text_field(src, text_field)
    return list(src.files)


def record_val_count(n_docs: int, val_fraction: float) -> int:
    """Documents at the end of a record source kept for validation (see the module docstring)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    if n_docs < 2 or val_fraction == 0:
        return 0
    return min(n_docs - 1, max(1, round(n_docs * val_fraction)))


def split_records(docs: Sequence[Document],
                  val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Training documents first, the last ``record_val_count`` for validation."""
    cut = len(docs) - record_val_count(len(docs), val_fraction)
    return list(docs[:cut]), list(docs[cut:])
