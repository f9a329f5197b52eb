"""``loom plan --calibrate``: measure this machine so the planner can price layouts on it.

Runs ``nproc`` local processes at once (as a training job would: they share the cores) and
measures, on every rank concurrently:

* matmul throughput at several shapes whose smallest dimension d runs from 16 to 512; the rates
  are fitted to the cost model's ``rate(d) = R · d / (d + knee)`` by least squares on
  ``1/rate = 1/R + (knee/R) · 1/d``;
* memory bandwidth, from copying a 64 MiB buffer (read + write);
* the fixed cost of one transformer-block pass, from forward + backward of Loom's own block at a
  size where its FLOPs are negligible (framework and kernel-launch overhead; a third of it is
  charged to each of F, I and W);
* collective latency and bandwidth among the processes on gloo: all-reduces of 4 KiB to 4 MiB,
  fitted to the ring's ``2(n-1)·alpha + 2(n-1)/n · M / beta``.

The profile (JSON) becomes the catalog entries ``local-cpu`` (a ``Gpu`` with the measured R as
its peak and efficiency 1) and ``local`` (a ``Link``), which ``loom plan --gpu local`` uses.
Written with a temporary file and an atomic rename, so a failed run leaves the old profile.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from loom.plan.hardware import Gpu, Link

DEFAULT_PROFILE = Path.home() / ".cache" / "loom" / "local.json"
SMALLEST_DIMS = (16, 32, 64, 128, 256, 512)
ALLREDUCE_BYTES = (4096, 65536, 262144, 1048576, 4194304)


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def _worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    result: dict = {"matmul": {}, "allreduce": {}}
    big = 512
    for d in SMALLEST_DIMS:
        a, b = torch.randn(big, big), torch.randn(big, d)
        dist.barrier()
        t = _median_time(lambda: torch.mm(a, b), reps=9)
        result["matmul"][d] = 2 * big * big * d / t
    src = torch.empty(16 * 2**20)  # 64 MiB of fp32
    dst = torch.empty_like(src)
    dist.barrier()
    result["memory_bandwidth"] = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src), 5)

    from loom.models.llama import TransformerArgs, TransformerBlock, rope_tables

    args = TransformerArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=8,
                           max_seq_len=4)
    block = TransformerBlock(args)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    x = torch.randn(1, 4, 8, requires_grad=True)
    cos, sin = rope_tables(args.head_dim, 4, args.rope_theta)

    def block_pass() -> None:
        block(x, cos, sin).sum().backward()

    dist.barrier()
    result["block_pass"] = _median_time(block_pass, reps=31)
    for nbytes in ALLREDUCE_BYTES:
        buf = torch.zeros(nbytes // 4)
        dist.barrier()
        result["allreduce"][nbytes] = _median_time(lambda: dist.all_reduce(buf), reps=7)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(nproc: int) -> dict:
    """Raw measurements of ``nproc`` concurrent processes (rank-wise, seconds and FLOP/s)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(nproc, store, tmp), nprocs=nproc, join=True,
                           start_method="spawn")
        return {rank: json.loads(Path(tmp, f"rank{rank}.json").read_text())
                for rank in range(nproc)}


def fit(raw: dict, nproc: int) -> tuple[Gpu, Link]:
    """The profile's ``Gpu`` and ``Link`` from ``measure``'s output (medians over ranks)."""
    ranks = list(raw.values())
    dims = [int(d) for d in ranks[0]["matmul"]]
    rates = [statistics.median(r["matmul"][str(d)] if str(d) in r["matmul"] else r["matmul"][d]
                               for r in ranks) for d in dims]
    intercept, slope = _fit_line([1 / d for d in dims], [1 / r for r in rates])
    peak = 1 / intercept if intercept > 0 else max(rates)
    knee = max(slope * peak, 1e-3)
    bandwidth = statistics.median(r["memory_bandwidth"] for r in ranks)
    block = statistics.median(r["block_pass"] for r in ranks)
    sizes = [int(s) for s in ranks[0]["allreduce"]]
    times = [statistics.median(r["allreduce"][str(s)] if str(s) in r["allreduce"]
                               else r["allreduce"][s] for r in ranks) for s in sizes]
    a, b = _fit_line([float(s) for s in sizes], times)
    n = max(nproc, 2)
    latency = max(a / (2 * (n - 1)), 1e-7)
    beta = 2 * (n - 1) / n / b if b > 0 else 1e12
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(nproc, 1)
    gpu = Gpu("local-cpu", peak_flops=peak, memory_bytes=memory, hbm_bandwidth=bandwidth,
              matmul_efficiency=1.0, matmul_knee=knee, intra="local", inter="local",
              gpus_per_node=nproc, op_overhead=block / 3)
    return gpu, Link("local", bandwidth=beta, latency=latency, efficiency=1.0)


def calibrate(nproc: int, path: str | Path | None = None) -> Path:
    """Measure, fit and store the profile; returns its path."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    raw = measure(nproc)
    gpu, link = fit(raw, nproc)
    target = Path(path) if path else DEFAULT_PROFILE
    target.parent.mkdir(parents=True, exist_ok=True)
    profile = {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "nproc": nproc, "gpu": _as_dict(gpu), "link": _as_dict(link), "raw": raw}
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(target)
    return target


def _as_dict(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def load_profile(path: str | Path | None = None) -> tuple[Gpu, Link]:
    """The calibrated ``Gpu`` and ``Link`` (``loom plan --gpu local``)."""
    from loom.plan.hardware import HardwareError

    target = Path(path) if path else DEFAULT_PROFILE
    if not target.is_file():
        raise HardwareError(f"--gpu local: no calibration profile at {target}; run"
                            " `loom plan --calibrate --nproc N` first")
    data = json.loads(target.read_text())
    return Gpu(**data["gpu"]), Link(**data["link"])


__all__ = ["calibrate", "measure", "fit", "load_profile", "DEFAULT_PROFILE"]
