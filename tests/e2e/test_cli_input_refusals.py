"""`loom train` with bad inputs beyond the config's own values: the corpus, the config file, the
run directory, the checkpoint to resume, the host's memory and a schedule without a pipeline.

The contract of ``test_cli_config_errors.py``, in process (``loom.cli.main``, no interpreter
start per case): exit code 2, one line on stderr naming the field and the rule, no traceback, and
nothing written: the working directory is as it was (no ``runs/``, no ``config.toml``, no data).
A FIFO is never opened (reading one would block: the timeout catches that).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from loom.cli import EXIT_CONFIG_ERROR, main
from tests.e2e.test_cli_config_errors import assert_refused, snapshot

RUN = "runs/refused"


def _setup(cwd: Path, case: str) -> None:
    """The files of ``case`` in the working directory ``cwd``."""
    if case in ("empty-dir", "fifo-in-dir", "no-matching-files"):
        (cwd / "corpus").mkdir()
    if case == "fifo-in-dir":
        os.mkfifo(cwd / "corpus" / "pipe.txt")  # matches the extensions, is no regular file
    if case == "no-matching-files":
        (cwd / "corpus" / "weights.bin").write_bytes(b"data")
    if case == "fifo":
        os.mkfifo(cwd / "corpus.txt")
    if case == "empty-file":
        (cwd / "corpus.txt").write_bytes(b"")
    if case == "binary-file":
        (cwd / "corpus.txt").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" * 64)
    if case == "too-short":
        (cwd / "corpus.txt").write_text("def f():\n    return 1\n")
    if case == "short-once-tokenized":
        # 4000 bytes, so the byte bound passes; BPE merges the run into a few dozen tokens
        (cwd / "corpus.txt").write_text("a" * 4000)
    if case == "config-not-utf8":
        (cwd / "loom.toml").write_bytes(b"[train]\nrun_dir = \"caf\xe9\"\n")  # Latin-1
    if case == "config-dir":
        (cwd / "loom.toml").mkdir()
    if case in ("run-dir-is-file", "run-dir-under-file"):
        (cwd / "afile").write_text("not a directory\n")
    if case == "run-dir-config-is-dir":
        (cwd / RUN / "config.toml").mkdir(parents=True)
    if case.startswith("resume"):
        ckpt = cwd / "ckpt"
        ckpt.mkdir()
        (ckpt / "COMMITTED").write_text("")
        if case == "resume-bad-manifest":
            (ckpt / "manifest.json").write_text("{not json")
        if case == "resume-manifest-without-files":
            (ckpt / "manifest.json").write_text(json.dumps({"step": 3}))
    if case in ("auto-all-corrupt", "resume-dir-corrupt"):  # two real checkpoints, both damaged
        from loom.train import checkpoint

        for step in (1, 2):
            saved = checkpoint.save(cwd / RUN / "checkpoints", step,
                                    {"model": {"w": torch.ones(8) * step}}, {"step": step})
            (saved / "extra.json").write_text('{"step": 7}')  # no longer its manifest's hash
    if case.startswith(("shape-", "state-")):  # a valid checkpoint that cannot continue here
        from loom.train import checkpoint

        weights = {"shape-other": {"tok_embeddings.weight": torch.zeros(3, 3)},
                   "shape-missing": {"w": torch.ones(8)}}.get(case, {"w": torch.ones(8)})
        extra = {"step": 1, "data": {"seed": 1234, "consumed_samples": 16,
                                     "global_batch_size": 16, "num_samples": 1000},
                 "scheduler": {"last_epoch": 1, "_step_count": 2, "base_lrs": [0.003],
                               "_last_lr": [0.0003], "lr_lambdas": [None]}}
        for path, value in STATE_EDITS.get(case, {}).items():  # hand edits, hashed by save
            table, key = path.split(".")
            if value is _DELETE:
                del extra[table][key]
            else:
                extra[table] = value if key == "*" else {**extra[table], key: value}
        checkpoint.save(cwd / "saved", 1, {"model": weights}, extra)
    if case == "auto-nothing-saved":
        (cwd / RUN / "checkpoints").mkdir(parents=True)


_DELETE = object()
STATE_EDITS = {  # extra.json edits that save still writes and hashes, so the files verify
    "state-negative-samples": {"data.consumed_samples": -1},
    "state-huge-samples": {"data.consumed_samples": 10**30},
    "state-text-samples": {"data.consumed_samples": "abc"},
    "state-no-data": {"data.*": None},
    "state-no-seed": {"data.seed": _DELETE},
    "state-text-epoch": {"scheduler.last_epoch": "x"},
    "state-nan-rate": {"scheduler.base_lrs": [float("nan")]},
}
SMALL = ("--data.seq_len=64", "--model.preset=debug", "--train.steps=1")
CASES = {  # name: (argv, substrings of the one stderr line)
    # the corpus (data.source)
    "empty-dir": (("--data.source=corpus",), ("data.source='corpus'", "no non-empty files")),
    "no-matching-files": (("--data.source=corpus",),
                          ("data.source='corpus'", "check data.source and data.extensions")),
    "fifo": (("--data.source=corpus.txt",),
             ("data.source='corpus.txt'", "is not a regular file or a directory")),
    "fifo-in-dir": (("--data.source=corpus",), ("data.source='corpus'", "no non-empty files")),
    "empty-file": (("--data.source=corpus.txt",), ("data.source='corpus.txt'", "empty file")),
    "missing-source": (("--data.source=nowhere",), ("data.source='nowhere'", "does not exist")),
    "binary-file": (("--data.source=corpus.txt",),
                    ("data.source='corpus.txt'", "no readable text file", "binary")),
    "too-short": (("--data.source=corpus.txt", "--data.seq_len=256"),
                  ("data.seq_len=256", "exceeds the corpus' at most", "training tokens")),
    "short-once-tokenized": (("--data.source=corpus.txt", "--data.tokenizer=bpe",
                              "--data.bpe_vocab_size=300", "--data.seq_len=200",
                              f"--train.run_dir={RUN}"),
                             ("data.seq_len=200", "exceeds the corpus'", "training tokens")),
    # the config file (--config)
    "config-not-utf8": (("--config", "loom.toml"), ("--config='loom.toml'", "is not UTF-8")),
    "config-dir": (("--config", "loom.toml"), ("--config='loom.toml'", "is a directory")),
    "config-missing": (("--config", "loom.toml"), ("--config='loom.toml'", "does not exist")),
    # the run directory (train.run_dir)
    "run-dir-is-file": (("--train.run_dir=afile",),
                        ("train.run_dir='afile'", "is not a directory")),
    "run-dir-under-file": (("--train.run_dir=afile/run",),
                           ("train.run_dir='afile/run'", "lies under 'afile'")),
    "run-dir-not-writable": (("--train.run_dir=/proc/self/loom-run",),
                             ("train.run_dir='/proc/self/loom-run'", "is not writable")),
    # as root /proc passes the access checks (a writable mode, not a read-only mount) and still
    # refuses the mkdir: caught at that first write ("cannot be created"; otherwise refused as
    # not writable, before it)
    "run-dir-under-proc": (("--train.run_dir=/proc/loom-run",),
                           ("train.run_dir='/proc/loom-run'",)),
    "run-dir-config-is-dir": ((f"--train.run_dir={RUN}",),
                              (f"train.run_dir='{RUN}'",
                               "holds 'config.toml', which is a directory")),
    # the checkpoint to resume (--resume = checkpoint.resume)
    "resume-without-manifest": (("--resume", "ckpt"),
                                ("checkpoint.resume='ckpt'", "no manifest.json")),
    "resume-bad-manifest": (("--resume", "ckpt"),
                            ("checkpoint.resume='ckpt'", "manifest.json is unreadable")),
    "resume-manifest-without-files": (("--resume", "ckpt"),
                                      ("checkpoint.resume='ckpt'", 'no "files" table')),
    "resume-dir-corrupt": (("--resume", f"{RUN}/checkpoints/step_00000002"),
                           ("checkpoint.resume=", "extra.json: truncated or altered")),
    # --resume auto with checkpoints that all fail verification: never a silent fresh start
    "auto-all-corrupt": (("--resume", "auto", f"--train.run_dir={RUN}"),
                         ("checkpoint.resume=auto: no complete and valid checkpoint",
                          "step_00000002/extra.json: truncated",
                          "step_00000001/extra.json: truncated", "--resume auto_or_fresh")),
    # ... and one that verifies but holds another model (the workers' load would refuse it)
    "shape-other": (("--resume", "saved/step_00000001"),
                    ("checkpoint.resume=saved/step_00000001", "tok_embeddings.weight is [3, 3]",
                     "another model shape")),
    "shape-missing": (("--resume", "saved/step_00000001"),
                      ("checkpoint.resume=saved/step_00000001", "holds no weight",
                       "another model shape")),
    # ... or whose training state (the data position, the LR schedule) is not one save writes
    **{case: (("--resume", "saved/step_00000001"),
              ("checkpoint.resume=saved/step_00000001", "extra.json: ", rule))
       for case, rule in (("state-negative-samples", "data.consumed_samples = -1 is not"),
                          ("state-huge-samples", "data.consumed_samples = 10000"),
                          ("state-text-samples", "data.consumed_samples = 'abc' is not"),
                          ("state-no-data", "no data table"),
                          ("state-no-seed", "data.seed = None is not"),
                          ("state-text-epoch", "scheduler.last_epoch = 'x' is not"),
                          ("state-nan-rate", "scheduler.base_lrs is not a list of finite"))},
    # ... or whose data order is another seed's (the loader refused it in every worker)
    "state-other-seed": (("--resume", "saved/step_00000001", "--train.seed=7"),
                         ("checkpoint.resume=saved/step_00000001",
                          "saved with train.seed = 1234, this run has 7")),
    "auto-nothing-saved": (("--resume", "auto", f"--train.run_dir={RUN}"),
                           ("checkpoint.resume=auto: no complete and valid checkpoint",
                            "--resume auto_or_fresh")),
    # the host's memory (a model far beyond any host's RAM, estimated, never built)
    "memory": (("--train.device=cpu", "--model.dim=16384", "--model.n_heads=128",
                "--model.n_kv_heads=128", "--model.n_layers=256"),
               ("train.skip_memory_check=False", "estimated peak memory",
                "of the host's", "--train.skip_memory_check=true")),
    # ... skipped on request: the next check speaks (the run directory here)
    "memory-skipped": (("--train.device=cpu", "--model.dim=16384", "--model.n_heads=128",
                        "--model.n_kv_heads=128", "--model.n_layers=256",
                        "--train.skip_memory_check=true", "--train.run_dir=afile"),
                       ("train.run_dir='afile'",)),
    # a pipeline schedule without a pipeline
    "schedule-without-pp": (("--parallel.schedule=zbv",),
                            ("parallel.schedule='zbv'", "needs parallel.pp > 1")),
    "chunks-without-pp": (("--parallel.chunks=2",), ("parallel.chunks=2", "needs parallel.pp > 1")),
}


@pytest.mark.timeout(120)  # a FIFO opened for reading would block here
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_refused_before_anything_is_written(case, tmp_path, monkeypatch, capsys):
    argv, expected = CASES[case]
    if case == "memory-skipped":
        _setup(tmp_path, "run-dir-is-file")
    monkeypatch.chdir(tmp_path)
    _setup(tmp_path, case)
    capsys.readouterr()  # what making the case printed
    before = snapshot(tmp_path)
    code = main(["train", *SMALL, *argv])
    out = capsys.readouterr()
    assert_refused(code, out, expected)
    if case == "short-once-tokenized":  # found by tokenizing (prepare_run_dir), then cleaned up
        assert "at most" not in out.err
    assert snapshot(tmp_path) == before  # no runs/, no config.toml, no data


def test_a_corpus_short_once_tokenized_leaves_an_existing_run_dir_as_it_was(tmp_path, monkeypatch,
                                                                            capsys):
    """The run directory exists (a first attempt, say): the refusal removes the ``data/`` it made
    and writes no ``config.toml``."""
    _setup(tmp_path, "short-once-tokenized")
    (tmp_path / RUN).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    argv, expected = CASES["short-once-tokenized"]
    assert main(["train", *SMALL, *argv]) == EXIT_CONFIG_ERROR
    assert expected[0] in capsys.readouterr().err
    assert snapshot(tmp_path).keys() == before.keys()  # the same paths (the dir's mtime moved)
