"""End to end through the real command line: `loom train` on a JSON lines source with a Hugging
Face tokenizer (one process, three steps), then `loom generate` with the run's copy of the
tokenizer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.data_fixtures import TEXTS, make_tokenizer, write_source

pytest.importorskip("datasets", reason="the data extra: pip install -e '.[data]'")

STEPS = 3
SMALL = ["--model.preset=debug", "--data.seq_len=32", "--train.global_batch_size=4",
         "--train.micro_batch_size=2", "--train.eval_every=0", "--optim.warmup_steps=1",
         "--metrics.tensorboard=false", "--metrics.plot=false", "--metrics.progress=false"]


def loom(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "loom", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("hfdata")
    write_source(cwd / "docs.jsonl", "jsonl", TEXTS * 3)
    make_tokenizer(cwd / "tok", bos_template=True, config={"eos_token": "</s>"})
    result = loom("train", f"--train.steps={STEPS}", "--train.run_dir=runs/hf",
                  "--data.source=docs.jsonl", "--data.tokenizer=tok", *SMALL, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, cwd / "runs" / "hf"


def test_the_run_trains_on_the_jsonl_documents_with_the_tokenizer(finished_run):
    from loom.config import load_config
    from loom.data.hf_tokenizer import load_hf_tokenizer
    from loom.data.tokenizer import encode_documents

    cwd, run_dir = finished_run
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert all(np.isfinite(s["loss"]) for s in steps)
    tok = load_hf_tokenizer(cwd / "tok")
    config = load_config(run_dir / "config.toml")
    assert config.model.vocab_size == -(-tok.vocab_size // 64) * 64  # vocab_size = 0, rounded up
    train = np.fromfile(run_dir / "data" / "train.bin", dtype=np.uint16)
    n_train = len(TEXTS) * 3 - round(len(TEXTS) * 3 * config.data.val_fraction)
    expected = np.concatenate(encode_documents(tok, (TEXTS * 3)[:n_train]))
    assert np.array_equal(train, expected)  # BOS from the template, one EOS after each


def test_generate_uses_the_runs_copy_of_the_tokenizer(finished_run):
    cwd, run_dir = finished_run
    meta = json.loads((run_dir / "data" / "tokenizer_meta.json").read_text())
    assert meta["kind"] == "hf" and (run_dir / "data" / "tokenizer_config.json").is_file()
    shutil.rmtree(cwd / "tok")  # the original is gone: generation must not need it
    result = loom("generate", "--run", str(run_dir), "--prompt", "Document 3",
                  "--max-new-tokens", "8", cwd=cwd)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Document 3")
