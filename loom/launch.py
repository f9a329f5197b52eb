"""Starting the ranks of a job: N local workers through torch's elastic launcher, or this process
as one rank of a job that ``torchrun`` / ``srun`` started.

``loom train --nproc N`` runs ``torch.distributed.launcher.elastic_launch`` — the machinery behind
``torchrun`` — with a c10d rendezvous on localhost, so the one-process and N-process paths are the
same code and the same code runs multi-node under an external launcher (see ``examples/slurm``).
The elastic agent watches its workers: when one dies, it stops the others and raises
``ChildFailedError``, which ``run_job`` turns into a message naming the failed rank(s), so a crash
never leaves the job hanging. With ``--max-restarts N`` the agent instead restarts every worker
(up to N times); a restarted worker resumes from the newest complete checkpoint of the run
(``checkpoint.resume = auto`` is implied on a restart), so with a deterministic setup the final
weights equal an uninterrupted run's bit for bit.

Signals and hangs (``loom.supervise``, ``loom.train.preempt``, ``loom.train.watchdog``): SIGTERM to
the launcher or to any worker makes every rank stop at the same step, checkpoint and exit 0 within
``train.preempt_grace_s``; Ctrl-C exits 130 with one line and no worker left behind; a collective
that times out names the rank that never arrived, and that rank is killed at once.

Everything that can be wrong with the config is checked before this module is reached (the run
directory by ``check_run_dir``, which writes nothing); the token files and then the run's
``config.toml`` are made here, in the launching process, before any worker starts. A launch
that fails before it saves a checkpoint puts the directory's earlier ``config.toml`` back
(``config_kept_unless_checkpointed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from loom.cluster import Cluster
from loom.config import Config, ConfigError, from_dict, to_dict, to_toml
from loom.data.loader import prepare_data
from loom.emulate import CLUSTER_ENV, COMPUTE_ENV, NAMESPACE_ENV, EmulatedNetwork, \
    EmulationUnavailable, compute_speeds
from loom.relaunch import RecoveryFailed, check_recovery_layout, launch_checkfree
from loom.supervise import INTERRUPT_WAIT_S, Interrupted, Supervisor
from loom.train import preempt, watchdog
from loom.train.distributed import init_distributed

THREAD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# Workers are forked from a server process that has imported these once (multiprocessing's
# forkserver, preloaded), instead of each spawning an interpreter that imports torch and the
# trainer again: 3-4 s of CPU per worker, which N workers on a few cores pay N times over at
# every launch and restart. The server imports and never computes, so it starts no OpenMP,
# CUDA or gloo state for the fork to copy.
WORKER_MODULES = ["loom.launch", "loom.train.trainer"]
# Loom's own variables a launch sets for its workers (emulation). They travel as
# ``worker_main``'s argument, not through the launcher's environment: a fork server's children
# inherit the server's environment, fixed when it started (possibly by an earlier launch)
LAUNCH_ENV = (NAMESPACE_ENV, COMPUTE_ENV, CLUSTER_ENV)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


def under_external_launcher() -> bool:
    """True when torchrun / torch elastic / Slurm-with-torchrun already made this process a rank."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def _name_process(name: str) -> None:
    """Show the rank in ``ps`` / ``top`` (Linux; best effort, 15 characters at most)."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass


def check_run_dir(run_dir: Path) -> None:
    """ConfigError naming ``train.run_dir`` unless the run directory is one or can be made:
    not a file, not under a file, on a writable directory and file system (``os.access``, which
    also holds for root), without a ``config.toml`` or ``data`` of the wrong kind. Writes
    nothing."""
    def refuse(rule: str) -> None:
        raise ConfigError("train.run_dir", str(run_dir), rule)

    if os.path.lexists(run_dir) and not run_dir.exists():
        refuse("is a broken symbolic link")
    if run_dir.exists():
        if not run_dir.is_dir():
            refuse("exists and is not a directory")
        for name, want_dir in (("config.toml", False), ("data", True)):
            entry = run_dir / name
            if entry.exists() and entry.is_dir() != want_dir:
                refuse(f"holds {name!r}, which is {'not ' if want_dir else ''}a directory")
        existing = run_dir
    else:
        existing = run_dir.parent
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            refuse(f"lies under {str(existing)!r}, which is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK) or _read_only(existing):
        refuse(f"cannot be written: {str(existing)!r} is not writable")


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def prepare_run_dir(config: Config, run_dir: Path, *, is_main: bool = True) -> Path:
    """Write the token files and the resolved config of the run (idempotent); return the data
    dir. The data comes first: a corpus too short for one sample raises ConfigError, and then
    the directories this call made are removed, so a refused run leaves nothing behind."""
    data_dir = run_dir / "data"
    if is_main:
        made = data_dir  # the outermost directory this call creates, if any
        while not made.parent.exists() and made.parent != made.parent.parent:
            made = made.parent
        made = None if made.exists() else made
        try:
            try:  # the first write: a path check_run_dir cannot foresee (under /proc, a race)
                data_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError("train.run_dir", str(run_dir),
                                  f"cannot be created: {err.strerror}") from None
            prepare_data(config.data, data_dir)
        except ConfigError:
            if made is not None:
                shutil.rmtree(made, ignore_errors=True)
            raise
        tmp = run_dir / "config.toml.tmp"
        tmp.write_text(to_toml(config))
        os.replace(tmp, run_dir / "config.toml")
    return data_dir


@contextlib.contextmanager
def config_kept_unless_checkpointed(run_dir: Path) -> Iterator[None]:
    """A launch that fails or is interrupted before it saves a checkpoint leaves the run
    directory's ``config.toml`` as it found it: the earlier run's, which that run's checkpoints
    belong to, or none. ``prepare_run_dir`` writes the new one before the workers start, so a
    start that fails inside them (a cause no pre-launch check foresaw) would otherwise leave a
    config that describes no checkpoint in the directory. Once the launch has saved a
    checkpoint, the new config is the one that describes it, and it stays."""
    path = run_dir / "config.toml"
    before = path.read_bytes() if path.is_file() else None
    saved = _checkpoint_names(run_dir)
    try:
        yield
    except BaseException:
        if _checkpoint_names(run_dir) == saved:
            if before is None:
                path.unlink(missing_ok=True)
            else:
                tmp = run_dir / "config.toml.tmp"
                tmp.write_bytes(before)
                os.replace(tmp, path)
        raise


def _checkpoint_names(run_dir: Path) -> set[str]:
    """The entries of the run's checkpoint directory (none when it has none)."""
    try:
        return set(os.listdir(run_dir / "checkpoints"))
    except OSError:
        return set()


