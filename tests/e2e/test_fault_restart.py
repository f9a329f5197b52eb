"""Fault tolerance end to end: a worker SIGKILLed mid-run under `--max-restarts` makes the elastic
agent restart the job, which resumes from the newest complete checkpoint and finishes with final
weights bit-identical to an uninterrupted run (fp32, deterministic CPU kernels).

The uninterrupted run saves its checkpoints asynchronously (the faulty one synchronously), so the
same comparison shows through the CLI that background saves do not change the trained weights;
its last save is committed before it exits, keep-K holds and nothing is left half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from loom.train.checkpoint import complete_checkpoints, step_dir
from tests.e2e.test_cli_train import _worker_pids

STEPS = 16  # killed after 6 (past the first checkpoint at 4), resumed from 4 to the end
ARGS = ["--nproc", "2", f"--train.steps={STEPS}", "--checkpoint.interval=4",
        "--model.preset=tiny", "--data.max_bytes=300000", "--data.seq_len=64",
        "--train.global_batch_size=4", "--train.micro_batch_size=2", "--train.eval_every=0",
        "--metrics.tensorboard=false", "--metrics.plot=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"loss"') if path.exists() else 0


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker processes")
def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(tmp_path):
    # The uninterrupted run goes alongside the faulty one: its start-up overlaps the other's.
    # (its output goes to a file: an unread pipe could fill and stall it)
    straight_log = tmp_path / "straight.log"
    with straight_log.open("w") as log:
        straight = subprocess.Popen([sys.executable, "-m", "loom", "train", *ARGS,
                                     "--checkpoint.async_save=true", "--checkpoint.keep=2",
                                     "--train.run_dir=runs/straight"], cwd=tmp_path, env=ENV,
                                    stdout=log, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "runs" / "faulty"
    proc = subprocess.Popen([sys.executable, "-m", "loom", "train", *ARGS, "--max-restarts", "1",
                             "--train.run_dir=runs/faulty"], cwd=tmp_path, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        # Past the first checkpoint (step 4) and well before the end.
        while _steps_logged(run_dir) < 6:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not progress"
            time.sleep(0.05)
        killed_at = _steps_logged(run_dir)
        assert killed_at < STEPS, "the run finished before the fault could be injected"
        os.kill(_worker_pids(proc.pid)[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=600)
        straight.wait(timeout=600)
    finally:
        proc.kill()
        straight.kill()
    assert straight.returncode == 0, straight_log.read_text()[-2000:]
    root = tmp_path / "runs" / "straight" / "checkpoints"
    assert complete_checkpoints(root) == [step_dir(root, STEPS - 4), step_dir(root, STEPS)]
    assert not list(root.glob("*.partial"))
    assert proc.returncode == 0, stderr[-3000:]
    assert "resume: continuing from" in stderr, stderr[-3000:]
    expected, got = _weights(tmp_path / "runs" / "straight"), _weights(run_dir)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs after the restart"
