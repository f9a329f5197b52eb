"""Run a test body on W local ranks (gloo on the CPU, or NCCL on GPUs), reusing the worker
processes across tests.

Starting ranks is the slow part of a distributed test on a small machine (``import torch`` costs
2-3 s per process, a 4-rank ``torchrun`` about 9 s), so a ``WorkerPool`` starts W processes once,
forked from a fork server that has already imported torch and loom (a pool starts in about a
second instead of W x 3 s of imports), initialises a gloo process group among them with a short
timeout, and then executes any number of tasks: ``pool.run(fn, *args)`` calls ``fn(ctx, *args)``
on every rank, where ``ctx`` is the rank's ``DistContext``, and returns the per-rank results in
rank order.

``fn`` and its arguments are pickled by reference, so ``fn`` must be a module-level function of an
importable module (a test file is fine). A task that raises on any rank, or does not finish within
``task_timeout_s``, fails the call with every rank's traceback, and the pool shuts itself down —
its process group may be wedged — so the next call gets fresh workers (``PoolRegistry`` does this).
Each rank's stderr goes to a log in the pool's folder; when a rank dies or goes silent, the
report quotes the end of its log (a native abort prints its reason there, not as a traceback).

An accelerator ``device`` type (``"cuda"`` in tests/gpu) gives each rank its own device (rank r
uses index r) and the trainer's backend for it (``resolve_backend``: NCCL on CUDA); NCCL refuses
two ranks on one GPU, so a GPU pool is never wider than the machine's GPU count (tests/gpu skip
what does not fit).

Usage (see ``tests/conftest.py`` for the shared fixture)::

    def body(ctx, x):                       # runs on every rank
        return ctx.rank * x

    registry = PoolRegistry()
    assert registry.run(4, body, 10) == [0, 10, 20, 30]
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from loom.train.distributed import DistContext, resolve_backend

WORKER_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
# Imported once by the fork server; every worker is forked from it with these already loaded.
# (pytest: the task functions live in test modules, which import it.)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint",
           "loom.train.trainer", "loom.testing.parity", "pytest"]


class HarnessError(RuntimeError):
    """A task failed or timed out on at least one rank; the message holds every rank's report."""


def _worker_loop(rank: int, world_size: int, init_file: str, tasks: Any, results: Any,
                 pg_timeout_s: float, device_type: str) -> None:
    os.environ.update(WORKER_ENV)
    # A native abort (gloo's I/O thread throwing, a failed assertion in C++) leaves no Python
    # traceback; what it prints goes to this rank's log, which a failure report quotes.
    log = os.open(_stderr_log(init_file, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 2)
    os.close(log)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type != "cpu" else torch.device("cpu")
    if device.type != "cpu":
        torch.accelerator.set_device_index(rank)
    backend = resolve_backend("auto", device)  # the trainer's rule: NCCL on CUDA, else gloo
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    ctx = DistContext(rank, world_size, rank, world_size, device, backend)
    results.put((rank, "ready", None, _thread_count()))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(ctx, *args, **kwargs), _thread_count()))
        except BaseException:  # report everything, including assertion errors, to the parent
            results.put((rank, "error", traceback.format_exc(), _thread_count()))
    dist.destroy_process_group()


def _stderr_log(init_file: str, rank: int) -> str:
    """Where rank ``rank`` of the pool whose rendezvous file is ``init_file`` writes its stderr."""
    return str(Path(init_file).with_name(f"rank{rank}.stderr"))


def _log_tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of a worker's stderr log ("" when it is empty or gone)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def _death_note(proc: Any) -> str:
    """How a worker ended, for the failure message: its exit code, or the signal that killed it
    (a SIGKILL nobody sent is usually the kernel's out-of-memory killer, so the memory the
    machine had left then is added)."""
    code = proc.exitcode
    if code is None:
        return f"{proc.name} (still running)"
    if code >= 0:
        return f"{proc.name} (exit code {code})"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    note = f"{proc.name} (killed by {name}"
    if -code == signal.SIGKILL:
        note += f"; {_memory_available()} available now"
    return note + ")"


def _memory_available() -> str:
    """The machine's available memory from /proc/meminfo ("unknown" where there is none)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown memory"


def _thread_count() -> int:
    """This process's OS threads (gloo's included); 0 where /proc is not available."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


