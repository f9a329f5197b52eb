"""How ``loom train --nproc N`` hands its workers what they need (loom/launch.py,
loom/supervise.py): workers are forked from a fork server whose environment was fixed when it
started, so the variables a launch sets travel with the call; and the workers are the
launcher's grandchildren, which the Supervisor must still recognise as its own."""

from __future__ import annotations

import multiprocessing
import os

from loom.emulate import COMPUTE_ENV, NAMESPACE_ENV
from loom.launch import LAUNCH_ENV, apply_launch_env
from loom.supervise import Supervisor, parent_pid
from loom.train import watchdog


def test_a_worker_takes_the_launchs_variables_and_drops_stale_ones(monkeypatch):
    # left behind by an earlier, emulated launch whose fork server this worker came from
    monkeypatch.setenv(NAMESPACE_ENV, "stale-namespace")
    monkeypatch.setenv(COMPUTE_ENV, "1.0,0.5")
    apply_launch_env({COMPUTE_ENV: "1.0,0.25"})
    assert os.environ[COMPUTE_ENV] == "1.0,0.25"
    assert NAMESPACE_ENV not in os.environ
    apply_launch_env({})
    assert not any(key in os.environ for key in LAUNCH_ENV)


def _register_and_wait(run_dir: str, run_id: str, registered, release) -> None:
    """A worker as the launch makes it: registered under the job's id, then waiting."""
    os.environ["TORCHELASTIC_RUN_ID"] = run_id
    watchdog.register(run_dir, 0)
    registered.set()
    release.wait(60)


def test_the_supervisor_finds_workers_forked_by_the_fork_server(tmp_path):
    context = multiprocessing.get_context("forkserver")
    registered, release = context.Event(), context.Event()
    worker = context.Process(target=_register_and_wait,
                             args=(str(tmp_path), "loom-test", registered, release))
    worker.start()
    try:
        assert registered.wait(60)
        parent = parent_pid(worker.pid)
        assert parent != os.getpid() and parent_pid(parent) == os.getpid()  # a grandchild
        supervisor = Supervisor(tmp_path, "loom-test", grace_s=5)
        assert supervisor._workers() == {0: worker.pid}
        # a record of this job whose pid is not of this launch's making is not a worker of it
        watchdog.write_json(watchdog.rank_file(tmp_path, 1), {
            "rank": 1, "pid": 1, "job": "loom-test/0", "status": "starting"})
        assert supervisor._workers() == {0: worker.pid}
    finally:
        release.set()
        worker.join(30)
    assert worker.exitcode == 0


def test_the_worker_entry_point_records_its_error_for_the_launchers_message():
    # torch elastic's ``record`` writes a failing worker's traceback where the agent reads it;
    # without it the launcher could only say "exit code 1" (``launch._describe_failures``)
    from loom.launch import worker_main

    assert getattr(worker_main, "__wrapped__", None) is not None
    assert worker_main.__wrapped__.__name__ == "worker_main"
