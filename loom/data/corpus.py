"""Text corpus: find the documents to train on and split them into train and validation.

The default corpus is the Python standard library's own ``.py`` sources, located through
``sysconfig``: real text that every machine running Loom already has, so a first run needs no
download and no network. A user's own text file or directory replaces it through ``data.source``.

This is hand-written rather than taken from a dataset library because what matters here is small
and strict: the document order must be identical on every machine and every run (sorted relative
paths), installed third-party packages must never leak into the "standard library" corpus, and the
train/validation split must be stable when documents are added or removed (a per-name CRC, not
Python's salted ``hash`` and not a shuffled index).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from loom.errors import ConfigError

STDLIB_SOURCE = "stdlib"
STDLIB_EXTENSIONS = (".py",)
# Third-party installs live under the stdlib directory on most layouts; they are not "the standard
# library" and would make the corpus depend on what happens to be installed.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Document:
    """One text document; ``name`` is its path relative to the corpus root (POSIX separators)."""

    name: str
    text: str


@dataclass(frozen=True)
class SourceFile:
    """A file selected for the corpus, before it is read (name, location, size in bytes)."""

    name: str
    path: Path
    size: int


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library (``sysconfig`` ``stdlib`` path).

    The ``site-packages`` / ``dist-packages`` subtrees below it are skipped by ``list_files``.
    """
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _resolve_source(source: str | os.PathLike[str]) -> Path:
    if str(source) == STDLIB_SOURCE:
        return stdlib_root()
    path = Path(source).expanduser()
    if not path.exists():
        shown = "" if str(path) == str(source) else f" ({str(path)!r})"
        raise ConfigError("data.source", str(source), f"path{shown} does not exist; use"
                          f" {STDLIB_SOURCE!r} or an existing text file or directory")
    if not (path.is_file() or path.is_dir()):  # never opened: reading a FIFO would block
        raise ConfigError("data.source", str(source), "is not a regular file or a directory"
                          " (a pipe, socket or device is not a corpus)")
    return path.resolve()


def walk_sorted(root: Path, extensions: Sequence[str]) -> list[tuple[str, Path]]:
    """(relative POSIX name, path) of every matching regular file below root, sorted by name."""
    found: list[tuple[str, Path]] = []
    suffixes = tuple(extensions)
    # os.walk (not rglob) so the excluded subtrees are pruned rather than listed and filtered:
    # site-packages can hold far more files than the stdlib itself. Symlinked dirs are not
    # followed, which keeps the walk finite and the corpus independent of links.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for filename in filenames:
            path = Path(dirpath) / filename
            if filename.endswith(suffixes) and path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def _take_up_to(files: list[SourceFile], max_bytes: int) -> list[SourceFile]:
    """The leading files whose sizes sum to at most max_bytes (always at least one file)."""
    if max_bytes <= 0:
        return files
    kept: list[SourceFile] = []
    total = 0
    for f in files:
        if kept and total + f.size > max_bytes:
            break
        kept.append(f)
        total += f.size
    return kept


def list_files(
    source: str | os.PathLike[str],
    extensions: Sequence[str] = (".py", ".txt", ".md"),
    max_bytes: int = 0,
) -> list[SourceFile]:
    """The non-empty regular files making up a corpus, in sorted order, without reading them
    (a FIFO or other non-regular entry is skipped, never opened); ConfigError naming
    ``data.source`` when there is none.

    ``source`` is ``"stdlib"`` (only ``.py`` files; ``extensions`` is ignored), a single file (taken
    whatever its extension) or a directory (files ending in one of ``extensions``).
    ``max_bytes > 0`` keeps only the leading files up to that many bytes (at least one file).
    """
    root = _resolve_source(source)
    if str(source) == STDLIB_SOURCE:
        extensions = STDLIB_EXTENSIONS
    entries = [(root.name, root)] if root.is_file() else walk_sorted(root, extensions)
    files = [SourceFile(name, path, size) for name, path in entries
             if (size := _regular_size(path)) > 0]
    if not files:
        where = (f"{str(root)!r} is an empty file" if root.is_file() else
                 f"no non-empty files ending in {tuple(extensions)} under {str(root)!r};"
                 f" check data.source and data.extensions")
        raise ConfigError("data.source", str(source), where)
    return _take_up_to(files, max_bytes)


