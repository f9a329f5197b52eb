"""Checkpoints: committed last, verified on load, pruned, and never unpickling code."""

import hashlib
import json
import os
import pickle

import pytest
import torch

from loom.train import checkpoint as ckpt

torch.set_num_threads(1)


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def _tensors(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _save(root, step, seed=0, keep=0):
    model, opt = _model_and_optimizer(seed)
    return ckpt.save(root, step, _tensors(model, opt), {"step": step, "note": "x"}, keep=keep), model


def test_round_trip_restores_weights_optimizer_and_extra_bit_exactly(tmp_path):
    path, model = _save(tmp_path, 5, seed=0)
    other, other_opt = _model_and_optimizer(seed=1)
    tensors = _tensors(other, other_opt)
    extra = ckpt.load(path, tensors)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(other, other_opt, model_state_dict=tensors["model"],
                   optim_state_dict=tensors["optim"])
    assert extra == {"step": 5, "note": "x"}
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)


def test_only_committed_checkpoints_count_and_keep_prunes_the_oldest(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep=2)
    (tmp_path / "step_00000004.partial").mkdir()  # a save that crashed midway
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_00000002",
                                                                    "step_00000003"]


def test_a_checkpoint_without_its_marker_is_refused(tmp_path):
    path, _ = _save(tmp_path, 1)
    (path / ckpt.COMMIT_MARKER).unlink()
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.verify(path)


def test_a_checkpoint_moved_to_another_steps_folder_is_refused_and_the_older_one_is_used(tmp_path):
    """The folder's name is not hashed: step_00000002 renamed to step_00000009 (its files
    intact) would resume at step 2 while ``auto`` took it for the newest. A folder named with
    a digit Python's ``int`` refuses ("²") is no checkpoint, where sorting had raised."""
    _save(tmp_path, 1)
    path, _ = _save(tmp_path, 2)
    path.rename(tmp_path / "step_00000009")
    with pytest.raises(ckpt.CheckpointError, match="says step 2, the folder's name 9"):
        ckpt.verify(tmp_path / "step_00000009")
    (tmp_path / "step_²").mkdir()
    (tmp_path / "step_²" / ckpt.COMMIT_MARKER).write_text("")
    found, refused = ckpt.latest_loadable(tmp_path)
    assert found.name == "step_00000001" and len(refused) == 1


def test_a_step_beyond_int64_is_refused(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = ckpt.save(tmp_path / "ckpt", 10**30, _tensors(model, opt), {"step": 10**30})
    with pytest.raises(ckpt.CheckpointError, match=r"no integer step in \[0, 2\^62\)"):
        ckpt.verify(path)


def _a_tensor_file(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


def test_corrupted_and_truncated_files_are_refused_and_the_previous_one_is_used(tmp_path):
    _save(tmp_path, 1)
    newest, _ = _save(tmp_path, 2)
    data = _a_tensor_file(newest)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="corrupted"):
        ckpt.verify(newest)
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(ckpt.CheckpointError, match="truncated"):
        ckpt.verify(newest)
    chosen, refused = ckpt.latest_loadable(tmp_path)
    assert chosen.name == "step_00000001"
    assert len(refused) == 1 and "step_00000002" in refused[0]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_metadata_that_would_execute_code_is_refused_even_with_a_matching_manifest(tmp_path):
    path, _ = _save(tmp_path, 1)
    metadata = path / ".metadata"
    metadata.write_bytes(pickle.dumps(_Exploit()))
    manifest = json.loads((path / ckpt.MANIFEST).read_text())  # an attacker rewrites it too
    manifest["files"][".metadata"] = {"size": metadata.stat().st_size,
                                      "sha256": hashlib.sha256(metadata.read_bytes()).hexdigest()}
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError, match="could execute code"):
        ckpt.verify(path)


class _MakeDir:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_non_tensor_value_that_would_execute_code_is_refused(tmp_path):
    """DCP stores non-tensor values (hyper-parameters) as pickles and its own loader unpickles
    them with weights_only=False; Loom's loader refuses anything but plain data."""
    victim = tmp_path / "pwned"
    path = ckpt.save(tmp_path / "ck", 1, {"optim": {"param_groups.w.lr": _MakeDir(victim)}},
                     {"step": 1})
    ckpt.verify(path)  # a consistent checkpoint: only its contents are hostile
    with pytest.raises(ckpt.CheckpointError, match="could execute code"):
        ckpt.load(path, {"optim": {"param_groups.w.lr": 0.0}})
    assert not victim.exists()


def test_plain_non_tensor_values_load(tmp_path):
    values = {"lr": 0.5, "betas": (0.9, 0.95), "amsgrad": False, "fused": None, "n": 3}
    path = ckpt.save(tmp_path, 1, {"optim": dict(values)}, {"step": 1})
    loaded = {"optim": {k: None for k in values}}
    ckpt.load(path, loaded)
    assert loaded["optim"] == values


def test_the_rng_state_is_restored(tmp_path):
    torch.manual_seed(123)
    path, model = _save(tmp_path, 1)
    expected = torch.rand(4)  # what the saved state draws next
    torch.manual_seed(999)
    other, opt = _model_and_optimizer(seed=2)
    ckpt.load(path, _tensors(other, opt))
    assert torch.equal(torch.rand(4), expected)
