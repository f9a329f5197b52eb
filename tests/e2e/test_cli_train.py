"""End to end through the real command line: `loom train --nproc 2`, then `loom generate`.

One short run is shared by the assertions below (starting ranks is the expensive part). A second
run has one worker killed mid-training and must stop promptly, naming the rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STEPS = 6
SMALL = ["--data.max_bytes=300000", "--data.seq_len=64", "--train.global_batch_size=4",
         "--train.micro_batch_size=2", "--model.preset=debug", "--train.eval_every=3",
         "--optim.warmup_steps=2", "--metrics.tensorboard=true"]


def loom(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "loom", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    result = loom("train", "--nproc", "2", f"--train.steps={STEPS}", "--train.run_dir=runs/e2e",
                  *SMALL, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "e2e", result


def test_train_writes_a_complete_run_directory(finished_run):
    run_dir, _ = finished_run
    for name in ("config.toml", "metrics.jsonl", "model.safetensors", "loss_curve.png",
                 "data/train.bin", "data/val.bin"):
        assert (run_dir / name).exists(), name
    assert any((run_dir / "tb").iterdir()), "TensorBoard event files"
    assert (run_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metrics_have_one_line_per_step_and_evals(finished_run):
    run_dir, _ = finished_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    evals = [line for line in lines if "val/loss" in line]
    assert [line["step"] for line in steps] == list(range(1, STEPS + 1))
    assert [line["step"] for line in evals] == [3, 6]
    for line in steps:
        for key in ("grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_bytes"):
            assert key in line, key
        # a CPU has no stated peak (no --metrics.peak_tflops): MFU is n/a, not a made-up figure
        assert line["mfu"] is None and line["tokens_per_s"] > 0


def test_resolved_config_is_saved_and_reloads(finished_run):
    from loom.config import load_config

    run_dir, _ = finished_run
    config = load_config(run_dir / "config.toml")
    assert config.parallel.dp_replicate == 2 and config.train.steps == STEPS
    assert config.model.vocab_size == 320  # resolved from the byte tokenizer


def test_generate_continues_the_prompt(finished_run):
    run_dir, _ = finished_run
    result = loom("generate", "--run", str(run_dir), "--prompt", "def ", "--max-new-tokens", "20",
                  cwd=run_dir.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")


@pytest.mark.parametrize("flags, named", [
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--max-new-tokens", "1000000000"], "--max-new-tokens"),  # would sample for hours
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--top-k", "-5"], "--top-k"),
    # named by the flag, not blamed on the run: bytes that are not UTF-8 (argv keeps them as
    # surrogates) and devices torch parses that Loom does not sample on
    (["--prompt", "\udcff\udcfe"], "--prompt"), (["--device", "meta"], "--device"),
    (["--device", "cpu:0"], "--device"),
])
def test_generate_refuses_a_bad_flag_in_one_line(finished_run, capsys, flags, named):
    from loom.cli import main

    run_dir, _ = finished_run
    assert main(["generate", "--run", str(run_dir), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"loom generate: {named}"), err


def test_generate_refuses_a_run_it_cannot_read_in_one_line(finished_run, tmp_path, capsys):
    from loom.cli import main

    run_dir, _ = finished_run
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.toml").write_text((run_dir / "config.toml").read_text())
    (broken / "model.safetensors").write_text("not tensors")
    for run in (tmp_path / "missing", broken):
        assert main(["generate", "--run", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"loom generate: --run {run}"), err


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the launcher's descendants, which name themselves ``loom-rank<N>``."""
    ranks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("loom-rank") and _descends_from(int(entry.name), launcher_pid):
            ranks[int(name[len("loom-rank"):])] = int(entry.name)
    return ranks


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        pid = next((int(l.split()[1]) for l in status.splitlines() if l.startswith("PPid:")), 0)
    return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker processes")
def test_a_killed_worker_stops_the_job_and_is_named(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loom", "train", "--nproc", "2", "--train.steps=100000",
         "--train.run_dir=runs/killed", "--train.eval_every=0", *SMALL],
        cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    pids = _worker_pids(proc.pid)
    assert sorted(pids) == [0, 1], pids
    os.kill(pids[1], signal.SIGKILL)
    try:
        _, stderr = proc.communicate(timeout=60)  # stopped, not hung
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "worker rank 1" in stderr and "killed by signal 9" in stderr, stderr[-2000:]
