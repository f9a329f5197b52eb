"""`loom train` and `loom data prepare` with bad data inputs: Hugging Face tokenizers, dataset
sources, prepared directories and ``data.mix``.

The contract of ``test_cli_input_refusals.py``, in process (``loom.cli.main``): exit code 2, one
line on stderr naming the field (or the command's option) and the rule, no traceback, and nothing
written in the working directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loom.cli import EXIT_CONFIG_ERROR, main
from tests.data_fixtures import TEXTS, make_tokenizer, write_source
from tests.e2e.test_cli_config_errors import assert_refused, snapshot

pytest.importorskip("datasets", reason="the data extra: pip install -e '.[data]'")


def _setup(cwd: Path, case: str) -> None:
    write_source(cwd / "docs.jsonl", "jsonl")
    make_tokenizer(cwd / "tok", bos_template=True)
    if case == "tokenizer-no-eos":
        make_tokenizer(cwd / "noeos", eos="<end>")
    if case == "dataset-unreadable":
        (cwd / "bad.jsonl").write_text('{"text": "fine"}\n{not json at all\n')
    if case.startswith("prepared"):
        from loom.data.prepare import prepare

        prepare("docs.jsonl", "tok", cwd / "prep", progress=False)
        if case == "prepared-incomplete":
            with open(cwd / "prep" / "tokens.bin", "r+b") as f:
                f.truncate(100)
        # hand edits that keep every size the manifest records
        if case == "prepared-id-beyond-vocab":
            with open(cwd / "prep" / "tokens.bin", "r+b") as f:
                f.seek(5 * 2)  # uint16: the 6th token
                f.write((65000).to_bytes(2, "little"))
        if case in ("prepared-offset-outside", "prepared-offsets-decrease"):
            offsets = np.fromfile(cwd / "prep" / "doc_index.bin", dtype=np.int64)
            offsets[1] = 10**12 if case == "prepared-offset-outside" else offsets[2] + 1
            offsets.tofile(cwd / "prep" / "doc_index.bin")
    if case == "prepare-out-not-empty":
        (cwd / "out").mkdir()
        (cwd / "out" / "notes.txt").write_text("mine\n")


SMALL = ("--data.seq_len=16", "--model.preset=debug", "--train.steps=1")
TRAIN = {  # name: (argv, substrings of the one stderr line)
    "text-field-missing": (("--data.source=docs.jsonl", "--data.text_field=body"),
                           ("data.text_field='body'", "is not a column of 'docs.jsonl'",
                            "columns: text, id")),
    "text-field-not-text": (("--data.source=docs.jsonl", "--data.text_field=id"),
                            ("data.text_field='id'", "holds int64, not text")),
    "dataset-unreadable": (("--data.source=bad.jsonl",), ("data.source='bad.jsonl'",)),
    "tokenizer-missing": (("--data.tokenizer=nowhere.json",),
                          ("data.tokenizer='nowhere.json'", "must be one of byte, bpe",
                           "no such file")),
    "tokenizer-no-eos": (("--data.tokenizer=noeos",),
                         ("data.tokenizer='noeos'", "no end-of-sequence token")),
    "tokenizer-exceeds-vocab": (("--data.tokenizer=tok", "--model.vocab_size=256"),
                                ("model.vocab_size=256", "must be >= the tok tokenizer's"
                                 " vocabulary")),
    "prepared-tokenizer-mismatch": (("--data.source=prep",),
                                    ("data.tokenizer='byte'", "is not the tokenizer",
                                     "was prepared with", "prep/tokenizer")),
    "prepared-incomplete": (("--data.source=prep", "--data.tokenizer=tok"),
                            ("data.source='prep'", "not a complete `loom data prepare`",
                             "tokens.bin")),
    "prepared-id-beyond-vocab": (("--data.source=prep", "--data.tokenizer=tok"),
                                 ("data.source=", "tokens.bin holds token id 65000 at position 5",
                                  "not below the tokenizer's vocabulary")),
    **{case: (("--data.source=prep", "--data.tokenizer=tok"),
              ("data.source='prep'", "doc_index.bin does not match", "(offsets must increase)"))
       for case in ("prepared-offset-outside", "prepared-offsets-decrease")},
    "mix-unknown-path": (("--data.mix=docs.jsonl:0.7,nowhere.jsonl:0.3",),
                         ("data.mix='docs.jsonl:0.7,nowhere.jsonl:0.3'",
                          "path 'nowhere.jsonl' does not exist")),
    "mix-malformed": (("--data.mix=docs.jsonl",), ("data.mix='docs.jsonl'", "is not path:weight")),
    "mix-not-a-number": (("--data.mix=docs.jsonl:lots",),
                         ("data.mix='docs.jsonl:lots'", "is not a finite number")),
    "mix-negative": (("--data.mix=docs.jsonl:-1,stdlib:2",),
                     ("data.mix=", "weight -1 of 'docs.jsonl' is negative")),
    "mix-zero-sum": (("--data.mix=docs.jsonl:0,stdlib:0",),
                     ("data.mix=", "must sum to a positive number")),
    "mix-entry-unreadable": (("--data.mix=docs.jsonl:1,bad.jsonl:1",),
                             ("data.mix=", "entry 'bad.jsonl'")),
    "mix-entry-text-field": (("--data.mix=docs.jsonl:1,stdlib:1", "--data.text_field=body"),
                             ("data.text_field='body'",)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(TRAIN))
def test_bad_data_is_refused_before_anything_is_written(case, tmp_path, monkeypatch, capsys):
    argv, expected = TRAIN[case]
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, "dataset-unreadable" if case == "mix-entry-unreadable" else case)
    capsys.readouterr()
    before = snapshot(tmp_path)
    code = main(["train", *SMALL, "--train.run_dir=runs/refused", *argv])
    out = capsys.readouterr()
    assert_refused(code, out, expected)
    assert snapshot(tmp_path) == before  # no runs/, no config.toml, no data


PREPARE = {  # name: (argv, substrings of the one stderr line)
    "prepare-source-missing": (("--source", "nowhere", "--tokenizer", "tok"),
                               ("--source='nowhere'", "does not exist")),
    "prepare-text-field": (("--source", "docs.jsonl", "--tokenizer", "tok", "--text-field",
                            "body"), ("--text-field='body'", "is not a column")),
    "prepare-tokenizer-bpe": (("--source", "docs.jsonl", "--tokenizer", "bpe"),
                              ("--tokenizer='bpe'", "trained inside each run")),
    "prepare-tokenizer-missing": (("--source", "docs.jsonl", "--tokenizer", "none.json"),
                                  ("--tokenizer='none.json'", "no such file")),
    "prepare-out-not-empty": (("--source", "docs.jsonl", "--tokenizer", "tok"),
                              ("--out='out'", "exists and is not empty")),
    "prepare-workers": (("--source", "docs.jsonl", "--tokenizer", "tok", "--workers", "0"),
                        ("--workers=0", "must be >= 1")),
    "prepare-out-unwritable": (("--source", "docs.jsonl", "--tokenizer", "tok", "--out",
                                "/proc/loom-prepared"), ("--out='/proc/loom-prepared'",
                                                         "cannot write there")),  # (Linux)
    # forked tokenizers: 100,000 of them exhausted the machine's memory
    "prepare-workers-too-many": (("--source", "docs.jsonl", "--tokenizer", "tok", "--workers",
                                  "100000"), ("--workers=100000", "x this machine's cores")),
    "prepare-already-prepared": (("--source", "prep", "--tokenizer", "tok"),
                                 ("--source='prep'", "already a prepared directory")),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(PREPARE))
def test_bad_prepare_inputs_are_refused_before_anything_is_written(case, tmp_path, monkeypatch,
                                                                    capsys):
    argv, expected = PREPARE[case]
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, "prepared" if case == "prepare-already-prepared" else case)
    capsys.readouterr()
    before = snapshot(tmp_path)
    code = main(["data", "prepare", "--out", "out", "--quiet", *argv])
    out = capsys.readouterr()
    assert_refused(code, out, expected, command='data prepare')
    assert snapshot(tmp_path) == before


def test_prepare_writes_a_directory_that_train_accepts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, "prepare")
    assert main(["data", "prepare", "--source", "docs.jsonl", "--tokenizer", "tok", "--out",
                 "out", "--workers", "2"]) == 0
    out = capsys.readouterr()
    assert f"{len(TEXTS)} documents" in out.out and "tokenizing" in out.err  # the bar: stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "doc_index.bin", "prepared.json", "tokenizer", "tokens.bin"]
    from loom.config import load_config, resolve

    resolve(load_config(None, {"data.source": "out", "data.tokenizer": "out/tokenizer",
                               "data.seq_len": "16", "model.preset": "debug"}), 1)
    # the same again is refused; --overwrite replaces it
    assert main(["data", "prepare", "--source", "docs.jsonl", "--tokenizer", "tok", "--out",
                 "out", "--quiet"]) == EXIT_CONFIG_ERROR
    assert "--overwrite replaces" in capsys.readouterr().err
    assert main(["data", "prepare", "--source", "docs.jsonl", "--tokenizer", "byte", "--out",
                 "out", "--quiet", "--overwrite"]) == 0
    assert '"identity": "byte"' in (tmp_path / "out" / "prepared.json").read_text()
