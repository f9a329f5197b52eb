"""CheckFree end to end (loom/relaunch.py, loom/train/checkfree_worker.py): `loom train` with four
pipeline stages, the middle stage 2's process SIGKILLed at the start of step 3. The survivors
keep their state in memory, a replacement process is rebuilt from stages 1 and 3, and the run
finishes every step. From the dumps the ranks wrote at the rebuild: the replacement's blocks equal
the neighbours' gradient-norm-weighted average bit for bit, its optimizer starts empty and its
learning rate is ``fault.recovery_lr_scale`` (1.1) times the neighbours'. No checkpoint exists
to be read."""

from __future__ import annotations


import pytest

from tests.e2e.checkfree_runs import (check_middle_rebuild, logged_steps, pipeline_args,
                                     run_to_end)

STEPS, KILL_STEP = 6, 3
FAULT = ["--fault.test_kill_stage=2", f"--fault.test_kill_step={KILL_STEP}",
         "--fault.dump_recovery=true"]


# slow (62 s in CI): the hung-stage test (test_checkfree_relaunch.py) rebuilds stage 2 through
# the same recovery and checks the same average bit for bit; CheckFree+'s test covers a killed
# (exited) process. This one adds only the kill at a chosen step.
@pytest.mark.slow
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

    check_middle_rebuild(run_dir / "checkfree", after_step=KILL_STEP - 1)
