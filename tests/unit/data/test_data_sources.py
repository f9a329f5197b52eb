"""Specification of dataset sources: JSON lines, Parquet, Arrow and ``save_to_disk`` directories
read with ``datasets``, giving the same documents (and tokens) as the same texts as text files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loom.data.loader import check_source, prepare_data
from loom.data.sources import (
    RECORDS,
    SAVED,
    TEXT,
    check_text_field,
    iter_texts,
    read_source_documents,
    record_val_count,
    resolve_source,
    split_records,
)
from loom.errors import ConfigError
from tests.data_fixtures import DataCfg as Cfg, TEXTS, make_tokenizer, write_source

pytest.importorskip("datasets", reason="the data extra: pip install -e '.[data]'")

KINDS = ("jsonl", "parquet", "arrow", "saved")
SUFFIX = {"jsonl": ".jsonl", "parquet": ".parquet", "arrow": ".arrow", "saved": "", "text": ""}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    return {kind: write_source(root / f"{kind}{SUFFIX[kind]}", kind) for kind in KINDS + ("text",)}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"), bos_template=True)


def test_every_format_reads_the_same_documents_in_order(sources):
    expected = {"jsonl": (RECORDS, "json"), "parquet": (RECORDS, "parquet"),
                "arrow": (RECORDS, "arrow"), "saved": (SAVED, None), "text": (TEXT, None)}
    for kind, path in sources.items():
        src = resolve_source(str(path))
        assert (src.kind, src.builder) == expected[kind], kind
        assert [d.text for d in read_source_documents(src)] == TEXTS, kind


def test_a_directory_of_shards_is_read_in_sorted_order(tmp_path):
    (tmp_path / "shards").mkdir()
    write_source(tmp_path / "shards" / "b.jsonl", "jsonl", TEXTS[20:])
    write_source(tmp_path / "shards" / "a.jsonl", "jsonl", TEXTS[:20])
    src = resolve_source(str(tmp_path / "shards"))
    assert src.kind == RECORDS and [f.name for f in src.files] == ["a.jsonl", "b.jsonl"]
    assert [d.text for d in read_source_documents(src)] == TEXTS
    write_source(tmp_path / "shards" / "c.parquet", "parquet", TEXTS[:2])
    with pytest.raises(ConfigError, match="mixes record formats"):
        resolve_source(str(tmp_path / "shards"))


def test_a_datasetdict_reads_its_train_split(tmp_path):
    import datasets

    train = datasets.Dataset.from_dict({"text": TEXTS[:5]})
    test = datasets.Dataset.from_dict({"text": TEXTS[5:7]})
    datasets.DatasetDict({"test": test, "train": train}).save_to_disk(str(tmp_path / "dd"))
    src = resolve_source(str(tmp_path / "dd"))
    assert [d.text for d in read_source_documents(src)] == TEXTS[:5]


def test_the_text_field_names_the_column_and_must_hold_text(sources, tmp_path):
    for kind in KINDS:
        src = resolve_source(str(sources[kind]))
        check_text_field(src, "text")
        with pytest.raises(ConfigError, match="is not a column") as err:
            check_text_field(src, "body")
        assert err.value.field_name == "data.text_field" and "columns: text, id" in str(err.value)
        with pytest.raises(ConfigError, match="holds int64, not text"):
            check_text_field(src, "id")
    renamed = write_source(tmp_path / "body.jsonl", "jsonl", TEXTS[:3], field="body")
    src = resolve_source(str(renamed))
    assert [d.text for d in read_source_documents(src, text_field="body")] == TEXTS[:3]


def test_empty_rows_are_skipped_and_max_bytes_keeps_leading_documents(tmp_path):
    path = write_source(tmp_path / "d.jsonl", "jsonl", ["", TEXTS[0], "", TEXTS[1], TEXTS[2]])
    src = resolve_source(str(path))
    assert [d.text for d in read_source_documents(src)] == TEXTS[:3]
    two = len(TEXTS[0].encode()) + len(TEXTS[1].encode())
    assert [t for b in iter_texts(src, max_bytes=two) for t in b] == TEXTS[:2]
    assert [t for b in iter_texts(src, max_bytes=1) for t in b] == TEXTS[:1]  # at least one


def test_records_split_by_position_last_documents_validate():
    assert [record_val_count(n, 0.1) for n in (0, 1, 2, 10, 40, 100)] == [0, 0, 1, 1, 4, 10]
    assert record_val_count(3, 0.9) == 2  # at least one for training
    docs = read_source_documents(resolve_source("stdlib"), max_bytes=20_000)
    train, val = split_records(docs, 0.25)
    assert train + val == docs and len(val) == round(len(docs) * 0.25)


def test_a_run_on_any_format_gets_the_same_tokens_as_on_text_files(sources, tokenizer, tmp_path):
    """The run's train.bin + val.bin of a record source are the source's documents tokenized
    in order, whatever the format; the same as tokenizing the texts from text files."""
    from loom.data.hf_tokenizer import load_hf_tokenizer
    from loom.data.prepare import prepare
    from loom.data.tokenizer import encode_documents

    expected = np.concatenate(encode_documents(load_hf_tokenizer(tokenizer), TEXTS))
    prepare(str(sources["text"]), str(tokenizer), tmp_path / "text", progress=False)
    from_text = np.fromfile(tmp_path / "text" / "tokens.bin", dtype=np.uint16)
    assert np.array_equal(from_text, expected)
    streams = {}
    for kind in KINDS:
        cfg = Cfg(source=str(sources[kind]), tokenizer=str(tokenizer))
        check_source(cfg)
        files = prepare_data(cfg, tmp_path / kind)
        train = np.fromfile(files.train_path, dtype=files.dtype)
        val = np.fromfile(files.val_path, dtype=files.dtype)
        assert files.meta["val_docs"] == record_val_count(len(TEXTS), 0.1)
        streams[kind] = np.concatenate([train, val])
        assert np.array_equal(streams[kind], expected), kind


def test_importing_loom_data_does_not_import_datasets():
    code = "import sys, loom.data; assert 'datasets' not in sys.modules, 'datasets imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_record_nested_past_the_json_limit_is_refused_not_a_crash(tmp_path):
    """pyarrow's JSON reader recurses on the C stack: a record nested 10^5 deep killed the
    process (segfault). It is refused naming the file and line before pyarrow sees it; brackets
    inside strings (a code corpus is full of them) are not nesting. In a subprocess, so that a
    crash fails this test and not the run."""
    deep = '{"text": "b", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    brackets = '{"text": "' + "[{" * 5_000 + '"}'
    (tmp_path / "deep.jsonl").write_text(f'{{"text": "a"}}\n{brackets}\n{deep}\n')
    (tmp_path / "fine.jsonl").write_text(f'{{"text": "a"}}\n{brackets}\n')
    script = ("import sys; from loom.data.sources import check_text_field, resolve_source\n"
              "from loom.errors import ConfigError\n"
              "try:\n    check_text_field(resolve_source(sys.argv[1]), 'text')\n"
              "except ConfigError as err:\n    print(err)\n    sys.exit(2)\n")
    runs = {name: subprocess.run([sys.executable, "-c", script, str(tmp_path / name)],
                                 capture_output=True, text=True, timeout=120)
            for name in ("deep.jsonl", "fine.jsonl")}
    assert runs["fine.jsonl"].returncode == 0, runs["fine.jsonl"].stderr
    refused = runs["deep.jsonl"]
    assert refused.returncode == 2, (refused.returncode, refused.stderr[-500:])
    assert "data.source" in refused.stdout and "deep.jsonl line 3 nests deeper than 1000" in \
        refused.stdout, refused.stdout
