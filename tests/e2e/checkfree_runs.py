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
import torch

from loom.train.checkfree import NORM_EPS

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


def check_middle_rebuild(dumps: Path, after_step: int | None = None) -> None:
    """From the dumps of recovery generation 1 (``fault.dump_recovery``): stage 2 was rebuilt
    from stages 1 and 3 as their gradient-norm-weighted average, bit for bit, with an empty
    optimizer and ``fault.recovery_lr_scale`` (1.1) times their learning rate; ``after_step``:
    the last step the lost stage finished (None: whatever it was, the same in all three)."""
    prev = torch.load(dumps / "gen1_rank1_sent.pt")
    nxt = torch.load(dumps / "gen1_rank3_sent.pt")
    rebuilt = torch.load(dumps / "gen1_rank2_rebuilt.pt")
    assert prev["step"] == nxt["step"] == rebuilt["step"]
    assert after_step is None or rebuilt["step"] == after_step
    w_prev, w_next = prev["grad_norm"] + NORM_EPS, nxt["grad_norm"] + NORM_EPS
    assert prev["grad_norm"] > 0 and nxt["grad_norm"] > 0
    assert (rebuilt["w_prev"], rebuilt["w_next"]) == (w_prev, w_next)
    assert set(rebuilt["blocks"]) == set(prev["blocks"]) == set(nxt["blocks"])
    assert rebuilt["sources"] == [1, 3] and rebuilt["optimizer_states"] == 0
    assert prev["lr"] == nxt["lr"] == rebuilt["source_lr"] > 0
    assert rebuilt["lr"] == pytest.approx(1.1 * prev["lr"], rel=1e-12)
    for key, value in rebuilt["blocks"].items():
        want = (prev["blocks"][key] * w_prev + nxt["blocks"][key] * w_next) / (w_prev + w_next)
        assert torch.equal(value, want), key
        assert not torch.equal(value, prev["blocks"][key])  # really a mix of both
