"""The launcher's side of signals and hangs: what ``loom train --nproc N`` does while workers run.

torch's elastic agent handles SIGTERM and SIGINT itself by default: it raises ``SignalException``
in the agent loop, sends the same signal to every worker, waits ``shutdown_timeout`` (30 s) and
SIGKILLs what is left, then re-raises, which ends the launcher with a traceback. A worker that is
saving a checkpoint would be killed mid-write, and the job could not report that it stopped
cleanly. So ``launch_local`` tells the agent to leave SIGTERM and SIGINT alone
(``signals_to_handle``) and runs inside ``Supervisor``, which installs these handlers instead:

* SIGTERM (preemption): forwarded to every worker that has registered its pid in
  ``run_dir/.progress`` (``loom.train.watchdog.register``; workers that register later get it
  too), and nothing else: the workers agree on a step, checkpoint and return, and the agent sees
  an ordinary success (exit 0). An alarm fires one second before ``train.preempt_grace_s`` runs
  out; then ``GraceExpired`` (a ``SignalException`` carrying SIGKILL) makes the agent kill the
  workers, and the launcher reports that no checkpoint was written in time.
* SIGINT (Ctrl-C): ``Interrupted`` (a ``SignalException`` carrying SIGINT) makes the agent send
  SIGINT to the workers (they exit at once, ``loom.train.preempt``) and SIGKILL any left after a
  few seconds; the launcher prints "loom train: interrupted" and exits 130. Later SIGINTs are
  ignored so that a second Ctrl-C cannot cut the cleanup short and leave workers behind.
* A hung rank: a thread polls ``run_dir/.progress`` for a diagnosis written by a rank whose
  collective timed out (``loom.train.watchdog``) and SIGKILLs the named rank(s) at once — a
  SIGSTOPped or wedged process would otherwise hold the agent's 30 s SIGTERM wait.

While the launcher is being interrupted or a hang has been diagnosed, torch's own log lines about
stopping workers (and the traceback of the waiting rank's timeout) are held back: the launcher's
one-line summary replaces them. Why hand-written: none of this is configurable in torch's agent
beyond which signals it handles and how long it waits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from loom.train import watchdog

INTERRUPT_WAIT_S = 5  # after Ctrl-C, how long workers get to exit before SIGKILL
_TORCH_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                  "torch.distributed.elastic.agent.server.local_elastic_agent",
                  "torch.distributed.elastic.multiprocessing.api",
                  "torch.multiprocessing.spawn")


class Interrupted(SignalException):
    """Ctrl-C / SIGINT reached the launcher."""


class GraceExpired(SignalException):
    """The workers did not stop within ``train.preempt_grace_s`` after a SIGTERM."""


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


class Supervisor:
    """Signal handlers and the hang reaper around ``elastic_launch`` (see the module docstring).
    Must be entered on the main thread; everything it installs is removed on exit."""

    def __init__(self, run_dir: str | Path, run_id: str, grace_s: float) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.grace_s = grace_s
        self.terminated_at: float | None = None  # monotonic time of the first SIGTERM
        self.interrupted = False
        self.grace_expired = False
        self.hang: dict[str, Any] | None = None  # the first diagnosis of this job
        self._signalled: set[tuple[int, int]] = set()  # (rank, pid) sent SIGTERM
        self._killed: set[int] = set()
        self._handled: set[tuple[str, int]] = set()  # diagnoses acted on: (job, reporter)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: dict[int, Any] = {}
        self._filter = _Quiet(self)

    def __enter__(self) -> Supervisor:
        for sig, handler in ((signal.SIGTERM, self._on_sigterm), (signal.SIGINT, self._on_sigint),
                             (signal.SIGALRM, self._on_alarm)):
            self._previous[sig] = signal.signal(sig, handler)
        for name in _TORCH_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)
        self._thread = threading.Thread(target=self._run, name="loom-supervisor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if exc_type is None:  # the job is over and saved: a late SIGTERM must not kill the exit
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        for name in _TORCH_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)

    # -- handlers (main thread)
    def _on_sigterm(self, signum, frame) -> None:
        if self.terminated_at is not None:
            return  # Slurm and friends may repeat it; the first one started the clock
        self.terminated_at = time.monotonic()
        margin = 1.0 if self.grace_s > 2 else self.grace_s / 2
        signal.setitimer(signal.ITIMER_REAL, self.grace_s - margin)
        self._wake.set()

    def _on_sigint(self, signum, frame) -> None:
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.setitimer(signal.ITIMER_REAL, 0)
        raise Interrupted("interrupted", signal.SIGINT)

    def _on_alarm(self, signum, frame) -> None:
        if self.terminated_at is None or self.interrupted:
            return
        self.grace_expired = True
        raise GraceExpired(f"the workers did not stop within {self.grace_s:g} s", signal.SIGKILL)

    # -- the thread
    def quiet(self) -> bool:
        """Hold back torch's shutdown logging: we were interrupted, a preemption ran out of time
        or a hang was diagnosed (the launcher's own message says what happened)."""
        return self.interrupted or self.grace_expired or self.hang is not None \
            or bool(self._diagnoses())

    def _diagnoses(self) -> list[dict[str, Any]]:
        return [d for d in watchdog.read_diagnoses(self.run_dir)
                if str(d.get("job", "")).startswith(f"{self.run_id}/")]

    def _workers(self, job: str | None = None) -> dict[int, int]:
        """rank -> pid of the registered workers this process started: its children's children,
        forked by the launch's forkserver (``loom.launch.WORKER_MODULES``), or its children. A
        record of an earlier run whose pid was reused by another process is left alone."""
        out = {}
        me = os.getpid()
        for rank, record in watchdog.read_records(self.run_dir).items():
            job_of = str(record.get("job", ""))
            parent = parent_pid(int(record["pid"]))
            if job_of.startswith(f"{self.run_id}/") and (job is None or job_of == job) \
                    and parent is not None and (parent == me or parent_pid(parent) == me):
                out[rank] = int(record["pid"])
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            try:
                if self.terminated_at is not None and not self.interrupted:
                    for rank, pid in self._workers().items():
                        if (rank, pid) not in self._signalled:
                            self._signalled.add((rank, pid))
                            os.kill(pid, signal.SIGTERM)
                for found in self._diagnoses():
                    key = (found["job"], found["reporter"])
                    if key in self._handled:
                        continue
                    self._handled.add(key)
                    self.hang = self.hang or found
                    workers = self._workers(found["job"])
                    for rank in found.get("culprits", []):
                        pid = workers.get(rank)
                        if pid is not None and pid not in self._killed:
                            self._killed.add(pid)
                            os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                continue  # a worker exited between the look and the kill; look again


class _Quiet(logging.Filter):
    def __init__(self, supervisor: Supervisor) -> None:
        super().__init__()
        self.supervisor = supervisor

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.supervisor.quiet()
