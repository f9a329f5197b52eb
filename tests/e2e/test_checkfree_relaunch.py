"""The CheckFree launcher (loom/relaunch.py) when a worker hangs instead of dying, and when the
launcher itself is told to stop.

* A hung middle stage: once step 2 is logged, stage 2's process is SIGSTOPped (a frozen node:
  alive, its sockets open, answering nothing). Its neighbours' collectives time out after
  ``train.timeout_s``; their watchdog names rank 2; the launcher SIGKILLs it and replaces it
  exactly as if it had died, rebuilt from stages 1 and 3: from the dumps the ranks wrote, the
  replacement's blocks equal the neighbours' gradient-norm-weighted average bit for bit.
  Training goes on, in bounded time, with no step lost or repeated. (That a run with rebuilds
  finishes every step is CheckFree+'s test's.)
* A hung first stage under checkfree (which cannot rebuild it): the same detection and kill,
  then the job fails naming the hung rank, in bounded time, and no worker is left behind.
* SIGTERM to the launcher (in the same run, after the rebuild): it stops every worker, the
  replacement included, and exits nonzero saying so; no worker process outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.checkfree_runs import check_middle_rebuild, logged_steps, pipeline_args, start

TIMEOUT_S = 15


def _start(steps: int, run_dir: Path, *extra: str) -> subprocess.Popen:
    return start(pipeline_args("checkfree", steps, run_dir, timeout_s=TIMEOUT_S) + list(extra))


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while step not in logged_steps(run_dir):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"step {step} not logged:\n{proc.communicate()[0][-4000:]}")
        time.sleep(0.02)


def _workers(session: int) -> dict[int, int]:
    """rank -> pid of the live loom-rank<R> processes of the launcher's session."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            comm = (entry / "comm").read_text().strip()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if comm.startswith("loom-rank") and os.getsid(int(entry.name)) == session \
                    and state != "Z":
                out[int(comm[len("loom-rank"):])] = int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    return out


def _finish(proc: subprocess.Popen, limit_s: float) -> str:
    try:
        return proc.communicate(timeout=limit_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the launcher did not exit within {limit_s:.0f} s:"
                    f"\n{proc.communicate()[0][-6000:]}")


def test_a_hung_middle_stage_is_rebuilt_training_goes_on_and_sigterm_stops_every_worker(tmp_path):
    # One run for two properties (each launch of four stages costs ~15 s of CI): the hang and
    # its rebuild, then SIGTERM to the launcher with the replacement among the workers.
    run_dir = tmp_path / "run"
    proc = _start(10_000, run_dir, "--fault.dump_recovery=true")
    _wait_for_step(proc, run_dir, 2, 240)
    workers = _workers(proc.pid)
    assert len(workers) == 4
    hung = workers[2]
    os.kill(hung, signal.SIGSTOP)
    frozen = max(logged_steps(run_dir))
    # one timeout (the neighbours' collectives), then a kill and a rebuild: not forever; and
    # training goes on past the step the stage froze in
    _wait_for_step(proc, run_dir, frozen + 3, 4 * TIMEOUT_S + 120)
    assert _workers(proc.pid)[2] != hung  # the replacement
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as a scheduler would
    log = _finish(proc, 60)
    assert proc.returncode != 0, log[-4000:]
    assert "worker rank 2 stopped responding" in log, log[-4000:]
    assert "worker rank 2 (stage 2) hung (" in log, log[-4000:]
    assert "checkfree: stage 2 (rank 2) rebuilt after step" in log, log[-4000:]
    assert "loom train: stopped by SIGTERM; every worker was stopped" in log, log[-4000:]
    steps = logged_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))  # no step lost or repeated
    deadline = time.monotonic() + 10
    while _workers(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _workers(proc.pid) == {}, "workers outlived the launcher"
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)  # the frozen process is gone, not left stopped
    # the replacement is its neighbours' weighted average, bit for bit
    check_middle_rebuild(run_dir / "checkfree")


@pytest.mark.slow  # 34 s: the hang path itself is covered by the rebuild test above
def test_a_hung_stage_checkfree_cannot_rebuild_fails_the_job_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(10_000, run_dir)
    _wait_for_step(proc, run_dir, 2, 240)
    os.kill(_workers(proc.pid)[0], signal.SIGSTOP)
    stopped_at = time.monotonic()
    log = _finish(proc, 240)
    assert proc.returncode != 0, log[-4000:]
    assert time.monotonic() - stopped_at < 4 * TIMEOUT_S + 120, log[-4000:]
    assert "worker rank 0 stopped responding" in log, log[-4000:]
    assert ("worker rank 0 (stage 0) hung (" in log
            and "checkfree rebuilds stages 1..2 only" in log), log[-4000:]
    deadline = time.monotonic() + 10
    while _workers(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _workers(proc.pid) == {}, "workers outlived the launcher"