class WorkerPool:
    """W long-lived ranks in one process group on ``device`` ("cpu", or an accelerator type)."""

    def __init__(self, world_size: int, *, pg_timeout_s: float = 60.0,
                 start_timeout_s: float = 120.0, device: str = "cpu") -> None:
        torch.device(device)  # an unknown device type fails here, in the caller
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        # Not "fork": forking this (test) process after it used OpenMP can hang the child. The
        # fork server is a clean process that only imports PRELOAD, so each worker starts with
        # torch and loom loaded (importing them cost ~3 s of CPU per worker, per pool start).
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        self._tmp = tempfile.TemporaryDirectory(prefix="loom-pool-")
        init_file = str(Path(self._tmp.name) / "rendezvous")
        self._logs = [_stderr_log(init_file, rank) for rank in range(world_size)]
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        saved = {k: os.environ.get(k) for k in WORKER_ENV}
        os.environ.update(WORKER_ENV)  # children read it before importing torch
        try:
            self._procs = [
                context.Process(target=_worker_loop, daemon=True, name=f"loom-rank{rank}",
                                args=(rank, world_size, init_file, self._tasks[rank],
                                      self._results, pg_timeout_s, device))
                for rank in range(world_size)
            ]
            for proc in self._procs:
                proc.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.alive = True
        self.tasks_run = 0
        self.threads = 0  # the most OS threads of any rank after the last task
        self._collect("start", start_timeout_s)

    def run(self, fn: Callable[..., Any], *args: Any, task_timeout_s: float = 300.0,
            **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank; the results in rank order."""
        if not self.alive:
            raise HarnessError("this pool was shut down after an earlier failure")
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        self.tasks_run += 1
        return self._collect(getattr(fn, "__qualname__", repr(fn)), task_timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        reports: dict[int, tuple[str, Any]] = {}
        threads_of: dict[int, int] = {}
        while len(reports) < self.world_size:
            remaining = deadline - time.monotonic()
            if any(status == "error" for status, _ in reports.values()):
                remaining = min(remaining, 5.0)  # peers of a failed rank may never answer
            dead = [_death_note(p) for p in self._procs if not p.is_alive()]
            try:
                rank, status, payload, threads = self._results.get(
                    timeout=max(0.05, min(remaining, 1.0)))
                reports[rank] = (status, payload)
                threads_of[rank] = threads
                continue
            except queue.Empty:
                pass
            if dead or time.monotonic() >= deadline:
                missing = sorted(set(range(self.world_size)) - set(reports))
                detail = "\n".join(f"--- rank {r}: {s}\n{p}" for r, (s, p) in sorted(reports.items())
                                   if s == "error")
                # The silent ranks left no traceback: quote what they printed (a native abort's
                # reason), before close() removes the logs.
                for r in missing:
                    tail = _log_tail(self._logs[r])
                    if tail:
                        detail += f"\n--- rank {r}: stderr (last lines)\n{tail}"
                self.close()
                cause = f"processes died: {dead}" if dead else f"timed out after {timeout_s:.0f} s"
                raise HarnessError(f"{what} on {self.world_size} ranks: {cause}; no answer from "
                                   f"ranks {missing}\n{detail}")
        errors = {r: p for r, (s, p) in reports.items() if s == "error"}
        if errors:
            self.close()
            detail = "\n".join(f"--- rank {r}:\n{p}" for r, p in sorted(errors.items()))
            raise HarnessError(f"{what} failed on ranks {sorted(errors)}:\n{detail}")
        self.threads = max(threads_of.values())
        return [reports[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        if not self.alive:
            return
        self.alive = False
        for tasks in self._tasks:
            try:
                tasks.put(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._tmp.cleanup()


class PoolRegistry:
    """One live ``WorkerPool`` per world size, created on first use and replaced after a failure,
    once a worker holds ``max_threads`` OS threads, or after ``max_tasks`` tasks.

    Why recycle: every task that builds a DeviceMesh creates process groups, each with its own
    gloo I/O threads, and torch's DTensor caches keep meshes (and so their groups) alive, so
    they cannot simply be destroyed between tasks. Idle, those threads still cost CPU, about 2%
    of a core per worker per 100 threads (measured at 4 ranks: 0.3% fresh, 5% at 215 threads, 9%
    at 425, 28% at 1265), paid by every idle pool of every world size while other tests run: with
    pools of 1, 2, 4 and 8 ranks that is 15 workers on a 2-core machine. A task adds from none to
    a few dozen threads per worker, so the thread count, not the number of tasks, says when to
    recycle; a fresh pool (forked, torch preloaded) starts in a fraction of a second.
    """

    def __init__(self, *, max_threads: int = 100, max_tasks: int = 50, **pool_kwargs: Any) -> None:
        self._pools: dict[int, WorkerPool] = {}
        self._pool_kwargs = pool_kwargs
        self.max_threads = max_threads
        self.max_tasks = max_tasks

    def pool(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is not None and pool.alive and (pool.threads >= self.max_threads
                                                or pool.tasks_run >= self.max_tasks):
            pool.close()
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = WorkerPool(world_size, **self._pool_kwargs)
        return pool

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self.pool(world_size).run(fn, *args, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
