"""Graceful preemption end to end: SIGTERM to ``loom train`` (the launcher) or to one worker makes
every rank stop at the same step, checkpoint (``checkpoint.interval = 0`` here: the preemption
checkpoint is the only one) and exit 0 well within ``train.preempt_grace_s``; ``--resume auto``
then finishes with final weights bit-identical to an uninterrupted run (fp32, deterministic CPU
kernels). ``bench/preemption.py`` repeats this at random moments."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.test_cli_train import _worker_pids
from tests.e2e.test_fault_restart import ENV, _steps_logged, _weights

STEPS = 16  # preempted after 5 logged steps, at the next step's end: far from the last
GRACE_S = 30
ARGS = ["--nproc", "2", f"--train.steps={STEPS}", "--checkpoint.interval=0",
        "--model.preset=debug", "--data.max_bytes=300000", "--data.seq_len=64",
        "--train.global_batch_size=4", "--train.micro_batch_size=2", "--train.eval_every=0",
        "--optim.warmup_steps=2", "--metrics.tensorboard=false", "--metrics.plot=false",
        f"--train.preempt_grace_s={GRACE_S}"]
PREEMPTED = re.compile(r"preempted at step (\d+): checkpoint saved to (\S+), resume with"
                       r" --resume auto")


def train(cwd: Path, run: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom", "train", *ARGS, *extra,
                           f"--train.run_dir=runs/{run}"], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600)


def preempt(cwd: Path, run: str, target: str, after_steps: int = 5) -> tuple[int, str, float]:
    """Start a run, SIGTERM ``target`` ('launcher' or 'rank<N>') once ``after_steps`` steps are
    logged; return (exit code, stderr, seconds from the signal to the exit)."""
    proc = subprocess.Popen([sys.executable, "-m", "loom", "train", *ARGS,
                             f"--train.run_dir=runs/{run}"], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while _steps_logged(cwd / "runs" / run) < after_steps:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.02)
        pid = proc.pid if target == "launcher" else _worker_pids(proc.pid)[int(target[4:])]
        os.kill(pid, signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=GRACE_S + 30)
        return proc.returncode, stderr, time.monotonic() - sent
    finally:
        proc.kill()


class Straight:
    """The uninterrupted run, started in the background when the module's first test asks for
    it (its start-up overlaps that test's preempted run); ``weights()`` waits for it."""

    def __init__(self, cwd: Path) -> None:
        self.cwd, self.log = cwd, cwd / "straight.log"
        with self.log.open("w") as log:  # a file, not a pipe nobody reads while it runs
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "loom", "train", *ARGS, "--train.run_dir=runs/straight"],
                cwd=cwd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        self._weights: dict | None = None

    def weights(self) -> dict:
        if self._weights is None:
            assert self.proc.wait(timeout=600) == 0, self.log.read_text()[-2000:]
            self._weights = _weights(self.cwd / "runs" / "straight")
        return self._weights


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = Straight(tmp_path_factory.mktemp("preempt"))
    yield run.cwd, run
    run.proc.kill()


def check_preempted(cwd: Path, run: str, code: int, stderr: str, took: float) -> int:
    """The run stopped cleanly at some step N < STEPS with a committed checkpoint of step N."""
    from loom.train.checkpoint import complete_checkpoints, step_dir

    assert code == 0, stderr[-3000:]
    assert took < GRACE_S, f"took {took:.1f} s"
    found = PREEMPTED.findall(stderr)
    assert len(found) == 1, stderr[-3000:]  # one line, from rank 0
    step = int(found[0][0])
    assert 0 < step < STEPS
    run_dir = cwd / "runs" / run
    root = run_dir / "checkpoints"
    assert complete_checkpoints(root) == [step_dir(root, step)]
    assert not (run_dir / "model.safetensors").exists()  # a preempted run is not finished
    assert _steps_logged(run_dir) == step
    assert "Traceback" not in stderr
    return step


def resume_and_compare(cwd: Path, run: str, step: int, straight: Straight) -> None:
    done = train(cwd, run, "--resume", "auto")
    expected = straight.weights()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resume: continuing from" in done.stderr and f"(step {step})" in done.stderr
    got = _weights(cwd / "runs" / run)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"{name} differs after preemption and resume"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker processes")
def test_sigterm_to_the_launcher_checkpoints_and_the_resumed_run_is_bit_identical(straight):
    cwd, reference = straight
    code, stderr, took = preempt(cwd, "launcher", "launcher")
    step = check_preempted(cwd, "launcher", code, stderr, took)
    resume_and_compare(cwd, "launcher", step, reference)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker processes")
def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(straight):
    cwd, reference = straight
    code, stderr, took = preempt(cwd, "worker", "rank1")
    step = check_preempted(cwd, "worker", code, stderr, took)
    progress = cwd / "runs" / "worker" / ".progress"
    records = [json.loads((progress / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["status"], r["step"]) for r in records] == [("preempted", step)] * 2
    resume_and_compare(cwd, "worker", step, reference)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find the worker processes")
def test_workers_that_cannot_stop_are_killed_when_the_grace_period_ends(tmp_path):
    """A SIGSTOPped worker cannot finish its step: the launcher kills both workers just before
    ``train.preempt_grace_s`` and says so (exit 1), instead of waiting for torch's 30 s."""
    grace = 4
    proc = subprocess.Popen([sys.executable, "-m", "loom", "train", *ARGS,
                             f"--train.preempt_grace_s={grace}", "--train.run_dir=runs/stuck"],
                            cwd=tmp_path, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    stopped = None
    try:
        deadline = time.monotonic() + 300
        while _steps_logged(tmp_path / "runs" / "stuck") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.02)
        workers = _worker_pids(proc.pid)
        stopped = workers[1]
        os.kill(stopped, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert grace - 2 < took < grace + 3, f"took {took:.1f} s"
    assert (f"did not checkpoint and stop within train.preempt_grace_s = {grace} s"
            in stderr), stderr[-3000:]
    assert "Traceback" not in stderr
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers.values())
