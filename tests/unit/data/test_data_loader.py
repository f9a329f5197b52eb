"""Specification of packing, sampling, dp sharding, resumption and data preparation."""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.config import ConfigError
from loom.data import loader as loader_mod
from loom.data.loader import (
    DataFiles,
    DistributedLoader,
    GlobalBatchSampler,
    PackedSequences,
    eval_batches,
    prepare_data,
)
from tests.data_fixtures import DataCfg


@dataclass
class Cfg(DataCfg):  # the standard library's first 60 kB, 5% held out
    val_fraction: float = 0.05
    max_bytes: int = 60_000


def _token_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "tokens.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    return path


def _loader(dataset, batch, rank=0, dp=1, seed=0) -> DistributedLoader:
    return DistributedLoader(dataset, GlobalBatchSampler(len(dataset), batch, seed), rank, dp)


def test_packing_windows_and_shifted_targets(tmp_path: Path):
    ds = PackedSequences(_token_file(tmp_path, 41), seq_len=8, dtype="uint16")
    assert len(ds) == 5  # (41 - 1) // 8
    x, y = ds[2]
    assert x.dtype == torch.int64 and x.tolist() == list(range(16, 24))
    assert y.tolist() == list(range(17, 25))
    xb, yb = ds.batch([4, 0])
    assert xb.shape == (2, 8) and xb[0].tolist() == list(range(32, 40))
    assert yb[1].tolist() == list(range(1, 9))
    with pytest.raises(IndexError):
        ds[5]


def test_sampler_is_deterministic_per_seed_and_reshuffles_each_epoch():
    a, b, c = GlobalBatchSampler(50, 10, 1), GlobalBatchSampler(50, 10, 1), GlobalBatchSampler(50, 10, 2)
    assert np.array_equal(a.indices(0, 120), b.indices(0, 120))
    assert not np.array_equal(a.indices(0, 50), c.indices(0, 50))
    assert sorted(a.indices(0, 50)) == list(range(50))  # an epoch is a permutation
    assert not np.array_equal(a.indices(0, 50), a.indices(50, 50))


