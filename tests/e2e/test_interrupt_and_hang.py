"""Ctrl-C and a hung rank, through the real command line (2 workers).

Ctrl-C (SIGINT to the launcher, or to its whole process group as a terminal sends it): exit code
130, one line "loom train: interrupted" on stderr, no traceback and no torch log lines, and none of
the launcher's child processes left alive.

A hung rank (SIGSTOPped worker) with ``train.timeout_s = 10``: the launcher fails within the
timeout plus a few seconds (not the 30 s torch's agent waits for a SIGTERM the stopped process
cannot act on) and names the stopped rank and the collective it never arrived at.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import matrix
from tests.e2e.test_cli_train import SMALL, _worker_pids
from tests.e2e.test_fault_restart import ENV, _steps_logged

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(),
                                reason="needs /proc to find the worker processes")
TORCH_LOG_LINE = re.compile(r"^[IWE]\d{4} ", re.MULTILINE)  # torch's logging prefix


def start(cwd: Path, *extra: str) -> subprocess.Popen:
    """A long run in a session of its own (its own process group, like a terminal job)."""
    return subprocess.Popen(
        [sys.executable, "-m", "loom", "train", "--nproc", "2", "--train.steps=100000",
         "--train.run_dir=runs/r", "--metrics.tensorboard=false", *SMALL, "--train.eval_every=0",
         *extra], cwd=cwd, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True)


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, steps: int = 3) -> None:
    deadline = time.monotonic() + 120
    while _steps_logged(run_dir) < steps:
        assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
        time.sleep(0.05)


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (workers, the multiprocessing resource tracker, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# A terminal's Ctrl-C reaches the whole process group (CI). SIGINT to the launcher alone (15 s
# more) is in the matrix: the launcher stopping workers the signal never reached is also what
# the SIGTERM tests (test_preemption.py, test_checkfree_relaunch.py) check in CI
@pytest.mark.parametrize("to", matrix(["launcher", "process group"], ci=["process group"]))
def test_ctrl_c_exits_130_with_one_line_and_leaves_no_process(tmp_path, to):
    proc = start(tmp_path)
    try:
        wait_for_steps(proc, tmp_path / "runs" / "r")
        children = descendants(proc.pid)
        assert len(_worker_pids(proc.pid)) == 2 and children
        if to == "launcher":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == "loom train: interrupted"
    assert stderr.count("loom train: interrupted") == 1
    assert "Traceback" not in stderr and not TORCH_LOG_LINE.search(stderr), stderr[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "processes left behind"


def test_a_stopped_rank_is_named_within_the_collective_timeout(tmp_path):
    timeout_s = 10
    proc = start(tmp_path, f"--train.timeout_s={timeout_s}")
    stopped = None
    try:
        wait_for_steps(proc, tmp_path / "runs" / "r")
        stopped = _worker_pids(proc.pid)[1]
        os.kill(stopped, signal.SIGSTOP)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=timeout_s + 50)
        took = time.monotonic() - sent
    finally:
        if stopped is not None and alive(stopped):
            os.kill(stopped, signal.SIGCONT)
            os.kill(stopped, signal.SIGKILL)
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert timeout_s <= took < timeout_s + 8, f"took {took:.1f} s"
    message = re.search(r"loom train: hung rank: rank 1 (never arrived at|stopped responding in)"
                        r" all_reduce \(dp, [\d,]+ elements?\) of step \d+; last seen \d+ s ago"
                        rf".*\(pid {stopped}, stopped\)", stderr)
    assert message, stderr[-3000:]
    assert "reported by rank 0" in stderr
    assert "Traceback" not in stderr and not TORCH_LOG_LINE.search(stderr), stderr[-3000:]
