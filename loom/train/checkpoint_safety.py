"""Reading a checkpoint without trusting it: no code runs, no path leaves its directory.

A checkpoint directory may come from anywhere (a shared filesystem, a download, an attacker who
can write next to the run), so everything ``loom.train.checkpoint`` reads goes through here:

* **DCP's ``.metadata`` pickle** is unpickled by ``SafeMetadataUnpickler``, which resolves only an
  exact list of ``(module, name)`` pairs: DCP's own metadata dataclasses, ``torch.Size``, the torch
  dtypes and a few inert builtins. Names are compared whole, so a dotted name (``os.system`` under
  an allowed module, which pickle protocol 4 would resolve attribute by attribute) is refused,
  and so is every other module attribute (an allowed module's ``os`` import, ``getattr``,
  ``eval``). ``SafeFileSystemReader`` makes DCP itself use that unpickler (DCP's reader calls
  plain ``pickle.load``), so the bytes that were checked are the bytes that are loaded: no
  check-then-reload race. The unpickled object is then checked for shape: a ``Metadata`` whose
  storage entries name plain files inside the checkpoint, with no stream transforms (Loom writes
  none).
* **Tensors** are read by DCP with ``torch.load(weights_only=True)``; non-tensor values and RNG
  files with ``weights_only=True`` too (PyTorch's own allow-list), and RNG files must hold only
  tensors.
* **The manifest** binds every file by size and SHA-256. Its entries must be plain relative paths
  (no ``..``, not absolute) and no file or folder of the checkpoint may be a symbolic link.
  With ``LOOM_CHECKPOINT_KEY`` set, the manifest carries an HMAC-SHA256 of its canonical JSON, and
  a reader with the key refuses a manifest without one or with a wrong one; without a key nothing
  is signed, and the rules above still hold.

Loom writes this by hand because DCP leaves metadata safety to the caller (its reader unpickles
``.metadata`` unrestricted) and ``torch.load``'s allow-list does not cover plain pickles.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch

KEY_ENV = "LOOM_CHECKPOINT_KEY"


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete, corrupted or unsafe; the message says which file and why."""


