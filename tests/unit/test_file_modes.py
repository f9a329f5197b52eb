"""What Loom writes through a temporary name gets the mode an ordinary ``open`` / ``mkdir``
would: 0644 files and 0755 folders under umask 022 (a prepared dataset's folder had been 0700,
and final weights, exported Hugging Face weights and the loss plot 0600, unreadable to a group
sharing the storage)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from loom.files import as_created, current_umask


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_umask_is_read_without_changing_it(umask_022):
    assert current_umask() == 0o022
    os.umask(0o027)
    assert current_umask() == 0o027 and os.umask(0o027) == 0o027


def test_a_temporary_file_and_folder_get_ordinary_modes(tmp_path, umask_022):
    import tempfile

    fd, name = tempfile.mkstemp(dir=tmp_path)
    os.close(fd)
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    assert (_mode(Path(name)), _mode(folder)) == (0o600, 0o700)  # what they are made with
    as_created(name)
    as_created(folder)
    assert (_mode(Path(name)), _mode(folder)) == (0o644, 0o755)


def test_saved_weights_the_loss_plot_and_a_prepared_folder_are_group_readable(tmp_path,
                                                                              umask_022):
    from loom.data.prepare import prepare
    from loom.models.hf import atomic_save_safetensors
    from loom.train.plots import plot_loss_curve

    weights = tmp_path / "model.safetensors"
    atomic_save_safetensors({"w": torch.zeros(2)}, weights)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    plot = plot_loss_curve(metrics, tmp_path / "loss_curve.png")
    text = tmp_path / "corpus.txt"
    text.write_text("def f():\n    return 1\n" * 200)
    prepare(str(text), "byte", tmp_path / "prepared", progress=False, workers=1)
    assert _mode(weights) == 0o644 and _mode(Path(plot)) == 0o644
    assert _mode(tmp_path / "prepared") == 0o755
