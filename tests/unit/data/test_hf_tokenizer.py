"""Specification of Hugging Face tokenizers (``data.tokenizer=PATH``): the ``tokenizers`` library's
own ids, and document boundaries (BOS, EOS) as the tokenizer's configuration says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as RustTokenizer

from loom.data.hf_tokenizer import HfTokenizer, load_hf_tokenizer
from loom.data.tokenizer import (
    build_tokenizer,
    encode_documents,
    identity_of,
    load_tokenizer,
    tokenizer_vocab_size,
)
from loom.errors import ConfigError
from tests.data_fixtures import BOS, EOS, TEXTS, make_tokenizer

TEXT = "def f(x):\n    return x  # héllo wörld, 日本語, emoji 🙂\n"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """No template, no config files: GPT-2 style (EOS found in the vocabulary)."""
    return make_tokenizer(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def llama3_like(tmp_path_factory) -> Path:
    """The post-processor adds BOS; no config flags."""
    return make_tokenizer(tmp_path_factory.mktemp("bos"), bos_template=True)


def test_ids_are_the_libraries_own_and_text_round_trips(plain, llama3_like):
    for path in (plain, llama3_like):
        tok = load_hf_tokenizer(path)
        rust = RustTokenizer.from_file(str(path))
        assert tok.encode(TEXT).tolist() == rust.encode(TEXT).ids  # template included
        assert tok.decode(tok.encode(TEXT)) == TEXT
        assert tok.decode(np.append(tok.encode(TEXT), tok.eos_id)) == TEXT  # specials dropped
        assert tok.vocab_size == max(rust.get_vocab(with_added_tokens=True).values()) + 1


def test_a_document_ends_with_one_eos_and_starts_as_the_template_says(plain, llama3_like):
    rust = RustTokenizer.from_file(str(plain))
    eos = rust.token_to_id(EOS)
    [doc] = encode_documents(load_hf_tokenizer(plain), [TEXT])
    assert doc.tolist() == rust.encode(TEXT).ids + [eos]  # no BOS: the template adds none

    rust = RustTokenizer.from_file(str(llama3_like))
    tok = load_hf_tokenizer(llama3_like)
    [doc] = encode_documents(tok, [TEXT])
    assert doc.tolist() == rust.encode(TEXT).ids + [eos]
    assert doc[0] == rust.token_to_id(BOS) == tok.bos_id and doc[-1] == tok.eos_id
    docs = encode_documents(tok, TEXTS[:3])
    assert [d.tolist() for d in docs] == [rust.encode(t).ids + [eos] for t in TEXTS[:3]]


def test_config_flags_win_over_the_template(tmp_path):
    """transformers' Llama tokenizers rebuild the post-processor from add_bos_token /
    add_eos_token; Loom follows the flags the same way."""
    no_bos = make_tokenizer(tmp_path / "a", bos_template=True,
                            config={"add_bos_token": False, "eos_token": EOS})
    tok = load_hf_tokenizer(no_bos)
    body = RustTokenizer.from_file(str(no_bos)).encode(TEXT, add_special_tokens=False).ids
    assert encode_documents(tok, [TEXT])[0].tolist() == body + [tok.eos_id]

    both = make_tokenizer(tmp_path / "b", config={"add_bos_token": True, "add_eos_token": True,
                                                  "bos_token": BOS, "eos_token": EOS})
    tok = load_hf_tokenizer(both)
    doc = encode_documents(tok, [TEXT])[0].tolist()
    assert doc == [tok.bos_id] + body + [tok.eos_id]  # one EOS, not two
    assert tok.encode(TEXT).tolist() == [tok.bos_id] + body  # a prompt: no EOS
    assert identity_of(str(both)) != identity_of(str(no_bos))


def test_a_template_that_ends_with_eos_gets_no_second_one(tmp_path):
    from tokenizers import processors

    path = make_tokenizer(tmp_path)
    rust = RustTokenizer.from_file(str(path))
    eos = rust.token_to_id(EOS)
    rust.post_processor = processors.TemplateProcessing(single=f"$A {EOS}",
                                                        special_tokens=[(EOS, eos)])
    rust.save(str(path))
    [doc] = encode_documents(load_hf_tokenizer(path), [TEXT])
    assert doc.tolist() == rust.encode(TEXT).ids and doc.tolist().count(eos) == 1


def test_the_eos_token_comes_from_the_config_files(tmp_path):
    # tokenizer_config.json (AddedToken form) has the last word over special_tokens_map.json
    path = make_tokenizer(tmp_path / "a", config={"eos_token": {"content": "<pad>"}},
                          special_map={"eos_token": EOS})
    tok = load_hf_tokenizer(path)
    assert tok.eos_id == RustTokenizer.from_file(str(path)).token_to_id("<pad>")
    assert tok.eos_token == "<pad>"
    path = make_tokenizer(tmp_path / "b", special_map={"eos_token": "<pad>"})
    assert load_hf_tokenizer(path).eos_token == "<pad>"


def test_tokenizers_that_cannot_mark_document_ends_are_refused(tmp_path):
    no_eos = make_tokenizer(tmp_path / "a", eos="<end>")  # no known name, no config
    with pytest.raises(ConfigError, match="no end-of-sequence token") as err:
        load_hf_tokenizer(no_eos)
    assert err.value.field_name == "data.tokenizer"
    unknown = make_tokenizer(tmp_path / "b", config={"eos_token": "<|eot|>"})
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        load_hf_tokenizer(unknown)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizers library can read"):
        load_hf_tokenizer(tmp_path / "c")
    with pytest.raises(ConfigError, match="must be one of byte, bpe") as err:
        load_hf_tokenizer(tmp_path / "nowhere")
    assert err.value.field_name == "data.tokenizer"


def test_a_file_or_its_directory_name_the_same_tokenizer(plain):
    assert load_hf_tokenizer(plain).identity == load_hf_tokenizer(plain.parent).identity
    assert isinstance(build_tokenizer(str(plain.parent), 0, []), HfTokenizer)
    assert tokenizer_vocab_size(str(plain), 0) == load_hf_tokenizer(plain).vocab_size


def test_saved_with_its_config_and_loaded_back(tmp_path):
    path = make_tokenizer(tmp_path / "src", config={"add_bos_token": True, "bos_token": BOS,
                                                    "eos_token": EOS})
    tok = load_hf_tokenizer(path)
    tok.save(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "tokenizer_config.json").read_text())["add_bos_token"]
    loaded = load_tokenizer(tmp_path / "run")  # what `loom generate` reads from a run
    assert isinstance(loaded, HfTokenizer) and loaded.kind == "hf"
    assert loaded.identity == tok.identity
    assert (loaded.vocab_size, loaded.eos_id, loaded.bos_id) == (tok.vocab_size, tok.eos_id,
                                                                 tok.bos_id)
    assert loaded.encode(TEXT).tolist() == tok.encode(TEXT).tolist()


def test_vocab_size_zero_rounds_the_tokenizer_up_and_a_small_one_is_refused(plain):
    from loom.config import load_config, resolve

    vocab = load_hf_tokenizer(plain).vocab_size
    config = resolve(load_config(None, {"data.tokenizer": str(plain)}), 1)
    assert config.model.vocab_size == -(-vocab // 64) * 64 >= vocab
    with pytest.raises(ConfigError, match="tokenizer's vocabulary") as err:
        resolve(load_config(None, {"data.tokenizer": str(plain), "model.vocab_size": "256"}), 1)
    assert err.value.field_name == "model.vocab_size"
