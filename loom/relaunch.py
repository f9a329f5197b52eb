"""The launcher side of CheckFree recovery: local workers of which only a lost one is replaced.

``loom train --fault.recovery=checkfree|checkfree_plus`` runs here instead of through torch's
elastic agent
(``loom.launch``). The agent cannot be used: on any worker failure it stops *every* worker and
restarts the whole group (its restart unit is the worker group), so the survivors' in-memory
weights and optimizer state — all that CheckFree rebuilds from — would be lost. This launcher
instead:

* hosts the job's TCP store itself, so it outlives any worker; each generation of the job forms
  its process group under its own store prefix (``loom.train.checkfree``);
* starts one process per rank and watches them; when the process of a stage the mode rebuilds
  (a middle stage; under checkfree_plus any stage) dies by a signal (a real SIGKILL, the OOM
  killer, a lost node), it publishes the next generation (the
  dead rank, ``checkfree.failed_key``) in the store and starts a replacement process for that
  rank; the survivors, whose step failed on the dead peer, see the key, drop their group and
  form the new one with the replacement, which is rebuilt from its neighbours' weights
  (``loom.train.checkfree.recovery_sources``);
* treats a hung worker as a lost one: a survivor whose collective times out
  (``train.timeout_s``) writes the watchdog's diagnosis naming the rank it waited for
  (``loom.train.watchdog``); the launcher SIGKILLs that rank's process (a stopped process cannot
  even honour a SIGTERM) and replaces it as if it had died, so a frozen node costs one timeout,
  not the job;
* fails the job as ``loom.launch`` does (naming the rank) when a worker exits with an error,
  when a stage the mode cannot rebuild dies or hangs (the first or last stage under checkfree;
  checkfree_plus rebuilds every stage), or on Ctrl-C;
* on SIGTERM (a scheduler or a user stopping the launcher) stops every worker (SIGTERM, then
  SIGKILL after ``STOP_WAIT_S``) and fails with "stopped by SIGTERM": no worker outlives it.

Before any process starts, ``check_recovery_layout`` refuses (exit 2) a partition whose stages
hold different numbers of transformer blocks: a stage is averaged block by block from its
neighbours, so their blocks must line up.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from loom.config import Config, ConfigError, from_dict, model_args, to_dict
from loom.pipeline.partition import partition_model
from loom.train import watchdog
from loom.train.checkfree import failed_key, recoverable, recovery_sources

POLL_S = 0.05
STOP_WAIT_S = 5.0


class RecoveryFailed(RuntimeError):
    """A worker failed in a way CheckFree does not recover; the message names the rank."""


class LauncherStopped(RecoveryFailed):
    """The launcher itself was told to stop (SIGTERM); every worker was stopped."""


def check_recovery_layout(config: Config) -> None:
    """ConfigError naming ``fault.recovery`` unless every pipeline stage holds the same number of
    transformer blocks (the partition the trainer will use). Writes nothing."""
    par = config.parallel
    ranges = partition_model(model_args(config), par.pp, config.data.seq_len)
    counts = [len(r) for r in ranges]
    if len(set(counts)) != 1:
        raise ConfigError("fault.recovery", config.fault.recovery,
                          f"rebuilds a stage block by block from its neighbours, so every stage"
                          f" must hold the same number of blocks; model.n_layers ="
                          f" {config.model.n_layers} over parallel.pp = {par.pp} gives {counts}"
                          " (choose n_layers and pp so the split is even)")


def _worker(config_table: dict[str, Any], run_dir: str, rank: int, world_size: int,
            store_port: int, generation: int) -> None:
    """One rank's process (forked from the preloaded server): connect to the launcher's store,
    then train."""
    from loom.train.checkfree_worker import run_worker  # the trainer (0.9 s): workers only

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        Path("/proc/self/comm").write_text(f"loom-rank{rank}"[:15])
    except OSError:
        pass
    config = from_dict(config_table)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=config.train.timeout_s))
    try:
        run_worker(config, Path(run_dir), store, rank, world_size, generation,
                   log=lambda line: print(line, file=sys.stderr, flush=True))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def launch_checkfree(config: Config, run_dir: Path, nproc: int) -> int:
    """Run ``nproc`` local workers with CheckFree recovery; return the number of recoveries.
    Raises ``RecoveryFailed`` naming the rank when a failure is not recoverable."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    pp = config.parallel.pp
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=config.train.timeout_s))
    # forked from a server that imported the worker's modules once (as ``loom.launch`` does):
    # a replacement starts in a fraction of a second instead of importing torch again
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["loom.relaunch", "loom.train.checkfree_worker"])
    table = to_dict(config)

    started: dict[int, float] = {}  # rank -> when its current process was started

    def start(rank: int, generation: int) -> Any:
        proc = ctx.Process(target=_worker, name=f"loom-rank{rank}",
                           args=(table, str(run_dir), rank, nproc, store.port, generation))
        started[rank] = time.time()
        proc.start()
        return proc

    def on_signal(signum: int, _frame: Any) -> None:
        raise LauncherStopped(f"stopped by {signal.Signals(signum).name}; every worker was"
                              " stopped (no checkpoint is written under checkfree)")

    recovery = config.fault.recovery
    watchdog.clear(run_dir)
    previous = signal.signal(signal.SIGTERM, on_signal)
    procs: dict[int, Any] = {}
    try:
        procs.update({rank: start(rank, 0) for rank in range(nproc)})
        finished: set[int] = set()
        hung: dict[int, str] = {}  # rank -> the diagnosis that named it, until it is replaced
        generation = 0
        while len(finished) < nproc:
            time.sleep(POLL_S)
            _reap_hung(run_dir, procs, started, hung, recovery)
            for rank, proc in list(procs.items()):
                code = proc.exitcode
                if code is None or rank in finished:
                    continue
                if code == 0:
                    finished.add(rank)
                    continue
                stage = rank  # one rank per stage (loom.config_rules.pipeline.validate_fault)
                if code > 0:
                    raise RecoveryFailed(f"worker rank {rank} (stage {stage}) failed: exit code"
                                         f" {code} (its traceback is above)")
                how = (f"hung ({hung.pop(rank)}) and was killed" if rank in hung
                       else f"killed by signal {-code}")
                if not recoverable(recovery, stage, pp):
                    raise RecoveryFailed(f"worker rank {rank} (stage {stage}) {how}: {recovery}"
                                         f" rebuilds stages 1..{pp - 2} only (the first and last"
                                         " need checkfree_plus)")
                generation += 1
                store.set(failed_key(generation), str(rank))
                sources = " and ".join(map(str, recovery_sources(recovery, stage, pp)))
                print(f"loom train: {recovery}: worker rank {rank} (stage {stage}) {how};"
                      f" starting its replacement (generation {generation}), to be rebuilt"
                      f" from stage{'s' if ' and ' in sources else ''} {sources}",
                      file=sys.stderr, flush=True)
                procs[rank] = start(rank, generation)
    except BaseException:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping: a second SIGTERM waits
        _stop(procs)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return generation


