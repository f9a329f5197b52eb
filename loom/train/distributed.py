"""Process-level setup of one rank: device, backend, threads and the default process group.

A rank learns who it is from the environment that torch's elastic launcher (``loom train``,
``torchrun``) or Slurm sets: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and the
rendezvous address. The device and backend come from the config: ``auto`` picks CUDA + NCCL when a
GPU is present, else CPU + gloo, so the same code runs on both unchanged.

The default process group exists only because torch's DeviceMesh builds its sub-groups from it;
Loom's own code never uses it implicitly — groups are taken from the mesh and passed explicitly.

Under an emulated cluster (``loom train --cluster FILE --emulate``, ``loom.emulate``) the launcher
names a network-namespace prefix in ``LOOM_EMULATED_NETNS``: each rank joins its namespace after
connecting to the rendezvous store and before gloo opens its sockets, and ``DistContext.cluster``
is the cluster itself (``LOOM_EMULATED_CLUSTER``), which SkipPipe's path scheduler plans on.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loom.cluster import Cluster
from loom.emulate import CLUSTER_ENV, COMPUTE_ENV, INTERFACE, NAMESPACE_ENV, cluster_of, \
    compute_speed_of, enter_namespace


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    # Emulated heterogeneous node (``loom.emulate``): this rank's compute runs at this fraction
    # of its real speed; 1.0 everywhere else.
    compute_speed: float = 1.0
    # The emulated cluster (``CLUSTER_ENV``: node i is rank i), for what plans on it (SkipPipe's
    # path scheduler); None outside an emulation.
    cluster: Cluster | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(device: str, local_rank: int) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when a GPU is present, else ``cpu``."""
    if device == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def device_refusal(device: str, backend: str, local_ranks: int) -> tuple[str, str] | None:
    """``(field, rule)`` when this machine cannot give each of its ``local_ranks`` ranks the
    device ``train.device`` names, or run ``train.backend`` on it; else None. Checked before
    the launch: a worker finds out only after the run directory is written (a CPU build of
    torch has no ``_cuda_setDevice``; a gloo-only one no NCCL)."""
    first = resolve_device(device, 0)
    if first.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        highest = first.index if device.startswith("cuda:") else local_ranks - 1
        if highest >= count:
            have = f"{count} visible" if count else "none (no CUDA device, or a CPU build of torch)"
            return ("train.device", f"needs CUDA device {highest} on this machine"
                    f" ({'cuda:N' if device.startswith('cuda:') else 'one per local rank'});"
                    f" it has {have}")
    chosen = resolve_backend(backend, first)
    if chosen == "nccl" and not (first.type == "cuda" and dist.is_nccl_available()):
        why = "NCCL communicates CUDA tensors" if first.type != "cuda" else \
            "this build of torch has no NCCL"
        return ("train.backend", f"cannot be nccl here: {why}; use gloo")
    return None


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


def set_cpu_threads(threads: int, local_world_size: int) -> int:
    """One pool of intra-op threads per rank that together fill, never oversubscribe, the cores.

    Oversubscribed OpenMP threads make multi-rank CPU steps 15-30x slower on small machines.
    """
    if threads <= 0:
        threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    torch.set_num_threads(threads)
    return threads


def init_distributed(device: str = "auto", backend: str = "auto", timeout_s: float = 600.0,
                     threads: int = 0) -> DistContext:
    """Initialise this rank from the launcher's environment (or reuse an existing group).

    Without launcher variables this is a world of one: the one-process path is the same code.
    """
    env = os.environ
    rank = int(env.get("RANK", 0))
    world_size = int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world_size = int(env.get("LOCAL_WORLD_SIZE", 1))
    if dist.is_initialized():  # e.g. the test harness's long-lived workers
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank, local_world_size = rank, world_size
    dev = resolve_device(device, local_rank)
    if dev.type == "cpu":
        set_cpu_threads(threads, local_world_size)
    elif dev.type == "cuda":
        torch.cuda.set_device(dev)
    chosen_backend = resolve_backend(backend, dev)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in env:  # a plain one-process run outside any launcher
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(_free_port()))
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _restart_store(env, rank, world_size, timeout)
        if NAMESPACE_ENV in env:  # an emulated cluster (loom.emulate): this rank's namespace
            # The store's socket is made here, in the launcher's namespace (it stays there);
            # gloo's sockets, made by init_process_group, in the rank's.
            store = store or _store(env, rank, world_size, timeout)
            enter_namespace(f"{env[NAMESPACE_ENV]}{rank}")
            env["GLOO_SOCKET_IFNAME"] = INTERFACE
        dist.init_process_group(
            chosen_backend, rank=rank, world_size=world_size, timeout=timeout, store=store,
            device_id=dev if dev.type == "cuda" else None,
        )
    else:
        chosen_backend = dist.get_backend()
    speed = compute_speed_of(env[COMPUTE_ENV], rank) if COMPUTE_ENV in env else 1.0
    cluster = cluster_of(env[CLUSTER_ENV]) if CLUSTER_ENV in env else None
    if cluster is not None:
        cluster.check_world(world_size, CLUSTER_ENV)
    return DistContext(rank, world_size, local_rank, local_world_size, dev, chosen_backend, speed,
                       cluster)


def _restart_store(env, rank: int, world_size: int, timeout: datetime.timedelta):
    """After an elastic restart, a store whose keys cannot collide with the failed attempt's.

    The elastic agent keeps its TCP store across restarts (``TORCHELASTIC_USE_AGENT_STORE``), so
    a restarted rank could read the *dead* attempt's gloo addresses before its peers overwrite
    them and fail with "connection refused" (seen here, depending on start-up order). A prefix
    per attempt makes each attempt's keys its own. None on the first attempt: torch's default.
    """
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or "MASTER_ADDR" not in env:
        return None
    return dist.PrefixStore(f"loom/attempt_{attempt}", _store(env, rank, world_size, timeout))


def _store(env, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store ``env://`` would make: the elastic agent's, or rank 0's own."""
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size,
                         is_master=not agent_store and rank == 0, timeout=timeout,
                         multi_tenant=not agent_store)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
