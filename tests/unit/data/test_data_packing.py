"""Specification of ``data.packing = "pack"``: document indexes for every source, rows of whole
documents that hold every prediction of every document exactly once and in order, positions
that restart at each document, and refusals that name the field at fault."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from loom.config import Config, ConfigError, load_config, resolve
from loom.config_rules import validate
from loom.data.loader import DistributedLoader, GlobalBatchSampler, eval_batches, prepare_data
from loom.data.mix import MixedSequences
from loom.data.packing import (
    IGNORE_INDEX,
    PAD_DOCUMENT,
    DocumentBatch,
    PackedDocuments,
    check_offsets,
    offsets_from_eos,
    pack_rows,
)
from loom.data.prepare import INDEX_DTYPE, INDEX_FILE, PreparedData, prepare
from loom.data.tokenizer import ByteTokenizer, encode_documents
from loom.models import DocumentMask
from tests.data_fixtures import TEXTS, DataCfg, write_source

EOS = 999
# Token lengths (end-of-document included): a one-token document (nothing to predict), one
# exactly a row long (9 tokens: 8 predictions), one longer than two rows.
LENGTHS = [5, 9, 3, 1, 20, 4, 7, 2, 6]
SEQ = 8


def _documents(lengths=LENGTHS) -> list[np.ndarray]:
    """Distinct token values per document, each ending with ``EOS``."""
    docs, start = [], 0
    for n in lengths:
        docs.append(np.append(np.arange(start, start + n - 1), EOS))
        start += n
    return docs


def _stream(lengths=LENGTHS) -> np.ndarray:
    return np.concatenate(_documents(lengths)).astype(np.uint16)


def _packed(lengths=LENGTHS, seq_len=SEQ) -> PackedDocuments:
    tokens = _stream(lengths)
    return PackedDocuments(tokens, offsets_from_eos(tokens, EOS), seq_len)


def _pieces(rows: DocumentBatch) -> dict[int, list[tuple[list[int], list[int], list[int]]]]:
    """Per document id, its (inputs, targets, positions) pieces in row order."""
    out: dict[int, list] = {}
    for b in range(rows.inputs.shape[0]):
        ids = rows.document_ids[b]
        for doc in dict.fromkeys(ids.tolist()):
            if doc == PAD_DOCUMENT:
                continue
            sel = ids == doc
            out.setdefault(doc, []).append((rows.inputs[b][sel].tolist(),
                                            rows.targets[b][sel].tolist(),
                                            rows.positions[b][sel].tolist()))
    return out


# --------------------------------------------------------------------------------------------
# Rows


def test_every_prediction_of_every_document_appears_exactly_once_in_order():
    ds = _packed()
    rows = ds.batch(range(len(ds)))
    pieces = _pieces(rows)
    docs = _documents()
    assert sorted(pieces) == [d for d, n in enumerate(LENGTHS) if n > 1]  # one token: nothing
    for d, parts in pieces.items():
        assert sum((p[0] for p in parts), []) == docs[d][:-1].tolist()
        assert sum((p[1] for p in parts), []) == docs[d][1:].tolist()
        for inputs, _, positions in parts:  # each piece restarts at 0
            assert positions == list(range(len(inputs)))
    real = rows.document_ids != PAD_DOCUMENT
    assert int(real.sum()) == sum(n - 1 for n in LENGTHS)
    assert (rows.targets[~real] == IGNORE_INDEX).all() and (rows.targets[real] >= 0).all()


def test_documents_stay_whole_when_they_fit_a_row_and_long_ones_fill_and_span_rows():
    layout = pack_rows(LENGTHS, SEQ)
    rows = [list(zip(layout.piece_document[a:b].tolist(), layout.piece_length[a:b].tolist()))
            for a, b in zip(layout.row_start[:-1], layout.row_start[1:])]
    # Predictions: 4, 8, 2, 0, 19, 3, 6, 1, 5. The 8 do not fit beside the 4: a new row. The 19
    # are longer than a row: they fill the 6 left beside the 2, then 8, then 5 beside which the
    # 3 fit; the 6 and the 1 share a row, the 5 do not fit beside them.
    assert rows == [[(0, 4)], [(1, 8)], [(2, 2), (4, 6)], [(4, 8)], [(4, 5), (5, 3)],
                    [(6, 6), (7, 1)], [(8, 5)]]
    assert all(sum(n for _, n in row) <= SEQ for row in rows)


def test_positions_are_the_ones_the_model_derives_from_the_document_ids():
    ds = _packed()
    rows = ds.batch(range(len(ds)))
    assert torch.equal(DocumentMask(rows.document_ids).positions(), rows.positions)


def test_rows_are_a_pure_function_of_the_index():
    a, b = _packed(), _packed()
    order = [5, 0, 3, 3, 6]
    assert all(torch.equal(x, y) for x, y in zip(a.batch(order), b.batch(order)))
    assert all(torch.equal(x, y[0]) for x, y in zip(a[5], a.batch([5])))
    with pytest.raises(IndexError):
        a.row(len(a))


def test_the_loader_carries_packed_rows_and_its_rank_slices_concatenate():
    ds = _packed([30, 17, 12, 40, 9, 25, 3, 18] * 4)
    single = DistributedLoader(ds, GlobalBatchSampler(len(ds), 4, seed=1))
    ranks = [DistributedLoader(ds, GlobalBatchSampler(len(ds), 4, seed=1), r, 2) for r in (0, 1)]
    for _ in range(3):
        whole = single.next_batch()
        parts = [loader.next_batch() for loader in ranks]
        assert isinstance(whole, DocumentBatch) and whole.inputs.shape == (4, SEQ)
        for name in DocumentBatch._fields:
            assert torch.equal(torch.cat([getattr(p, name) for p in parts]),
                               getattr(whole, name))
    batches = list(eval_batches(ds, 2, max_batches=2))
    assert len(batches) == 2 and torch.equal(batches[1].inputs, ds.batch([2, 3]).inputs)


def test_mixed_packed_sources_are_one_index_space():
    a, b = _packed(), _packed([12, 3, 30], seq_len=SEQ)
    mixed = MixedSequences([a, b])
    assert len(mixed) == len(a) + len(b)
    rows = mixed.batch([0, len(a) + 1])
    assert torch.equal(rows.inputs[1], b[1].inputs)
    assert torch.equal(mixed[len(a)].targets, b[0].targets)
    with pytest.raises(ValueError, match="one packing"):
        MixedSequences([a, _concat_like(a)])


def _concat_like(ds: PackedDocuments):
    class Windows:  # a concat sample set of the same seq_len
        seq_len, packing = ds.seq_len, "concat"

        def __len__(self):
            return 1
    return Windows()


# --------------------------------------------------------------------------------------------
# Indexes of every source


def test_run_token_files_get_their_index_from_the_end_of_document_ids(tmp_path: Path):
    corpus = write_source(tmp_path / "corpus", "text", TEXTS[:12])
    files = prepare_data(DataCfg(source=str(corpus), val_fraction=0.2), tmp_path / "run")
    train = files.train_set(16, packing="pack")
    assert isinstance(train, PackedDocuments)
    ends = np.flatnonzero(np.asarray(train.tokens) == files.eos_id) + 1
    assert train.offsets[1:].tolist() == ends.tolist()
    assert train.num_docs == files.meta["train_docs"]
    assert isinstance(files.val_set(16, packing="pack"), PackedDocuments)
    assert type(files.train_set(16)).__name__ == "PackedSequences"  # concat: as before


def test_mixed_sources_pack_each_of_their_token_files(tmp_path: Path):
    a = write_source(tmp_path / "a", "text", TEXTS[:8])
    prepare(str(write_source(tmp_path / "b", "text", TEXTS[8:16])), "byte",
            tmp_path / "b_prepared", progress=False)
    cfg = DataCfg(mix=f"{a}:0.5,{tmp_path / 'b_prepared'}:0.5", val_fraction=0.25)
    files = prepare_data(cfg, tmp_path / "run")
    train = files.train_set(32, packing="pack")
    assert isinstance(train, MixedSequences) and train.packing == "pack"
    assert [p.num_docs for p in train.parts] == [p["train_docs"] for p in files.meta["parts"]]
    rows = files.sampler(train, 4, seed=0)
    batch = train.batch(rows.step_indices(0))
    assert isinstance(batch, DocumentBatch) and batch.inputs.shape == (4, 32)


def test_a_prepared_source_uses_its_doc_index(tmp_path: Path):
    corpus = write_source(tmp_path / "corpus", "text", TEXTS[:10])
    prepare(str(corpus), "byte", tmp_path / "prepared", progress=False)
    files = prepare_data(DataCfg(source=str(tmp_path / "prepared"), val_fraction=0.2),
                         tmp_path / "run")
    train = files.train_set(32, packing="pack")
    lengths = [len(d) for d in encode_documents(ByteTokenizer(), TEXTS[:10])]
    n_train = files.meta["train_docs"]
    assert np.diff(train.offsets).tolist() == lengths[:n_train]
    val = files.val_set(32, packing="pack")
    assert np.diff(val.offsets).tolist() == lengths[n_train:]
    full = PreparedData.open(tmp_path / "prepared").doc_offsets()
    assert val.offsets[-1] == full[-1] - full[n_train]


def test_a_doc_index_that_does_not_match_its_token_file_is_refused(tmp_path: Path):
    corpus = write_source(tmp_path / "corpus", "text", TEXTS[:6])
    prepare(str(corpus), "byte", tmp_path / "prepared", progress=False)
    files = prepare_data(DataCfg(source=str(tmp_path / "prepared"), val_fraction=0.2),
                         tmp_path / "run")
    index = tmp_path / "prepared" / INDEX_FILE
    offsets = np.fromfile(index, dtype=INDEX_DTYPE)
    offsets[-1] += 1  # same size, a total the token file does not have
    offsets.tofile(index)
    with pytest.raises(ConfigError) as info:
        files.train_set(16, packing="pack")
    assert info.value.field_name == "data.source" and "does not match" in str(info.value)
    offsets[-1] -= 1
    offsets[2], offsets[3] = offsets[3], offsets[2]  # a document of negative length
    offsets.tofile(index)
    with pytest.raises(ConfigError, match="offsets must increase"):
        files.train_set(16, packing="pack")


def test_offsets_are_checked_against_the_token_count():
    check_offsets(np.array([0, 3, 7]), 7, "x")
    for bad, words in (([1, 7], "not 0"), ([0, 3, 6], "end at 6"), ([0, 3, 3, 7], "increase")):
        with pytest.raises(ConfigError, match=words):
            check_offsets(np.array(bad), 7, "x")


def test_a_stream_without_a_final_end_of_document_keeps_its_tail():
    assert offsets_from_eos(np.array([1, EOS, 2, 3]), EOS).tolist() == [0, 2, 4]
    assert offsets_from_eos(np.array([1, EOS]), EOS).tolist() == [0, 2]


# --------------------------------------------------------------------------------------------
# The config field


def test_an_unknown_packing_is_refused_by_name():
    with pytest.raises(ConfigError) as info:
        load_config(None, {"data.packing": "packed"})
    assert info.value.field_name == "data.packing" and "concat, pack" in str(info.value)
    config = resolve(load_config(None, {"model.preset": "debug"}), 1)
    config.data = dataclasses.replace(config.data, packing="ragged")  # built in code
    with pytest.raises(ConfigError, match="must be one of concat, pack") as info:
        validate(config, 1)
    assert info.value.field_name == "data.packing"


@pytest.mark.parametrize("overrides, world, words", [
    ({"parallel.pp": "4", "fault.recovery": "checkfree_plus"}, 4,
     "checkfree_plus runs concatenated rows only"),
])
def test_pack_refuses_what_does_not_carry_it_yet(overrides, world, words):
    with pytest.raises(ConfigError, match=words) as info:
        resolve(load_config(None, {"data.packing": "pack", "model.preset": "debug",
                                   **overrides}), world)
    assert info.value.field_name == "data.packing"


def test_pack_is_accepted_where_the_trainer_carries_it():
    config = resolve(load_config(None, {"data.packing": "pack", "model.preset": "debug",
                                        "parallel.pp": "2", "parallel.tp": "2",
                                        "parallel.vocab_parallel": "false"}), 4)
    assert config.data.packing == "pack"


@pytest.mark.parametrize("overrides, world", [  # tests/dist/test_documents_axes.py runs them
    ({"train.recompute": "selective"}, 1),
    ({"parallel.tp": "2", "parallel.sequence_parallel": "true"}, 2),
    ({"parallel.pp": "2", "parallel.tp": "2", "parallel.sequence_parallel": "true"}, 4),
    ({"model.preset": "tiny-moe"}, 1),
    ({"model.preset": "tiny-moe", "parallel.ep": "2", "parallel.dp_replicate": "1"}, 2),
    ({"model.preset": "tiny-moe", "parallel.cp": "2"}, 2),
    ({"parallel.pp": "2", "parallel.vocab_parallel_pp": "true"}, 2),
])
def test_pack_runs_on_tp_sp_moe_cp_vocab_pp_and_selective_recompute(overrides, world):
    config = resolve(load_config(None, {"data.packing": "pack", "model.preset": "debug",
                                        **overrides}), world)
    assert config.data.packing == "pack"


def test_concat_stays_the_default():
    assert Config().data.packing == "concat"
