"""The launcher side of CheckFree recovery: local workers of which only a lost one is replaced.

``loom train --fault.recovery=checkfree`` runs here instead of through torch's elastic agent
(``loom.launch``). The agent cannot be used: on any worker failure it stops *every* worker and
restarts the whole group (its restart unit is the worker group), so the survivors' in-memory
weights and optimizer state — all that CheckFree rebuilds from — would be lost. This launcher
instead:

* hosts the job's TCP store itself, so it outlives any worker; each generation of the job forms
  its process group under its own store prefix (``loom.train.checkfree``);
* starts one process per rank and watches them; when a middle pipeline stage's process dies by
  a signal (a real SIGKILL, the OOM killer, a lost node), it publishes the next generation (the
  dead rank, ``checkfree.failed_key``) in the store and starts a replacement process for that
  rank; the survivors, whose step failed on the dead peer, see the key, drop their group and
  form the new one with the replacement, which is rebuilt from its neighbours' weights;
* fails the job as ``loom.launch`` does (naming the rank) when a worker exits with an error,
  when the first or last stage dies (CheckFree cannot rebuild those), or on Ctrl-C.

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
from loom.train.checkfree import failed_key

POLL_S = 0.05
STOP_WAIT_S = 5.0


class RecoveryFailed(RuntimeError):
    """A worker failed in a way CheckFree does not recover; the message names the rank."""


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
    """One rank's process (spawned): connect to the launcher's store, then train."""
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
    ctx = mp.get_context("spawn")
    table = to_dict(config)

    def start(rank: int, generation: int) -> Any:
        proc = ctx.Process(target=_worker, name=f"loom-rank{rank}",
                           args=(table, str(run_dir), rank, nproc, store.port, generation))
        proc.start()
        return proc

    procs = {rank: start(rank, 0) for rank in range(nproc)}
    finished: set[int] = set()
    generation = 0
    try:
        while len(finished) < nproc:
            time.sleep(POLL_S)
            for rank, proc in list(procs.items()):
                code = proc.exitcode
                if code is None or rank in finished:
                    continue
                if code == 0:
                    finished.add(rank)
                    continue
                stage = rank  # one rank per stage (loom.config_rules._validate_fault)
                if code > 0:
                    raise RecoveryFailed(f"worker rank {rank} (stage {stage}) failed: exit code"
                                         f" {code} (its traceback is above)")
                how = f"killed by signal {-code}"
                if not 1 <= stage <= pp - 2:
                    raise RecoveryFailed(f"worker rank {rank} (stage {stage}) {how}: checkfree"
                                         " rebuilds middle stages only (the first and last need"
                                         " checkfree_plus, not built yet)")
                generation += 1
                store.set(failed_key(generation), str(rank))
                print(f"loom train: checkfree: worker rank {rank} (stage {stage}) {how};"
                      f" starting its replacement (generation {generation}), to be rebuilt"
                      f" from stages {stage - 1} and {stage + 1}", file=sys.stderr, flush=True)
                procs[rank] = start(rank, generation)
    except BaseException:
        _stop(procs)
        raise
    return generation


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
