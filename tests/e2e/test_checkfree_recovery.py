"""CheckFree end to end (loom/relaunch.py, loom/train/checkfree_worker.py): `loom train` with four
pipeline stages, the middle stage 2's process SIGKILLed at the start of step 3. The survivors
keep their state in memory, a replacement process is rebuilt from stages 1 and 3, and the run
finishes every step. From the dumps the ranks wrote at the rebuild: the replacement's blocks equal
the neighbours' gradient-norm-weighted average bit for bit, its optimizer starts empty and its
learning rate is ``fault.recovery_lr_scale`` (1.1) times the neighbours'. No checkpoint exists
to be read."""

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

STEPS, KILL_STEP = 6, 3
ARGS = ["--nproc", "4", "--parallel.pp=4", "--fault.recovery=checkfree",
        "--fault.test_kill_stage=2", f"--fault.test_kill_step={KILL_STEP}",
        "--fault.dump_recovery=true", f"--train.steps={STEPS}", "--model.preset=tiny",
        "--data.max_bytes=300000", "--data.seq_len=64", "--train.global_batch_size=4",
        "--train.micro_batch_size=1", "--train.eval_every=0", "--train.timeout_s=30",
        "--checkpoint.interval=0", "--metrics.tensorboard=false", "--metrics.plot=false"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def test_a_killed_middle_stage_is_rebuilt_from_its_neighbours_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "loom", "train", *ARGS,
                             f"--train.run_dir={run_dir}"], cwd=Path(__file__).parents[2],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every worker it started
        log, _ = proc.communicate()
        pytest.fail(f"the run did not finish in 240 s:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-4000:]
    assert "worker rank 2 (stage 2) killed by signal 9" in log, log[-4000:]
    assert (f"checkfree: stage 2 (rank 2) rebuilt after step {KILL_STEP - 1} from stages 1 and 3"
            in log), log[-4000:]
    # nothing to read a checkpoint from, and no resume happened
    assert not (run_dir / "checkpoints").exists()
    assert "resume:" not in log
    steps = [row["step"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                         .splitlines()) if "loss" in row]
    assert steps == list(range(1, STEPS + 1))
    assert (run_dir / "model.safetensors").exists()

    dumps = run_dir / "checkfree"
    prev = torch.load(dumps / "gen1_rank1_sent.pt")
    nxt = torch.load(dumps / "gen1_rank3_sent.pt")
    rebuilt = torch.load(dumps / "gen1_rank2_rebuilt.pt")
    assert prev["step"] == nxt["step"] == rebuilt["step"] == KILL_STEP - 1
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