def _regular_size(path: Path) -> int:
    """Size of a regular file (symlinks followed); 0 for anything else or what vanished."""
    try:
        info = path.stat()
    except OSError:
        return 0
    return info.st_size if stat.S_ISREG(info.st_mode) else 0


TEXT_PROBE_BYTES = 8000  # as git: a NUL byte in the first 8000 bytes means binary


def first_text_file(source: str | os.PathLike[str], files: Sequence[SourceFile]) -> SourceFile:
    """The first of ``files`` that opens and starts like text (no NUL byte in its first 8000
    bytes, git's test); ConfigError naming ``data.source`` when none does. Reads one probe per
    file until one passes, so a text corpus costs one small read."""
    reasons = []
    for f in files:
        try:
            with f.path.open("rb") as handle:
                head = handle.read(TEXT_PROBE_BYTES)
        except OSError as err:
            reasons.append(f"{f.name}: {err.strerror}")
            continue
        if head and b"\0" not in head:
            return f
        reasons.append(f"{f.name}: binary (NUL bytes)")
    shown = "; ".join(reasons[:3]) + (f"; ... ({len(reasons)} files)" if len(reasons) > 3 else "")
    raise ConfigError("data.source", str(source), f"has no readable text file ({shown})")


def fingerprint(files: Sequence[SourceFile]) -> str:
    """A short digest of the file names and sizes: detects a changed corpus without reading it."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{f.size}\n".encode())
    return digest.hexdigest()[:16]


def read_documents(files: Sequence[SourceFile]) -> list[Document]:
    """Read files as UTF-8; undecodable bytes become U+FFFD rather than failing the run.
    A file that cannot be read raises ConfigError naming ``data.source`` and the file."""
    docs = []
    for f in files:
        try:
            data = f.path.read_bytes()
        except OSError as err:
            raise ConfigError("data.source", str(f.path), f"cannot be read: {err.strerror}"
                              ) from None
        docs.append(Document(f.name, data.decode("utf-8", errors="replace")))
    return [d for d in docs if d.text]


def load_documents(
    source: str | os.PathLike[str],
    extensions: Sequence[str] = (".py", ".txt", ".md"),
    max_bytes: int = 0,
) -> list[Document]:
    """Documents of a corpus sorted by relative path; see ``list_files`` for the arguments.

    Raises ``ConfigError`` naming ``data.source`` when the path does not exist, is not a regular
    file or directory (a FIFO is never opened), or holds no non-empty file to read.
    """
    return read_documents(list_files(source, extensions, max_bytes))


def _unit_hash(name: str) -> float:
    """A value in [0, 1) that depends only on the name: the same on every machine and run."""
    return zlib.crc32(name.encode("utf-8")) / 2**32


def _split_single(doc: Document, val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Split one document at a line boundary near the (1 - val_fraction) point of its text."""
    cut = int(len(doc.text) * (1.0 - val_fraction))
    newline = doc.text.rfind("\n", 0, cut)
    if newline > 0:
        cut = newline + 1  # keep whole lines on each side when the text has any
    train, val = doc.text[:cut], doc.text[cut:]
    if not train or not val:
        return [doc], []
    return [Document(f"{doc.name}#train", train)], [Document(f"{doc.name}#val", val)]


def split_documents(
    docs: Sequence[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Deterministic, stable split: a document is for validation when crc32(name) < val_fraction.

    Both splits keep the input order. With two or more documents each split gets at least one (the
    document with the smallest hash moves to validation, or the largest to training). A single
    document (e.g. one user text file) is cut at a line boundary so that validation is not empty.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must be in [0, 1)")
    if len(docs) == 1 and val_fraction > 0:
        return _split_single(docs[0], val_fraction)
    is_val = [_unit_hash(d.name) < val_fraction for d in docs]
    if len(docs) >= 2 and not any(is_val):
        is_val[min(range(len(docs)), key=lambda i: _unit_hash(docs[i].name))] = True
    if len(docs) >= 2 and all(is_val):
        is_val[max(range(len(docs)), key=lambda i: _unit_hash(docs[i].name))] = False
    train = [d for d, v in zip(docs, is_val) if not v]
    val = [d for d, v in zip(docs, is_val) if v]
    return train, val
