"""Checkpoints for the fuzz suite: small real ones made once per session with
``loom.train.checkpoint.save`` (one process, no process group), and the mutations applied to a
copy: truncation, bit flips, swapped shard files, edited / forged manifests, deleted and extra
files, rewritten ``.metadata`` / RNG / ``extra.json`` (including pickles whose execution would
make a marker folder), symlinks, FIFOs, renamed step folders."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from tests.fuzz import harness

MARKER_NAME = "PWNED"  # any code a pickle runs makes this folder (os.mkdir)


def ckpt_module():
    from loom.train import checkpoint

    return checkpoint


def original_tensors() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    return {
        "model": {"w": torch.randn(4, 3, generator=gen), "b": torch.arange(5),
                  "h": torch.randn(2, 2, generator=gen).to(torch.bfloat16)},
        "optim": {"state.w.exp_avg": torch.randn(4, 3, generator=gen),
                  "state.w.step": torch.tensor(3.0),
                  "param_groups.w.lr": 0.01, "param_groups.w.betas": (0.9, 0.95),
                  "param_groups.w.amsgrad": False},
    }


def template() -> dict[str, Any]:
    """What a trainer passes to ``load``: the same keys and shapes, other values."""
    out: dict[str, Any] = {}
    for part, values in original_tensors().items():
        out[part] = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
                     for k, v in values.items()}
    return out


def same_content(loaded: dict[str, Any], expected: dict[str, Any]) -> str | None:
    """None when equal bit for bit (dtype, shape, values); else what differs."""
    for part, values in expected.items():
        for key, want in values.items():
            got = loaded.get(part, {}).get(key)
            if isinstance(want, torch.Tensor):
                if not (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                        and got.shape == want.shape and torch.equal(got, want)):
                    return f"{part}.{key}: {got!r} != {want!r}"
            elif got != want:
                return f"{part}.{key}: {got!r} != {want!r}"
    return None


class _MakeDir:
    """Pickles as a call of os.mkdir(path): loading it with plain pickle makes the folder."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def base_checkpoints() -> dict[str, Path]:
    """Made once: ``plain`` (steps 1 and 2), ``hostile`` (a non-tensor value that is a pickled
    call of os.mkdir(marker), consistent manifest), ``signed`` (steps 1 and 2 under a
    ``LOOM_CHECKPOINT_KEY``, when the module supports one)."""
    def make() -> dict[str, Path]:
        ck = ckpt_module()
        root = harness.session_dir() / "checkpoints"
        out = {"plain": root / "plain"}
        for step in (1, 2):
            ck.save(out["plain"], step, original_tensors(), {"step": step, "note": "fuzz"})
        out["hostile"] = root / "hostile"
        marker = harness.session_dir() / MARKER_NAME
        ck.save(out["hostile"], 1, {"optim": {"param_groups.w.lr": _MakeDir(str(marker))}},
                {"step": 1})
        key_env = signing_env()
        if key_env:
            out["signed"] = root / "signed"
            old = os.environ.get(key_env)
            os.environ[key_env] = "fuzz-key"
            try:
                for step in (1, 2):
                    ck.save(out["signed"], step, original_tensors(), {"step": step, "note": "fuzz"})
            finally:
                os.environ.pop(key_env) if old is None else os.environ.__setitem__(key_env, old)
        return out
    import warnings

    with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        return harness.once("base-checkpoints", make)


def signing_env() -> str | None:
    try:
        from loom.train import checkpoint_safety
    except ImportError:
        return None
    return getattr(checkpoint_safety, "KEY_ENV", None)


def session_marker() -> Path:
    return harness.session_dir() / MARKER_NAME


# ---------------------------------------------------------------------------------------------
# Hostile bytes

def call_pickle(module: str, name: str, arg: str, *, proto: int = 4, opcode: str = "stack"
                ) -> bytes:
    """A pickle that calls ``module.name(arg)`` (``name`` may be dotted: protocol 4 resolves
    it attribute by attribute) via STACK_GLOBAL, GLOBAL or INST."""
    def short(text: str) -> bytes:
        raw = text.encode("utf-8")
        return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else \
            b"\x8d" + struct.pack("<Q", len(raw)) + raw
    head = b"\x80" + bytes([proto])
    if opcode == "global":
        return head + b"c" + module.encode() + b"\n" + name.encode() + b"\n" + short(arg) \
            + b"\x85R."
    if opcode == "inst":
        return head + b"(" + short(arg) + b"i" + module.encode() + b"\n" + name.encode() + b"\n."
    return head + short(module) + short(name) + b"\x93" + short(arg) + b"\x85R."


# (module, name) pairs: plainly dangerous, and dangerous names reached through modules or classes
# that an allow-list might admit (dotted names under protocol 4).
CALL_TARGETS = [
    ("os", "mkdir"), ("posix", "mkdir"), ("builtins", "eval"), ("builtins", "exec"),
    ("torch.distributed.checkpoint.metadata", "os.mkdir"),
    ("torch.distributed.checkpoint.planner", "io.os.mkdir"),
    ("torch.distributed.checkpoint.filesystem", "os.mkdir"),
    ("torch", "os.mkdir"), ("torch", "serialization.os.mkdir"),
    ("pathlib", "os.mkdir"), ("pathlib", "PosixPath.mkdir"), ("collections", "os.mkdir"),
    ("collections", "_sys.modules.get"), ("torch.serialization", "os.mkdir"),
    ("builtins", "getattr"), ("torch", "load"), ("shutil", "rmtree"), ("subprocess", "run"),
]


