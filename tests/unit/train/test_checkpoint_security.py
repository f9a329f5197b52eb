"""Loading a checkpoint never executes code and never reads outside it, whatever an attacker
writes into the checkpoint folder (and into its unsigned manifest, which they can rewrite).

Each test plants one bypass technique whose success would create a marker file, rewrites the
manifest so the sizes and hashes match (as an attacker with write access would), and checks that
the checkpoint is refused with a clear message and the marker never appears."""

import hashlib
import io
import json
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch

from loom.train import checkpoint as ckpt
from loom.train.checkpoint_safety import KEY_ENV

torch.set_num_threads(1)


def _save(root: Path, step: int, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    tensors = {"model": {"w": torch.randn(4, 4), "b": torch.randn(4)},
               "optim": {"lr": 0.1, "betas": (0.9, 0.95)}}
    return ckpt.save(root, step, tensors, {"step": step})


def _blank() -> dict:
    return {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)},
            "optim": {"lr": 0.0, "betas": (0.0, 0.0)}}


def _rehash(path: Path) -> None:
    """What an attacker does after editing files: make the unsigned manifest match again."""
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    files = {}
    for file in sorted(path.rglob("*")):
        name = file.relative_to(path).as_posix()
        if file.is_file() and not file.is_symlink() and name not in (ckpt.MANIFEST,
                                                                     ckpt.COMMIT_MARKER):
            files[name] = {"size": file.stat().st_size,
                           "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}
    manifest["files"] = files
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _command_pickle(module: str, name: str, marker: Path) -> bytes:
    """A protocol-4 pickle calling ``module``.``name``("touch marker"): STACK_GLOBAL, REDUCE."""
    def text(value: str) -> bytes:
        raw = value.encode()
        return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else \
            b"X" + struct.pack("<I", len(raw)) + raw

    body = (text(module) + text(name) + b"\x93" + text(f"touch {marker}") + b"\x85" + b"R" + b".")
    return b"\x80\x04" + body


def _plant_metadata(path: Path, raw: bytes) -> None:
    (path / ".metadata").write_bytes(raw)
    _rehash(path)


def _refused(path: Path, marker: Path, match: str) -> None:
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.verify(path)
    with pytest.raises(ckpt.CheckpointError, match=match):
        ckpt.load(path, _blank())
    assert not marker.exists(), "the planted code ran"


# -- the metadata pickle -----------------------------------------------------------------------

def test_a_dotted_name_under_an_allowed_module_is_refused(tmp_path):
    """The reported hole: pickle protocol 4 resolves ``os.system`` attribute by attribute under a
    module the old prefix rule allowed (DCP's metadata module imports os)."""
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    _plant_metadata(path, _command_pickle("torch.distributed.checkpoint.metadata", "os.system",
                                          marker))
    _refused(path, marker, r"names torch\.distributed\.checkpoint\.metadata\.os\.system")


@pytest.mark.parametrize("module, name", [
    ("torch.distributed.checkpoint.metadata", "os"),           # a module an allowed one imports
    ("builtins", "eval"), ("builtins", "getattr"), ("builtins", "__import__"),
    ("os", "system"), ("posix", "system"), ("subprocess", "getoutput"),
    ("torch", "os.system"),                                    # dotted under an allowed module
    ("torch", "Size.__class__.__subclasses__"),                # dotted under an allowed class
    ("torch.serialization", "load"),                           # a nested unrestricted load
    ("torch.distributed.checkpoint.metadata", "__builtins__"),
])
def test_any_global_outside_the_exact_allow_list_is_refused(tmp_path, module, name):
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    _plant_metadata(path, _command_pickle(module, name, marker))
    _refused(path, marker, "not one of DCP's metadata classes")


class _ReduceChain:
    """``__reduce__`` returning an allowed class whose constructor argument is itself a reduce
    of a forbidden callable: the forbidden global is still looked up, and refused."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        inner = _Call(os.system, f"touch {self.marker}")
        return (torch.Size, (inner,))


class _Call:
    def __init__(self, fn, arg) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


def test_a_reduce_chain_through_an_allowed_class_is_refused(tmp_path):
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    _plant_metadata(path, pickle.dumps(_ReduceChain(marker), protocol=2))
    _refused(path, marker, r"names posix\.system|names os\.system")


def test_a_persistent_reference_in_the_metadata_is_refused(tmp_path):
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    _plant_metadata(path, b"\x80\x04\x8c\x04evil\x94Q.")  # BINPERSID on a string id
    _refused(path, marker, "persistent reference")


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    _plant_metadata(path, pickle.dumps({"state_dict_metadata": {}}))
    _refused(path, marker, "not DCP Metadata")


def _edit_metadata(path: Path, edit) -> None:
    metadata = ckpt.load_metadata(path)
    edit(metadata)
    _plant_metadata(path, pickle.dumps(metadata))


@pytest.mark.parametrize("target", ["../outside.distcp", "/etc/passwd", "rng/rank0.pt", "..",
                                    "does_not_exist.distcp"])
def test_metadata_storage_entries_must_be_files_of_the_checkpoint(tmp_path, target):
    """DCP reads whatever file a storage entry names: a crafted entry could read any file."""
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    (tmp_path / "ck" / "outside.distcp").write_bytes(next(path.glob("*.distcp")).read_bytes())

    def point_elsewhere(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = target

    _edit_metadata(path, point_elsewhere)
    _refused(path, marker, "storage entry")


def test_stream_transforms_in_the_metadata_are_refused(tmp_path):
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"

    def add_transform(metadata):
        next(iter(metadata.storage_data.values())).transform_descriptors = ["zstd"]

    _edit_metadata(path, add_transform)
    _refused(path, marker, "stream transforms")


# -- tensors, non-tensor values and RNG files --------------------------------------------------

class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_nested_pickle_inside_a_tensor_file_is_refused(tmp_path):
    """A ``.distcp`` file holds torch.save records whose own pickles name storages; replacing
    its bytes with a torch.save of an exploit is read with ``weights_only=True`` and refused."""
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    shard = next(path.glob("*.distcp"))
    buffer = io.BytesIO()
    torch.save({"w": _Exploit(marker)}, buffer)
    payload = buffer.getvalue()
    metadata = ckpt.load_metadata(path)
    for info in metadata.storage_data.values():  # every record now points at the exploit
        info.offset, info.length = 0, len(payload)
    shard.write_bytes(payload)
    _plant_metadata(path, pickle.dumps(metadata))
    ckpt.verify(path)  # consistent and well-formed: only the contents are hostile
    with pytest.raises(ckpt.CheckpointError):
        ckpt.load(path, _blank())
    assert not marker.exists()


def test_a_malicious_rng_file_is_refused_by_verify(tmp_path):
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    torch.save({"cpu": _Exploit(marker)}, path / "rng" / "rank0.pt")
    _rehash(path)
    _refused(path, marker, "refusing to load the RNG state")


def test_an_rng_file_that_is_not_an_rng_state_is_refused(tmp_path):
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    torch.save({"cpu": torch.zeros(3)}, path / "rng" / "rank0.pt")  # float, not uint8 state
    _rehash(path)
    _refused(path, marker, "not an RNG state")


def test_resume_falls_back_past_a_malicious_checkpoint_and_names_it(tmp_path):
    root, marker = tmp_path / "ck", tmp_path / "pwned"
    good = _save(root, 1)
    bad = _save(root, 2)
    torch.save({"cpu": _Exploit(marker)}, bad / "rng" / "rank0.pt")
    _rehash(bad)
    found, refused = ckpt.latest_loadable(root)
    assert found == good
    assert len(refused) == 1 and "step_00000002" in refused[0] and "RNG" in refused[0]
    assert not marker.exists()


# -- links and paths ---------------------------------------------------------------------------

def test_a_symlinked_file_is_refused(tmp_path):
    path = _save(tmp_path / "ck", 1)
    secret = tmp_path / "secret.pt"
    torch.save({"cpu": torch.get_rng_state()}, secret)
    (path / "rng" / "rank0.pt").unlink()
    (path / "rng" / "rank0.pt").symlink_to(secret)
    with pytest.raises(ckpt.CheckpointError, match="symbolic link"):
        ckpt.verify(path)


def test_a_symlinked_folder_inside_the_checkpoint_is_refused(tmp_path):
    path = _save(tmp_path / "ck", 1)
    elsewhere = tmp_path / "elsewhere"
    (path / "rng").rename(elsewhere)
    (path / "rng").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ckpt.CheckpointError, match="symbolic link"):
        ckpt.verify(path)


def test_a_symlinked_checkpoint_folder_is_skipped_by_resume(tmp_path):
    root = tmp_path / "ck"
    good = _save(root, 1)
    outside = _save(tmp_path / "other", 5)
    (root / "step_00000009").symlink_to(outside, target_is_directory=True)
    found, refused = ckpt.latest_loadable(root)
    assert found == good and "step_00000009" in refused[0] and "link" in refused[0]


@pytest.mark.parametrize("entry", ["../secret", "/etc/hostname", "rng/../../secret", "./x", ""])
def test_path_traversal_in_manifest_entries_is_refused(tmp_path, entry):
    path = _save(tmp_path / "ck", 1)
    secret = tmp_path / "secret"
    secret.write_text("not yours")
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"][entry] = {"size": 9, "sha256": hashlib.sha256(b"not yours").hexdigest()}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="not a plain relative path"):
        ckpt.verify(path)


@pytest.mark.parametrize("text", ["[]", '{"files": []}', '{"files": {"a": 3}}',
                                  '{"files": {"extra.json": {"size": "1", "sha256": "x"}}}',
                                  "\xff not json"])
def test_a_malformed_manifest_is_refused_by_name(tmp_path, text):
    path = _save(tmp_path / "ck", 1)
    (path / ckpt.MANIFEST).write_text(text, encoding="latin-1")
    with pytest.raises(ckpt.CheckpointError, match="manifest"):
        ckpt.verify(path)


def test_a_malformed_extra_file_is_refused(tmp_path):
    path = _save(tmp_path / "ck", 1)
    (path / ckpt.EXTRA).write_text('{"step": "one"}')
    _rehash(path)
    with pytest.raises(ckpt.CheckpointError, match="no integer step"):
        ckpt.verify(path)


# -- signing -----------------------------------------------------------------------------------

def test_with_a_key_the_manifest_is_signed_and_verifies(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "s3cret")
    path = _save(tmp_path / "ck", 1)
    assert "hmac" in json.loads((path / ckpt.MANIFEST).read_text())
    ckpt.verify(path)
    ckpt.load(path, _blank())


def test_with_a_key_a_rehashed_manifest_is_refused(tmp_path, monkeypatch):
    """The attack every test above uses (rewrite the manifest) fails once runs are signed."""
    monkeypatch.setenv(KEY_ENV, "s3cret")
    path, marker = _save(tmp_path / "ck", 1), tmp_path / "pwned"
    torch.save({"cpu": _Exploit(marker)}, path / "rng" / "rank0.pt")
    _rehash(path)  # keeps the old hmac field, which no longer matches
    with pytest.raises(ckpt.CheckpointError, match="HMAC does not match"):
        ckpt.verify(path)
    assert not marker.exists()


def test_with_a_key_an_unsigned_checkpoint_is_refused(tmp_path, monkeypatch):
    path = _save(tmp_path / "ck", 1)
    monkeypatch.setenv(KEY_ENV, "s3cret")
    with pytest.raises(ckpt.CheckpointError, match="not signed"):
        ckpt.verify(path)


def test_a_checkpoint_signed_with_another_key_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "one key")
    path = _save(tmp_path / "ck", 1)
    monkeypatch.setenv(KEY_ENV, "another key")
    with pytest.raises(ckpt.CheckpointError, match="HMAC does not match"):
        ckpt.verify(path)


def test_the_allow_list_covers_what_dcp_writes(tmp_path):
    """The exact list is not too tight: every global a real DCP metadata pickle names is on it."""
    path = _save(tmp_path / "ck", 1)
    metadata = ckpt.load_metadata(path)
    assert metadata.state_dict_metadata["model.w"].size == torch.Size([4, 4])