@pytest.mark.parametrize("dp", [2, 4])
def test_rank_slices_concatenate_to_the_one_process_batch(tmp_path: Path, dp: int):
    ds = PackedSequences(_token_file(tmp_path, 8 * 30 + 1), 8, "uint16")
    single = _loader(ds, 8)
    ranks = [_loader(ds, 8, r, dp) for r in range(dp)]
    for _ in range(6):  # crosses an epoch boundary (30 samples)
        x1, y1 = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert all(p[0].shape == (8 // dp, 8) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), x1)
        assert torch.equal(torch.cat([p[1] for p in parts]), y1)


def test_resume_yields_exactly_the_next_batch(tmp_path: Path):
    ds = PackedSequences(_token_file(tmp_path, 8 * 20 + 1), 8, "uint16")
    original = _loader(ds, 4, seed=3)
    for _ in range(7):
        original.next_batch()
    state = original.state_dict()
    assert state == {"consumed_samples": 28, "seed": 3, "global_batch_size": 4, "num_samples": 20}
    resumed = _loader(ds, 4, seed=3)
    resumed.load_state_dict(state)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(original.next_batch(), resumed.next_batch()))


def test_resume_with_another_dp_degree_continues_at_the_same_global_index(tmp_path: Path):
    ds = PackedSequences(_token_file(tmp_path, 8 * 20 + 1), 8, "uint16")
    at_dp4 = [_loader(ds, 8, r, 4) for r in range(4)]
    for _ in range(3):
        for loader in at_dp4:
            loader.next_batch()
    reference = _loader(ds, 8)
    reference.load_state_dict(at_dp4[0].state_dict())
    at_dp2 = [_loader(ds, 8, r, 2) for r in range(2)]
    for loader in at_dp2:
        loader.load_state_dict(at_dp4[3].state_dict())  # every rank saved the same global state
    expected = reference.next_batch()[0]
    assert torch.equal(torch.cat([loader.next_batch()[0] for loader in at_dp2]), expected)
    assert at_dp2[0].consumed_samples == 32


def test_resume_with_another_seed_is_refused(tmp_path: Path):
    ds = PackedSequences(_token_file(tmp_path, 100), 8, "uint16")
    with pytest.raises(ValueError, match="seed"):
        _loader(ds, 2, seed=1).load_state_dict(_loader(ds, 2, seed=0).state_dict())


def test_loader_arguments_are_validated_with_the_rule(tmp_path: Path):
    ds = PackedSequences(_token_file(tmp_path, 100), 8, "uint16")
    with pytest.raises(ValueError, match="not divisible by the data-parallel degree 4"):
        _loader(ds, 6, 0, 4)
    short = PackedSequences(_token_file(tmp_path, 10), 8, "uint16")
    assert len(short) == 1
    too_short = PackedSequences(_token_file(tmp_path, 8), 8, "uint16")
    with pytest.raises(ConfigError, match=r"data.seq_len=8: exceeds the corpus' 8 training tokens"):
        DistributedLoader(too_short, GlobalBatchSampler(1, 1), 0, 1)


def test_eval_batches_are_in_order_and_sharded(tmp_path: Path):
    ds = PackedSequences(_token_file(tmp_path, 8 * 10 + 1), 8, "uint16")
    whole = list(eval_batches(ds, batch_size=4))
    assert len(whole) == 2  # full batches only
    assert torch.equal(torch.cat([x for x, _ in whole]), ds.batch(range(8))[0])
    halves = [list(eval_batches(ds, 4, max_batches=1, dp_rank=r, dp_size=2)) for r in range(2)]
    assert torch.equal(torch.cat([h[0][0] for h in halves]), whole[0][0])
    with pytest.raises(ValueError, match="eval batch_size"):
        eval_batches(ds, 3, dp_size=2)


def test_prepare_data_writes_tokens_and_is_idempotent(tmp_path: Path):
    files = prepare_data(Cfg(), tmp_path)
    meta = files.meta
    assert meta["kind"] == "byte" and meta["dtype"] == "uint16" and meta["seq_len"] == 16
    assert meta["train_docs"] >= 1 and meta["val_docs"] >= 1
    train = np.fromfile(files.train_path, dtype=files.dtype)
    assert len(train) == meta["train_tokens"] and train[-1] == files.eos_id == 256
    assert files.tokenizer().decode(train[:200]).startswith('"""')  # real stdlib text
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    again = prepare_data(Cfg(), tmp_path)
    assert again.meta == meta
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps  # reused, not rewritten
    assert DataFiles.open(tmp_path) == files
    assert sorted(stamps) == ["data_meta.json", "tokenizer_meta.json", "train.bin", "val.bin"]


def test_prepare_data_rebuilds_when_the_recipe_changes(tmp_path: Path):
    prepare_data(Cfg(), tmp_path)
    files = prepare_data(Cfg(tokenizer="bpe", bpe_vocab_size=300), tmp_path)
    assert files.meta["kind"] == "bpe" and (tmp_path / "tokenizer.json").is_file()
    ds = PackedSequences(files.train_path, 16, files.dtype)
    assert int(ds.tokens.max()) < 300


def test_prepare_data_leaves_no_partial_files_on_failure(tmp_path: Path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(loader_mod, "_write_tokens", fail)
    with pytest.raises(RuntimeError):
        prepare_data(Cfg(), tmp_path)
    assert list(tmp_path.iterdir()) == []  # no temp dir, no half-written bins, no meta


def test_prepare_data_from_a_user_directory(tmp_path: Path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.txt").write_text(f"document number {i}\n" * 20)
    files = prepare_data(Cfg(source=str(corpus), max_bytes=0), tmp_path / "run")
    assert files.meta["train_docs"] + files.meta["val_docs"] == 4
    text = files.tokenizer().decode(np.fromfile(files.train_path, dtype=files.dtype))
    assert "document number" in text


def test_prepare_data_rejects_a_seq_len_longer_than_the_corpus(tmp_path: Path):
    (tmp_path / "tiny.txt").write_text("tiny\n")
    with pytest.raises(ConfigError, match="data.seq_len=4096: exceeds"):
        prepare_data(Cfg(source=str(tmp_path / "tiny.txt"), seq_len=4096), tmp_path / "run")
    assert not any((tmp_path / "run").iterdir())  # refused before any file was published


def test_missing_source_names_the_field(tmp_path: Path):
    with pytest.raises(ConfigError, match="data.source"):
        prepare_data(Cfg(source=str(tmp_path / "missing")), tmp_path / "run")
