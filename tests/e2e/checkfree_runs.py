"""What the CheckFree end-to-end tests share: `loom train` on a 4-stage pipeline of the tiny
model, in its own session (so a timeout can kill the launcher and every worker it started), and
the metrics a finished run logged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
ROOT = Path(__file__).parents[2]


def pipeline_args(recovery: str, steps: int, run_dir: Path, timeout_s: float = 30) -> list[str]:
    """The `loom train` command: pp = 4, one rank per stage, no checkpoints."""
    return [sys.executable, "-m", "loom", "train", "--nproc", "4", "--parallel.pp=4",
            f"--fault.recovery={recovery}", f"--train.steps={steps}", "--model.preset=tiny",
            "--data.max_bytes=300000", "--data.seq_len=64", "--train.global_batch_size=4",
            "--train.micro_batch_size=1", "--train.eval_every=0",
            f"--train.timeout_s={timeout_s:g}", "--checkpoint.interval=0",
            "--metrics.tensorboard=false", "--metrics.plot=false", f"--train.run_dir={run_dir}"]


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def run_to_end(args: list[str], limit_s: float) -> str:
    """Run to its end within ``limit_s`` and succeed; its output."""
    proc = start(args)
    try:
        log, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every worker it started
        log, _ = proc.communicate()
        pytest.fail(f"the run did not finish in {limit_s:g} s:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-4000:]
    return log


def logged_steps(run_dir: Path) -> list[int]:
    """The steps whose loss the run logged (a line being written ends the list)."""
    path = run_dir / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            break
        if "loss" in row:
            steps.append(row["step"])
    return steps