def apply_launch_env(launch_env: dict[str, str]) -> None:
    """Set this process's ``LAUNCH_ENV`` variables to the launch's: those it set, and none it
    did not (a fork server started by an earlier launch may have left them in the environment
    its workers inherit)."""
    for key in LAUNCH_ENV:
        if key in launch_env:
            os.environ[key] = launch_env[key]
        else:
            os.environ.pop(key, None)


@record  # torch elastic's error recorder: a worker's traceback reaches the launcher's message
def worker_main(config_table: dict[str, Any], run_dir: str,
                launch_env: dict[str, str] | None = None) -> dict[str, float]:
    """Entry point of every rank: build the Trainer and run it to the end. ``launch_env``: the
    ``LAUNCH_ENV`` variables the launch set (an absent one is unset here)."""
    import torch.distributed as dist

    from loom.train.trainer import Trainer  # 0.9 s of imports (DCP, FSDP2): workers only

    preempt.install_handlers()  # first: SIGINT quiet, SIGTERM a checkpoint once training starts
    if launch_env is not None:
        apply_launch_env(launch_env)
    watchdog.register(run_dir, int(os.environ.get("RANK", "0")))  # the launcher signals this pid
    config = from_dict(config_table)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and not config.checkpoint.resume:
        # a restarted worker continues from the newest valid checkpoint (none yet: step 0)
        config.checkpoint.resume = "auto_or_fresh"
    tr = config.train
    ctx = init_distributed(tr.device, tr.backend, tr.timeout_s, tr.threads)
    _name_process(f"loom-rank{ctx.rank}")
    try:
        if under_external_launcher():  # no parent prepared the run: local rank 0 of each node does
            prepare_run_dir(config, Path(run_dir), is_main=ctx.local_rank == 0)
            dist.barrier()
        trainer = Trainer(config, Path(run_dir) / "data", run_dir, ctx)
        preempt.arm()  # a SIGTERM from now on asks for a checkpoint at the next step
        metrics = trainer.fit()
        preempt.finished()  # a SIGTERM during the teardown has nothing left to stop
        return metrics
    finally:
        dist.destroy_process_group()


