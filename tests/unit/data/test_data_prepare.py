"""Specification of ``loom data prepare``: one tokenization into a memory-mapped token file and a
document index, equal to tokenizing on the fly, independent of the worker count, and trained on in
place by a run whose tokenizer matches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loom.data.hf_tokenizer import load_hf_tokenizer
from loom.data.loader import DataFiles, check_source, prepare_data
from loom.data.prepare import (
    INDEX_FILE,
    TOKENIZER_DIR,
    TOKENS_FILE,
    PreparedData,
    _first_id_at_or_above,
    prepare,
    prepared_dtype,
)
from loom.data.sources import PREPARED_MANIFEST, record_val_count
from loom.data.tokenizer import ByteTokenizer, encode_documents
from loom.errors import ConfigError
from tests.data_fixtures import DataCfg as Cfg, TEXTS, make_tokenizer, write_source

pytest.importorskip("datasets", reason="the data extra: pip install -e '.[data]'")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), bos_template=True)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory) -> Path:
    return write_source(tmp_path_factory.mktemp("src") / "docs.jsonl", "jsonl")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, jsonl, tokenizer) -> Path:
    out = tmp_path_factory.mktemp("prep") / "out"
    prepare(str(jsonl), str(tokenizer), out, workers=1, batch_rows=7, progress=False)
    return out


def test_prepared_tokens_and_index_equal_on_the_fly_tokenization(prepared, tokenizer):
    docs = encode_documents(load_hf_tokenizer(tokenizer), TEXTS)
    data = PreparedData.open(prepared)
    tokens, offsets = data.tokens(), data.doc_offsets()
    assert data.dtype == "uint16" and tokens.dtype == np.uint16
    assert np.array_equal(tokens, np.concatenate(docs))
    assert offsets.tolist() == [0, *np.cumsum([len(d) for d in docs]).tolist()]
    tok = load_hf_tokenizer(tokenizer)
    for i, text in enumerate(TEXTS):  # each indexed document is one whole document
        doc = tokens[offsets[i] : offsets[i + 1]]
        assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
        assert tok.decode(doc) == text
    manifest = json.loads((prepared / PREPARED_MANIFEST).read_text())
    assert manifest["tokenizer"]["identity"] == tok.identity
    assert (manifest["num_docs"], manifest["num_tokens"]) == (len(TEXTS), len(tokens))
    assert load_hf_tokenizer(prepared / TOKENIZER_DIR).identity == tok.identity  # a copy


def test_two_workers_write_exactly_what_one_does(prepared, jsonl, tokenizer, tmp_path):
    prepare(str(jsonl), str(tokenizer), tmp_path / "two", workers=2, batch_rows=3,
            progress=False)
    for name in (TOKENS_FILE, INDEX_FILE, PREPARED_MANIFEST):
        assert (tmp_path / "two" / name).read_bytes() == (prepared / name).read_bytes(), name


def test_the_byte_tokenizer_and_a_text_corpus_prepare_too(tmp_path):
    corpus = write_source(tmp_path / "corpus", "text", TEXTS[:5])
    manifest = prepare(str(corpus), "byte", tmp_path / "out", workers=2, progress=False)
    expected = np.concatenate(encode_documents(ByteTokenizer(), TEXTS[:5]))
    assert np.array_equal(PreparedData.open(tmp_path / "out").tokens(), expected)
    assert manifest["tokenizer"]["identity"] == "byte" and manifest["dtype"] == "uint16"
    assert prepared_dtype(2**16) == "uint16" and prepared_dtype(2**16 + 1) == "uint32"


def test_the_token_id_scan_runs_once_per_file_version(tmp_path):
    """The launch checks a prepared source before it starts and again while it prepares the run:
    the second check of the unchanged file reads nothing; a rewritten file (another mtime) is
    scanned again, and its bad id found."""
    corpus = write_source(tmp_path / "corpus", "text", TEXTS[:5])
    prepare(str(corpus), "byte", tmp_path / "out", workers=1, progress=False)
    data = PreparedData.open(tmp_path / "out")
    _first_id_at_or_above.cache_clear()
    data.check_token_ids(300)
    PreparedData.open(tmp_path / "out").check_token_ids(300)  # as the second check opens it
    info = _first_id_at_or_above.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    tokens = np.fromfile(data.tokens_path, dtype=data.dtype)
    tokens[7] = 299
    tokens.tofile(data.tokens_path)
    stat = os.stat(data.tokens_path)
    os.utime(data.tokens_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    with pytest.raises(ConfigError, match="holds token id 299 at position 7"):
        data.check_token_ids(299)
    data.check_token_ids(300)  # the same file, another vocabulary: its own entry
    assert _first_id_at_or_above.cache_info().misses == 3


def test_a_run_trains_on_the_prepared_tokens_in_place(prepared, jsonl, tokenizer, tmp_path):
    """Same split and tokens as the same JSONL tokenized on the fly; nothing is copied."""
    cfg = Cfg(source=str(prepared), tokenizer=str(tokenizer))
    check_source(cfg)
    files = prepare_data(cfg, tmp_path / "run")
    assert not list((tmp_path / "run").glob("*.bin"))  # no copy of the tokens
    fly = prepare_data(Cfg(source=str(jsonl), tokenizer=str(tokenizer)), tmp_path / "fly")
    train, val = files.train_set(cfg.seq_len), files.val_set(cfg.seq_len)
    assert np.array_equal(train.tokens, np.fromfile(fly.train_path, dtype=fly.dtype))
    assert np.array_equal(val.tokens, np.fromfile(fly.val_path, dtype=fly.dtype))
    assert files.meta["val_docs"] == record_val_count(len(TEXTS), cfg.val_fraction)
    assert isinstance(train.tokens, np.memmap)
    reopened = DataFiles.open(tmp_path / "run")  # what each worker does
    assert np.array_equal(reopened.train_set(16).window(3), train.window(3))
    assert reopened.tokenizer().identity == load_hf_tokenizer(tokenizer).identity


def test_a_run_with_another_tokenizer_is_refused(prepared, tmp_path):
    for kind in ("byte", "bpe", str(make_tokenizer(tmp_path / "other", vocab_size=300))):
        with pytest.raises(ConfigError, match="was prepared with") as err:
            check_source(Cfg(source=str(prepared), tokenizer=kind))
        assert err.value.field_name == "data.tokenizer"


def test_an_incomplete_prepared_directory_is_refused(prepared, tokenizer, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(prepared, broken)
    with open(broken / TOKENS_FILE, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ConfigError, match="not a complete") as err:
        check_source(Cfg(source=str(broken), tokenizer=str(tokenizer)))
    assert err.value.field_name == "data.source"


def test_prepare_refuses_before_writing(jsonl, tokenizer, tmp_path):
    cases = [
        (dict(source=str(tmp_path / "nowhere"), tokenizer="byte"), "data.source"),
        (dict(source=str(jsonl), tokenizer="bpe"), "data.tokenizer"),
        (dict(source=str(jsonl), tokenizer=str(tmp_path / "none.json")), "data.tokenizer"),
        (dict(source=str(jsonl), tokenizer="byte", text_field="body"), "data.text_field"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ConfigError) as err:
            prepare(out=tmp_path / "out", progress=False, **kwargs)
        assert err.value.field_name == field
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(ConfigError, match="not empty"):
        prepare(str(jsonl), "byte", tmp_path / "full", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


@pytest.mark.timeout(60)
def test_prepare_finishes_when_its_parent_ignores_sigterm(tmp_path):
    """A finished in-process `loom train` leaves SIGTERM ignored (a late one must not kill the
    exit); forked workers inherit that, and Pool.terminate() stops them with SIGTERM, so they
    must restore the default or prepare never returns (found as a hang in the full suite)."""
    corpus = write_source(tmp_path / "corpus", "text", TEXTS[:5])
    script = (f"import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"from loom.data.prepare import prepare\n"
              f"prepare({str(corpus)!r}, 'byte', {str(tmp_path / 'out')!r}, workers=2,"
              f" progress=False)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=45)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "out" / "tokens.bin").exists()