DOTTED_TARGETS = [t for t in CALL_TARGETS if "." in t[1]]


def exploit_pickle(target: tuple[str, str], marker: Path, opcode: str) -> bytes:
    module, name = target
    arg = str(marker)
    if name in ("eval", "exec"):
        arg = f"__import__('os').mkdir({str(marker)!r})"
    return call_pickle(module, name, arg, opcode=opcode)


def torch_zip_with_pickle(payload: bytes) -> bytes:
    """A ``torch.save`` zip whose ``data.pkl`` is ``payload`` (for RNG files)."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = payload if info.filename.endswith("/data.pkl") else source.read(info)
            target.writestr(info.filename, data)
    return out.getvalue()


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def metadata_variants() -> dict[str, bytes]:
    """The DCP metadata of the session's pristine plain checkpoint, re-pickled with crafted
    storage records (pickles of allowed classes only, so only the shape checks stand in the way).
    Never unpickles a mutated file: that could run a planted exploit in the test itself."""
    return harness.once("metadata-variants", _metadata_variants)


def _metadata_variants() -> dict[str, bytes]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    pristine = sorted(base_checkpoints()["plain"].iterdir())[-1] / ".metadata"
    metadata = pickle.loads(pristine.read_bytes())  # written by save() in this process
    out: dict[str, Any] = {}

    def edited(edit) -> bytes:
        copy = pickle.loads(pickle.dumps(metadata))
        edit(copy)
        return pickle.dumps(copy, protocol=4)

    def storage(**changes):
        def edit(meta):
            for index, info in list(meta.storage_data.items()):
                fields = {f: getattr(info, f) for f in ("relative_path", "offset", "length")}
                fields.update(changes)
                meta.storage_data[index] = _StorageInfo(**fields)
        return edit

    for name, edit in {
        "path-outside": storage(relative_path="../../../../etc/hostname"),
        "path-absolute": storage(relative_path="/etc/hostname"),
        "path-manifest": storage(relative_path="manifest.json"),
        "path-extra": storage(relative_path="extra.json"),
        "path-rng": storage(relative_path="rng/rank0.pt"),
        "path-missing": storage(relative_path="nope.distcp"),
        "offset-huge": storage(offset=2**62),
        "offset-negative": storage(offset=-5),
        "length-huge": storage(length=2**40),
        "length-zero": storage(length=0),
        "length-float": storage(length=1.5),
        "no-storage": lambda m: m.storage_data.clear(),
        "no-state": lambda m: m.state_dict_metadata.clear(),
        "storage-none": lambda m: setattr(m, "storage_data", None),
        "state-list": lambda m: setattr(m, "state_dict_metadata", []),
    }.items():
        try:
            out[name] = edited(edit)
        except Exception:  # noqa: BLE001 - a variant this torch cannot express
            continue
    out["not-metadata-dict"] = pickle.dumps({"a": 1}, protocol=4)
    out["not-metadata-int"] = pickle.dumps(7, protocol=2)
    out["empty"] = b""
    out["garbage"] = os.urandom(64)
    out["proto0"] = pickle.dumps(metadata, protocol=0)
    out["proto5"] = pickle.dumps(metadata, protocol=5)
    return out


# ---------------------------------------------------------------------------------------------
# Applying mutations


def files_of(step: Path) -> list[str]:
    out = []
    for top, dirs, files in os.walk(step, followlinks=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            out.append(os.path.relpath(os.path.join(top, name), step))
    return sorted(out)


def read_json(path: Path, default: Any) -> Any:
    """JSON of a regular file (never opens a FIFO a mutation left there), else ``default``."""
    if path.is_symlink() or not path.is_file():
        return default
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return default


def rewrite_manifest(step: Path, edit) -> None:
    path = step / "manifest.json"
    manifest = read_json(path, None)
    if not isinstance(manifest, dict):
        manifest = {"step": 0, "files": {}}
    result = edit(manifest)
    text = result if isinstance(result, (str, bytes)) else json.dumps(manifest)
    if path.is_symlink() or not path.is_file():
        with_unlink(path)
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))


def with_unlink(path: Path) -> None:
    if path.is_symlink() or path.is_file() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def forge(step: Path) -> None:
    """What an attacker who can write the folder does: a manifest that matches the files."""
    files = {}
    for top, _dirs, names in os.walk(step, followlinks=False):
        for name in names:
            path = Path(top) / name
            rel = path.relative_to(step).as_posix()
            if rel in ("manifest.json", "COMMITTED") or not path.is_file() or path.is_symlink():
                continue
            files[rel] = {"size": path.stat().st_size,
                          "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    old = read_json(step / "manifest.json", {})
    manifest = {"step": old.get("step", 2) if isinstance(old, dict) else 2, "files": files}
    if isinstance(old, dict) and "hmac" in old:
        manifest["hmac"] = old["hmac"]  # the attacker has no key: the old signature stays
    path = step / "manifest.json"
    if path.is_symlink() or (path.exists() and not path.is_file()):
        with_unlink(path)
    path.write_text(json.dumps(manifest))
