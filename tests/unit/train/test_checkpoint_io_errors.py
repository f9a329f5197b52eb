"""A save that cannot be written (full disk, read-only filesystem) says where, why and how many
bytes it needed against those free, in one line, and leaves the previous checkpoint intact.

The filesystems are small tmpfs mounts, so these tests need root (they skip otherwise)."""

import subprocess
from pathlib import Path

import pytest
import torch

from loom.train import checkpoint as ckpt

torch.set_num_threads(1)


@pytest.fixture
def small_fs(tmp_path):
    """A 256 KiB tmpfs, remountable read-only; unmounted afterwards."""
    mount = tmp_path / "fs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _tensors(n: int) -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(n)}}


def test_a_full_disk_names_the_path_and_the_bytes_and_keeps_the_previous_checkpoint(small_fs):
    root = small_fs / "checkpoints"
    first = ckpt.save(root, 1, _tensors(1000), {"step": 1})  # 4 kB: fits
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.save(root, 2, _tensors(200_000), {"step": 2})  # 800 kB: does not
    message = str(refused.value)
    assert "\n" not in message
    assert "step_00000002.partial" in message and "free on that filesystem" in message and "781.2 KiB" in message
    assert "unexpected pos" not in message or "disk is probably full" in message
    ckpt.verify(first)  # untouched
    assert ckpt.complete_checkpoints(root) == [first]
    assert not (root / "step_00000002.partial").exists()  # cleaned up, space given back


def test_a_read_only_filesystem_is_named(small_fs):
    root = small_fs / "checkpoints"
    first = ckpt.save(root, 1, _tensors(100), {"step": 1})
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(ckpt.CheckpointError, match="Read-only file system") as refused:
        ckpt.save(root, 2, _tensors(100), {"step": 2})
    assert str(Path(root)) in str(refused.value)
    ckpt.verify(first)
