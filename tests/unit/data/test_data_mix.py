"""Specification of ``data.mix``: sources sampled in proportion to their weights, deterministic for
a seed, and resumable at another data-parallel degree like the one-source loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from loom.data.loader import DistributedLoader, PackedSequences, check_source, prepare_data
from loom.data.mix import (
    BLOCK,
    MixedSequences,
    MixSampler,
    block_quotas,
    interleaved_order,
    parse_mix,
)
from loom.errors import ConfigError
from tests.data_fixtures import DataCfg as Cfg, TEXTS, write_source


def test_parse_mix_reads_paths_and_weights():
    entries = parse_mix("a.jsonl:0.7, dir/b:0.3,c:d.txt:2")
    assert [(e.path, e.weight) for e in entries] == [("a.jsonl", 0.7), ("dir/b", 0.3),
                                                    ("c:d.txt", 2.0)]


@pytest.mark.parametrize("spec, words", [
    ("a.jsonl", "is not path:weight"),
    ("a.jsonl:0.5,", "is not path:weight"),
    (":0.5", "is not path:weight"),
    ("a:x", "is not a finite number"),
    ("a:inf", "is not a finite number"),
    ("a:-0.5,b:1", "is negative"),
    ("a:0,b:0", "sum to a positive number"),
    ("a:1,b:0.00001", "below 1/10000"),
    # each finite, the sum not: every share w / inf was 0 and the quotas a tie-break (50/50)
    ("a:1.7e308,b:1e308", "sum past the largest float"),
])
def test_malformed_mixes_are_refused_naming_data_mix(spec, words):
    with pytest.raises(ConfigError, match=words) as err:
        parse_mix(spec)
    assert err.value.field_name == "data.mix"


def test_block_quotas_apportion_the_weights_exactly():
    assert block_quotas([0.7, 0.3]).tolist() == [7000, 3000]
    q = block_quotas([1, 1, 1])
    assert q.sum() == BLOCK and q.tolist() == [3334, 3333, 3333]
    assert block_quotas([5, 0, 5]).tolist() == [5000, 0, 5000]


def test_proportions_follow_the_weights_on_a_long_stream():
    sizes, weights = [50, 200, 7], [0.5, 0.3, 0.2]
    sampler = MixSampler(sizes, weights, global_batch_size=8, seed=3)
    offsets = np.cumsum([0] + sizes)
    for start, count in ((0, 4 * BLOCK), (1234, 25_000)):
        source = np.searchsorted(offsets, sampler.indices(start, count), side="right") - 1
        share = np.bincount(source, minlength=3) / count
        assert np.allclose(share, weights, atol=0.005), share
    # short windows too (the order inside a block is shuffled, not sorted by source)
    source = np.searchsorted(offsets, sampler.indices(0, 400), side="right") - 1
    assert np.allclose(np.bincount(source, minlength=3) / 400, weights, atol=0.08)


def test_each_source_is_drawn_without_replacement_until_exhausted():
    sizes = [50, 200, 7]
    sampler = MixSampler(sizes, [0.5, 0.3, 0.2], 8, seed=3)
    idx = sampler.indices(0, 3000)
    offsets = np.cumsum([0] + sizes)
    for s, n in enumerate(sizes):
        drawn = idx[(idx >= offsets[s]) & (idx < offsets[s + 1])] - offsets[s]
        for epoch in range(len(drawn) // n):
            assert sorted(drawn[epoch * n : (epoch + 1) * n]) == list(range(n))


def test_the_mixture_is_deterministic_for_a_seed():
    a = MixSampler([50, 200], [0.7, 0.3], 8, seed=1).indices(0, 30_000)
    b = MixSampler([50, 200], [0.7, 0.3], 8, seed=1).indices(0, 30_000)
    c = MixSampler([50, 200], [0.7, 0.3], 8, seed=2).indices(0, 30_000)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # stateless: any window equals the same slice of a longer one
    fresh = MixSampler([50, 200], [0.7, 0.3], 8, seed=1)
    assert np.array_equal(fresh.indices(12_345, 100), a[12_345:12_445])


def _mixed(tmp_path: Path) -> MixedSequences:
    parts = []
    for i, n in enumerate((161, 401, 97)):
        path = tmp_path / f"part{i}.bin"
        (np.arange(n, dtype=np.uint16) + 1000 * i).tofile(path)
        parts.append(PackedSequences(path, 8, "uint16"))
    return MixedSequences(parts)


def test_resume_continues_at_the_same_sample_at_another_dp_degree(tmp_path):
    dataset = _mixed(tmp_path)
    sizes, weights, batch = [len(p) for p in dataset.parts], [0.5, 0.2, 0.3], 8

    def loader(rank: int, dp: int) -> DistributedLoader:
        return DistributedLoader(dataset, MixSampler(sizes, weights, batch, seed=7), rank, dp)

    reference = loader(0, 1)
    expected = [reference.next_batch()[0] for _ in range(12)]
    first = [loader(r, 2) for r in range(2)]
    for step in range(5):  # five steps at dp = 2: rank slices concatenate to the batch
        got = torch.cat([lo.next_batch()[0] for lo in first])
        assert torch.equal(got, expected[step])
    state = first[0].state_dict()
    resumed = [loader(r, 4) for r in range(4)]  # resumed at dp = 4
    for lo in resumed:
        lo.load_state_dict(state)
    for step in range(5, 12):
        assert torch.equal(torch.cat([lo.next_batch()[0] for lo in resumed]), expected[step])


def test_validation_interleaves_the_sources_without_repeats():
    order = interleaved_order([300, 0, 100], [0.5, 0.2, 0.5])  # the empty source is left out
    assert len(set(order.tolist())) == len(order)
    first, last = order[order < 300], order[order >= 300]
    assert last.tolist() == list(range(300, 400))  # in order, until the smaller one runs out
    assert first.tolist() == list(range(len(first))) and abs(len(first) - 100) < 30
    assert np.array_equal(order, interleaved_order([300, 0, 100], [0.5, 0.2, 0.5]))
    assert len(interleaved_order([0, 0], [1, 1])) == 0


def test_a_mixed_run_prepares_each_source_and_samples_the_mixture(tmp_path):
    pytest.importorskip("datasets")
    a = write_source(tmp_path / "a.jsonl", "jsonl", TEXTS[:20])
    b = write_source(tmp_path / "b", "text", TEXTS[20:])
    cfg = Cfg(mix=f"{a}:0.75,{b}:0.25,stdlib:0")
    check_source(cfg)
    files = prepare_data(cfg, tmp_path / "run")
    assert files.mixed and [p["source"] for p in files.meta["parts"]] == [str(a), str(b)]
    train = files.train_set(cfg.seq_len)
    sampler = files.sampler(train, 16, seed=0)
    assert isinstance(sampler, MixSampler) and len(train) == sum(len(p) for p in train.parts)
    first = len(train.parts[0])
    share = float(np.mean(sampler.indices(0, 2 * BLOCK) < first))
    assert share == pytest.approx(0.75, abs=1e-9)
    val = files.val_set(cfg.seq_len)
    assert len(val) > 0 and isinstance(val, MixedSequences)
    again = prepare_data(cfg, tmp_path / "run")  # same recipe: reused as it is
    assert again.meta == files.meta


def test_mix_paths_are_checked_before_anything_is_written(tmp_path):
    pytest.importorskip("datasets")
    a = write_source(tmp_path / "a.jsonl", "jsonl", TEXTS[:20])
    with pytest.raises(ConfigError, match="'nowhere' does not exist") as err:
        check_source(Cfg(mix=f"{a}:1,nowhere:1"))
    assert err.value.field_name == "data.mix"
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="empty file") as err:
        check_source(Cfg(mix=f"{a}:1,{tmp_path / 'empty.txt'}:1"))
    assert err.value.field_name == "data.mix"
    with pytest.raises(ConfigError) as err:
        check_source(Cfg(mix=f"{a}:1", text_field="body"))
    assert err.value.field_name == "data.text_field"
