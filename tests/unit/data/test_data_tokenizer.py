"""Specification of the tokenizers: byte-level by default, locally trained BPE as an option."""

from pathlib import Path

import numpy as np
import pytest
import torch

from loom.data.corpus import Document, load_documents
from loom.data.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    tokenizer_vocab_size,
)

TEXT = "def f(x):\n    return x  # héllo wörld, 日本語, emoji 🙂\n"


@pytest.fixture(scope="module")
def small_corpus() -> list[Document]:
    return load_documents("stdlib", max_bytes=150_000)


def test_byte_tokenizer_round_trip_including_non_ascii():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 257 and tok.eos_id == 256
    assert list(ids) == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.decode(torch.as_tensor(np.append(ids, tok.eos_id))) == TEXT  # eos dropped


def test_byte_tokenizer_decodes_broken_utf8_with_replacement():
    assert ByteTokenizer().decode([104, 0xFF, 105]) == "h\ufffdi"


def test_bpe_trains_round_trips_and_compresses(small_corpus):
    tok = build_tokenizer("bpe", 512, small_corpus)
    assert isinstance(tok, BpeTokenizer) and tok.vocab_size == 512
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert int(ids.max()) < 512 and tok.eos_id < 512
    code = small_corpus[0].text
    assert len(tok.encode(code)) < 0.6 * len(code.encode())  # merges learned from the corpus


def test_bpe_training_is_deterministic(small_corpus):
    a = build_tokenizer("bpe", 400, small_corpus)
    b = build_tokenizer("bpe", 400, small_corpus)
    text = small_corpus[-1].text
    assert np.array_equal(a.encode(text), b.encode(text))


def test_tokenizers_save_and_load(small_corpus, tmp_path: Path):
    bpe = build_tokenizer("bpe", 300, small_corpus)
    bpe.save(tmp_path / "bpe")
    loaded = load_tokenizer(tmp_path / "bpe")
    assert (loaded.kind, loaded.vocab_size, loaded.eos_id) == ("bpe", 300, bpe.eos_id)
    assert np.array_equal(loaded.encode(TEXT), bpe.encode(TEXT))
    ByteTokenizer().save(tmp_path / "byte")
    assert isinstance(load_tokenizer(tmp_path / "byte"), ByteTokenizer)


def test_vocab_size_is_known_before_training():
    assert tokenizer_vocab_size("byte", 2048) == 257
    assert tokenizer_vocab_size("bpe", 2048) == 2048
    with pytest.raises(ValueError, match="data.bpe_vocab_size"):
        tokenizer_vocab_size("bpe", 100)
    with pytest.raises(ValueError, match="data.tokenizer"):
        tokenizer_vocab_size("wordpiece", 2048)