def _reap_hung(run_dir: Path, procs: dict[int, Any], started: dict[int, float],
               hung: dict[int, str], recovery: str) -> None:
    """SIGKILL the live workers that a survivor's watchdog diagnosis (written after its
    collective timed out) names as hung, recording them in ``hung``; each diagnosis is read
    once and removed. A diagnosis older than the named rank's current process is about the
    process it replaced (several survivors time out on the same hung rank), so it kills
    nothing."""
    for found in watchdog.read_diagnoses(run_dir):
        for culprit in found.get("culprits", []):
            proc = procs.get(int(culprit))
            if (proc is None or proc.exitcode is not None or int(culprit) in hung
                    or found.get("time", 0.0) < started.get(int(culprit), 0.0)):
                continue
            hung[int(culprit)] = found.get("message", "named by the watchdog")[:300]
            print(f"loom train: {recovery}: worker rank {culprit} stopped responding (rank"
                  f" {found.get('reporter')}'s collective timed out waiting for it); killing"
                  " it", file=sys.stderr, flush=True)
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except OSError:
                pass  # it exited meanwhile: its exit code tells
        watchdog.diagnosis_file(run_dir, int(found["reporter"])).unlink(missing_ok=True)


def _stop(procs: dict[int, Any]) -> None:
    """SIGTERM the live workers, then SIGKILL what is left after ``STOP_WAIT_S``."""
    for proc in procs.values():
        if proc.exitcode is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_WAIT_S
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