def launch_local(config: Config, run_dir: Path, nproc: int, max_restarts: int = 0,
                 emulate: Cluster | None = None) -> dict[str, float]:
    """Run ``nproc`` workers on this machine; return rank 0's final metrics.

    ``emulate``: run the workers on an emulated network of that cluster (``loom.emulate``: one
    namespace per rank, its links shaped), made before the workers start and removed after.

    Raises ``WorkerFailed`` naming the rank(s) when any worker fails (or a hung rank, or that a
    preemption ran out of time), ``Interrupted`` on Ctrl-C.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for key, value in THREAD_ENV.items():
        os.environ.setdefault(key, value)
    run_id = f"loom-{uuid.uuid4().hex[:8]}"
    # SIGTERM and SIGINT are the Supervisor's (graceful preemption, quiet Ctrl-C); the agent
    # keeps the rest. Its shutdown wait is then only the one after a Ctrl-C (torch < 2.13 has no
    # shutdown_timeout: its agent's own default wait applies).
    optional = {"signals_to_handle": "SIGHUP,SIGQUIT", "shutdown_timeout": INTERRUPT_WAIT_S}
    known = {field.name for field in dataclasses.fields(LaunchConfig)}
    launch_config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts, monitor_interval=0.2,
        start_method="forkserver",
        **{key: value for key, value in optional.items() if key in known},
    )
    multiprocessing.set_forkserver_preload(WORKER_MODULES)
    watchdog.clear(run_dir)
    grace = config.train.preempt_grace_s
    network = EmulatedNetwork(emulate) if emulate is not None else contextlib.nullcontext()
    with Supervisor(run_dir, run_id, grace) as supervisor, network:
        launch_env: dict[str, str] = {}  # ``worker_main`` sets these (and unsets the others)
        if emulate is not None:  # each worker's namespace and speed, and the cluster
            launch_env = {NAMESPACE_ENV: network.prefix, COMPUTE_ENV: compute_speeds(emulate),
                          CLUSTER_ENV: emulate.to_toml()}  # skippipe plans its paths for it
            print(f"loom train: {network.describe()}", file=sys.stderr)
        try:
            results = elastic_launch(launch_config, worker_main)(to_dict(config), str(run_dir),
                                                                 launch_env)
        except ChildFailedError as err:
            raise WorkerFailed(_describe_failures(err, supervisor.hang)) from None
        except SignalException as err:
            if supervisor.interrupted:
                raise
            if supervisor.grace_expired:
                raise WorkerFailed(f"preempted (SIGTERM), but the workers did not checkpoint and"
                                   f" stop within train.preempt_grace_s = {grace:g} s; they were"
                                   " killed") from None
            raise WorkerFailed(f"stopped by {err.sigval.name}; the workers were stopped") from None
    return results[0]


class WorkerFailed(RuntimeError):
    """One or more ranks failed; the message names them and their error."""


def _describe_failures(err: Any, hang: dict[str, Any] | None = None) -> str:
    if hang is not None:  # a collective timed out: who never arrived, not gloo's timeout text
        return (f"hung rank: {hang['message']}\nreported by rank {hang['reporter']} after its"
                f" collective timed out ({hang['waited_s']:.0f} s); the hung rank was killed and"
                " the other workers were stopped")
    lines = []
    for rank, failure in sorted(err.failures.items()):
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        message = (message or "").strip()
        detail = message.splitlines()[-1] if message else f"exit code {failure.exitcode}"
        if failure.exitcode is not None and failure.exitcode < 0:
            detail = f"killed by signal {-failure.exitcode}"
        lines.append(f"worker rank {rank} (local rank {failure.local_rank}) failed: {detail}")
    lines.append("the other workers were stopped")
    return "\n".join(lines)


def refuse_checkfree_launch(config: Config, max_restarts: int, emulate: Cluster | None) -> None:
    """ConfigError unless this launch can run ``fault.recovery`` = checkfree: local workers
    started by ``loom.relaunch`` (not torchrun: it owns the processes), without --max-restarts
    (the other recovery) or --emulate, and a partition of equal stages. Writes nothing."""
    recovery = config.fault.recovery
    if under_external_launcher():
        raise ConfigError("fault.recovery", recovery, "needs loom's own local launcher (loom train"
                          " --nproc N): under torchrun or Slurm the external launcher owns the"
                          " processes and cannot replace one")
    if max_restarts:
        raise ConfigError("--max-restarts", max_restarts, f"restarts every worker from a"
                          f" checkpoint; it cannot be combined with fault.recovery={recovery}")
    if emulate is not None:
        raise ConfigError("--emulate", True, f"is not combined with fault.recovery={recovery}"
                          " yet")
    check_recovery_layout(config)


def run_job(config: Config, run_dir: Path, nproc: int, max_restarts: int = 0,
            emulate: Cluster | None = None) -> int:
    """Run training and return a process exit code (0 ok or preempted and checkpointed, 1 a
    worker failed, 130 interrupted); ``emulate``: on that cluster's emulated network."""
    try:
        if config.fault.recovery != "checkpoint":  # CheckFree: loom.relaunch, not the agent
            refuse_checkfree_launch(config, max_restarts, emulate)
            with config_kept_unless_checkpointed(run_dir):
                prepare_run_dir(config, run_dir)
                launch_checkfree(config, run_dir, nproc)
            return 0
        if under_external_launcher():
            worker_main(to_dict(config), str(run_dir))
            return 0
        with config_kept_unless_checkpointed(run_dir):
            prepare_run_dir(config, run_dir)
            launch_local(config, run_dir, nproc, max_restarts, emulate)
    except EmulationUnavailable as err:
        print(f"loom train: --emulate: {err}", file=sys.stderr)
        return 1
    except (WorkerFailed, RecoveryFailed) as err:
        print(f"loom train: {err}", file=sys.stderr)
        return 1
    except (Interrupted, KeyboardInterrupt):
        print("loom train: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
