"""CheckFree end to end (loom/relaunch.py, loom/train/checkfree_worker.py): `loom train` with four
pipeline stages, the middle stage 2's process SIGKILLed at the start of step 3. The survivors
keep their state in memory, a replacement process is rebuilt from stages 1 and 3, and the run
finishes every step. From the dumps the ranks wrote at the rebuild: the replacement's blocks equal
the neighbours' gradient-norm-weighted average bit for bit, its optimizer starts empty and its
learning rate is ``fault.recovery_lr_scale`` (1.1) times the neighbours'. No checkpoint exists
to be read."""

from __future__ import annotations


import pytest
import torch

from loom.train.checkfree import NORM_EPS
from tests.e2e.checkfree_runs import logged_steps, pipeline_args, run_to_end

STEPS, KILL_STEP = 6, 3
FAULT = ["--fault.test_kill_stage=2", f"--fault.test_kill_step={KILL_STEP}",
         "--fault.dump_recovery=true"]


def test_a_killed_middle_stage_is_rebuilt_from_its_neighbours_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "run"
    log = run_to_end(pipeline_args("checkfree", STEPS, run_dir) + FAULT, 240)
    assert "worker rank 2 (stage 2) killed by signal 9" in log, log[-4000:]
    assert (f"checkfree: stage 2 (rank 2) rebuilt after step {KILL_STEP - 1} from stages 1 and 3"
            in log), log[-4000:]
    # nothing to read a checkpoint from, and no resume happened
    assert not (run_dir / "checkpoints").exists()
    assert "resume:" not in log
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
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