# ---------------------------------------------------------------------------------------------
# The metadata pickle

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"), (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # a layout's name -> torch.layout, by table lookup
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "bytes"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
} | {("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)})


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, resolving only the exact names of ``_ALLOWED_GLOBALS``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise CheckpointError(f"the metadata pickle names {module}.{name}, which is not one of"
                              " DCP's metadata classes (loading it could execute code)")

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError("the metadata pickle holds a persistent reference, which DCP"
                              " metadata never does")


def _check_storage(metadata: Any, directory: Path) -> None:
    """The unpickled object is DCP metadata whose storage entries are plain files in
    ``directory`` (a crafted entry could otherwise send DCP to read any file)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"the metadata pickle holds a {type(metadata).__name__}, not DCP"
                              " Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError("the metadata has no state_dict_metadata table")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError("the metadata has no storage table")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointError("a storage entry of the metadata is not a DCP storage record")
        where = f"storage entry {index.fqn!r}"
        name = info.relative_path
        if not isinstance(name, str) or not name or "/" in name or "\\" in name \
                or name in (".", "..") or "\0" in name:
            raise CheckpointError(f"{where} names {name!r}, which is not a file name inside the"
                                  " checkpoint")
        file = directory / name
        if file.is_symlink() or not file.is_file():
            raise CheckpointError(f"{where} names {name!r}, which is not a regular file of the"
                                  " checkpoint")
        for field in ("offset", "length"):
            value = getattr(info, field)
            if type(value) is not int or value < 0:
                raise CheckpointError(f"{where} has {field} {value!r}; must be an integer >= 0")
        if info.transform_descriptors:
            raise CheckpointError(f"{where} asks for stream transforms"
                                  f" {info.transform_descriptors!r}; Loom writes none")


def load_metadata(directory: Path, raw: bytes | None = None) -> Any:
    """DCP metadata of ``directory`` (its ``.metadata`` unless ``raw`` is given), unpickled with
    the allow-list and checked for shape. Raises CheckpointError."""
    directory = Path(directory)
    file = directory / ".metadata"
    if raw is None:
        if file.is_symlink() or not file.is_file():
            raise CheckpointError(f"{directory}: no DCP .metadata file")
        raw = file.read_bytes()
    try:
        metadata = SafeMetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError as err:
        raise CheckpointError(f"{file}: refusing to load: {err}") from None
    except Exception as err:  # truncated or garbage pickle, or an allowed class given bad args
        raise CheckpointError(f"{file}: unreadable metadata ({type(err).__name__}: {err})"
                              ) from None
    try:
        _check_storage(metadata, directory)
    except CheckpointError as err:
        raise CheckpointError(f"{file}: refusing to load: {err}") from None
    return metadata


def safe_storage_reader(directory: Path) -> Any:
    """DCP's filesystem reader, except that ``.metadata`` is read by ``load_metadata``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointError("per-rank metadata files are not part of Loom checkpoints")
            metadata = load_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(directory)


# ---------------------------------------------------------------------------------------------
# Files and the manifest


def manifest_name_is_safe(name: Any) -> bool:
    """A manifest entry: a relative POSIX path of plain components (no ``..``, not absolute)."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return False
    parts = PurePosixPath(name).parts
    return (not PurePosixPath(name).is_absolute() and all(p not in ("", ".", "..") for p in parts)
            and "/".join(parts) == name)


def regular_files(directory: Path, skip: tuple[str, ...] = ()) -> list[str]:
    """Every file under ``directory`` as a relative POSIX path, sorted; raises CheckpointError on
    a symbolic link or anything that is neither a folder nor a regular file."""
    directory = Path(directory)
    if directory.is_symlink():
        raise CheckpointError(f"{directory}: is a symbolic link; a checkpoint is a real folder")
    found = []
    for top, dirs, files in os.walk(directory, followlinks=False):
        for name in dirs + files:
            path = Path(top) / name
            if path.is_symlink():
                raise CheckpointError(f"{path}: is a symbolic link; checkpoints hold regular"
                                      " files only")
        for name in files:
            path = Path(top) / name
            if not path.is_file():
                raise CheckpointError(f"{path}: is not a regular file")
            relative = path.relative_to(directory).as_posix()
            if relative not in skip:
                found.append(relative)
    return sorted(found)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def checkpoint_key() -> bytes | None:
    key = os.environ.get(KEY_ENV, "")
    return key.encode() if key else None


def sign(manifest: dict[str, Any], key: bytes | None = None) -> dict[str, Any]:
    """``manifest`` plus its HMAC-SHA256 when a key is configured (unchanged otherwise)."""
    key = key if key is not None else checkpoint_key()
    if key:
        manifest = dict(manifest, hmac=hmac.new(key, _canonical(manifest), "sha256").hexdigest())
    return manifest


def check_signature(manifest: dict[str, Any], where: Path, key: bytes | None = None) -> None:
    """With a key: the manifest must carry the matching HMAC. Without one: nothing to check."""
    key = key if key is not None else checkpoint_key()
    if not key:
        return
    given = manifest.get("hmac")
    if not isinstance(given, str):
        raise CheckpointError(f"{where}: not signed, but {KEY_ENV} is set (a signed run refuses"
                              " unsigned checkpoints)")
    expected = hmac.new(key, _canonical(manifest), "sha256").hexdigest()
    if not hmac.compare_digest(given, expected):
        raise CheckpointError(f"{where}: the HMAC does not match (altered, or signed with another"
                              f" {KEY_ENV})")


def read_manifest(file: Path) -> dict[str, Any]:
    """The manifest's JSON, checked for shape: ``{"step": int, "files": {name: {"size": int,
    "sha256": hex}}}`` with safe names. Raises CheckpointError."""
    if file.is_symlink() or not file.is_file():  # a FIFO would block the read
        raise CheckpointError(f"{file}: missing or not a regular file")
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: absurdly deep JSON
        raise CheckpointError(f"{file}: unreadable manifest ({type(err).__name__}:"
                              f" {str(err)[:200]})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{file}: malformed manifest (no 'files' table)")
    for name, entry in files.items():
        if not manifest_name_is_safe(name):
            raise CheckpointError(f"{file}: manifest entry {name!r} is not a plain relative path"
                                  " inside the checkpoint")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int
                and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(f"{file}: manifest entry {name!r} lacks an integer size and a"
                                  " sha256")
    return manifest


def load_rng_file(file: Path) -> dict[str, torch.Tensor]:
    """A rank's RNG states: read with ``weights_only=True`` and required to be name -> tensor."""
    try:
        state = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as err:  # UnpicklingError for a refused global; anything for garbage
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file}: refusing to load the RNG state: {last}") from None
    if not (isinstance(state, dict) and state
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
            and isinstance(state.get("cpu"), torch.Tensor) and state["cpu"].dtype == torch.uint8):
        raise CheckpointError(f"{file}: not an RNG state (expected name -> uint8 tensor)")
    expected = torch.get_rng_state().numel()
    if state["cpu"].numel() != expected:  # crafted, or another torch's generator layout
        raise CheckpointError(f"{file}: the CPU RNG state holds {state['cpu'].numel()} bytes,"
                              f" this torch's generator needs {expected}")
    return state


__all__ = ["CheckpointError", "KEY_ENV", "SafeMetadataUnpickler", "load_metadata",
           "safe_storage_reader", "manifest_name_is_safe", "regular_files", "sha256_of", "sign",
           "check_signature", "read_manifest", "load_rng_file", "checkpoint_key"]
