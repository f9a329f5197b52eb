"""``loom plan --calibrate``: measure this machine so the planner can price layouts on it.

Runs ``nproc`` local processes (as a training job would) and measures:

* on rank 0 alone, while the others wait (so on a core of its own): matmul throughput at several
  shapes whose smallest dimension d runs from 16 to 512, fitted to the cost model's
  ``rate(d) = R · d / (d + knee)`` by least squares on ``1/rate = 1/R + (knee/R) · 1/d``; memory
  bandwidth, from copying a 64 MiB buffer (read + write); and the fixed cost of one
  transformer-block pass, from forward + backward of Loom's own block at a size where its FLOPs
  are negligible (a third of it is charged to each of F, I and W); and one AdamW step, per
  parameter (torch's multi-tensor AdamW makes several passes over each state, about twice the
  time of the 28 bytes per parameter a fused kernel moves);
* the cores the processes share (their CPU affinity): with more ranks than cores the cost model
  slows compute by ranks / cores when all ranks compute, and the pipeline simulation shares the
  cores among the ranks busy at each instant;
* on every rank at once, collective latency and bandwidth on gloo: all-reduces of 4 KiB to
  4 MiB, fitted to the ring's ``2(n-1)·alpha + 2(n-1)/n · M / beta``;
* on every rank at once, the framework work of each parallel wrapper (``probes.py``): a small
  probe model trained by Loom's trainer under each wrapper, all stepped in one rotation, and
  what the cost model does not explain of its step charged to that wrapper.

The profile (JSON) becomes the catalog entries ``local-cpu`` (a ``Gpu`` with the measured R as
its peak and efficiency 1) and ``local`` (a ``Link``), which ``loom plan --gpu local`` uses.
Written with a temporary file and an atomic rename, so a failed run leaves the old profile.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import replace
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


def _worker(rank: int, world: int, store_path: str, out_dir: str, data_dir: str | None) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    result: dict = {"allreduce": {}}
    if rank == 0:
        result.update(_compute_alone(torch))
    dist.barrier()  # the others wait here, off the cores, while rank 0 measures
    for nbytes in ALLREDUCE_BYTES:
        buf = torch.zeros(nbytes // 4)
        dist.barrier()
        result["allreduce"][nbytes] = _median_time(lambda: dist.all_reduce(buf), reps=7)
    if data_dir is not None:
        from loom.plan.probes import run_probes
        from loom.train.distributed import init_distributed

        result["probes"] = run_probes(init_distributed("cpu", "gloo"), world, data_dir)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _sustained_time(fn, seconds: float = 0.2, loops: int = 3) -> float:
    """Seconds per call, the median over ``loops`` loops of about ``seconds`` each of the mean
    per call: what a training step sustains (the median of a few short calls reads a faster,
    warmer processor than a step sees), robust to one slow spell of a shared machine."""
    fn()  # warm-up
    means = []
    for _ in range(loops):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            took = time.perf_counter() - start
            if took >= seconds:
                means.append(took / calls)
                break
    return statistics.median(means)


# Loom blocks timed alone (dim, ffn, heads, kv heads, seq, micro-batch): the cost model's layer
# time is fitted to them with one factor (``fit``); the first is the tiny block whose FLOPs are
# negligible (the fixed cost per layer pass).
BLOCKS = ((8, 16, 2, 1, 4, 1), (128, 384, 8, 4, 128, 2), (256, 768, 8, 4, 256, 2),
          (512, 1536, 8, 4, 256, 2))


OPTIMIZER_PARAMS = 2 ** 21  # the AdamW probe: 8 MiB of fp32 parameters, past the caches


def _compute_alone(torch) -> dict:
    """Matmul curve, memory bandwidth and Loom's block forward + backward at ``BLOCKS``' sizes,
    on this process alone."""
    result: dict = {"matmul": {}, "blocks": []}
    big = 512
    for d in SMALLEST_DIMS:
        a, b = torch.randn(big, big), torch.randn(big, d)
        result["matmul"][d] = 2 * big * big * d / _sustained_time(lambda: torch.mm(a, b))
    src = torch.empty(16 * 2**20)  # 64 MiB of fp32
    dst = torch.empty_like(src)
    result["memory_bandwidth"] = 2 * src.numel() * 4 / _sustained_time(lambda: dst.copy_(src))

    from loom.models.llama import TransformerBlock
    from loom.models.layers import TransformerArgs, rope_tables

    for dim, ffn, heads, kv, seq, micro in BLOCKS:
        args = TransformerArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                               vocab_size=8, max_seq_len=seq)
        block = TransformerBlock(args)
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
        x = torch.randn(micro, seq, dim, requires_grad=True)
        cos, sin = rope_tables(args.head_dim, seq, args.rope_theta)

        def block_pass() -> None:
            block(x, cos, sin).sum().backward()

        result["blocks"].append([dim, ffn, heads, kv, seq, micro, _sustained_time(block_pass)])
    result["block_pass"] = result["blocks"][0][-1]
    # one AdamW step (multi-tensor, as the trainer builds it) over OPTIMIZER_PARAMS parameters
    params = [torch.nn.Parameter(torch.randn(OPTIMIZER_PARAMS // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    result["optimizer_per_param"] = _sustained_time(adamw.step) / OPTIMIZER_PARAMS
    return result


def cores() -> int:
    """Processors this process may run on (its affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def measure(nproc: int, *, probes: bool = True) -> dict:
    """Raw measurements of ``nproc`` processes (rank-wise, seconds and FLOP/s; rank 0 carries
    the compute measurements, every rank its collectives and probe times)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        data_dir = None
        if probes and nproc > 1:
            from loom.config import DataConfig
            from loom.data.loader import prepare_data
            from loom.plan.probes import PROBE_DATA

            fields = {k.split(".", 1)[1]: v for k, v in PROBE_DATA.items()}
            fields["extensions"] = tuple(fields["extensions"].split(","))
            data_dir = os.path.join(tmp, "data")
            prepare_data(DataConfig(**fields), data_dir)
        mp.start_processes(_worker, args=(nproc, store, tmp, data_dir), nprocs=nproc,
                           join=True, start_method="spawn")
        return {rank: json.loads(Path(tmp, f"rank{rank}.json").read_text())
                for rank in range(nproc)}


def fit(raw: dict, nproc: int, *, cores_shared: float = 0.0) -> tuple[Gpu, Link]:
    """The profile's ``Gpu`` and ``Link`` from ``measure``'s output: compute from the rank that
    measured it alone, collectives as medians over ranks, then the wrappers' framework work
    (when probed) against the cost model with those."""
    ranks = list(raw.values())
    alone = next(r for r in ranks if "matmul" in r)
    dims = [int(d) for d in alone["matmul"]]
    rates = [alone["matmul"][str(d)] if str(d) in alone["matmul"] else alone["matmul"][d]
             for d in dims]
    intercept, slope = _fit_line([1 / d for d in dims], [1 / r for r in rates])
    peak = 1 / intercept if intercept > 0 else max(rates)
    knee = max(slope * peak, 1e-3)
    bandwidth = alone["memory_bandwidth"]
    block = alone["block_pass"]
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
              gpus_per_node=nproc, op_overhead=block / 3, cores=cores_shared,
              optimizer_per_param=alone.get("optimizer_per_param", 0.0))
    link = Link("local", bandwidth=beta, latency=latency, efficiency=1.0)
    scale = layer_scale(gpu, link, alone.get("blocks", [])[1:])
    gpu = replace(gpu, peak_flops=gpu.peak_flops / scale, hbm_bandwidth=gpu.hbm_bandwidth / scale)
    if "probes" in ranks[0]:
        from loom.plan.probes import fit_framework

        gpu = replace(gpu, framework=fit_framework(ranks[0]["probes"], gpu, link, nproc))
    return gpu, link


def layer_scale(gpu: Gpu, link: Link, blocks: list) -> float:
    """The factor by which Loom's blocks, measured alone, take longer than the cost model's
    layer time from the matmul curve and the bandwidth (the geometric mean of measured minus the
    fixed per-pass cost over the priced FLOP and byte time, so every size weighs the same in
    relative terms; a plain least-squares fit would follow the largest block; 1 without
    measurements). It stands for what the curve misses on this machine: the attention kernel,
    norms and activations are slower than their matmul FLOPs and bytes suggest."""
    from loom.models.layers import TransformerArgs
    from loom.plan.hardware import Cluster
    from loom.sim.cost_model import CostModel
    from loom.sim.layout import Layout

    priced, measured = [], []
    plain = replace(gpu, op_overhead=0.0, cores=0.0, framework=())
    for dim, ffn, heads, kv, seq, micro, seconds in blocks:
        args = TransformerArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                               vocab_size=8, max_seq_len=seq)
        model = CostModel(args, seq, micro, Cluster(plain, 1, 1, link, link), dtype_bytes=4)
        f, i, w, _ = model._layer_times(Layout(micro_batch=micro), False)
        priced.append(f + i + w)
        measured.append(seconds - 3 * gpu.op_overhead)
    ratios = [m / p for p, m in zip(priced, measured) if p > 0 and m > 0]
    if not ratios:
        return 1.0
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def calibrate(nproc: int, path: str | Path | None = None, *, probes: bool = True) -> Path:
    """Measure, fit and store the profile; returns its path."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    raw = measure(nproc, probes=probes)
    shared = float(cores()) if nproc > cores() else 0.0
    gpu, link = fit(raw, nproc, cores_shared=shared)
    target = Path(path) if path else DEFAULT_PROFILE
    target.parent.mkdir(parents=True, exist_ok=True)
    profile = {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "nproc": nproc, "gpu": _as_dict(gpu), "link": _as_dict(link), "raw": raw}
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(target)
    return target


def describe(gpu: Gpu, link: Link) -> str:
    """A few lines a person can check: rates, cores, the link and each wrapper's work."""
    lines = [f"matmul {gpu.peak_flops * gpu.matmul_efficiency / 1e9:.1f} GFLOP/s per rank alone"
             f" (knee {gpu.matmul_knee:.1f}), memory {gpu.hbm_bandwidth / 1e9:.1f} GB/s,"
             f" {gpu.op_overhead * 1e6:.0f} us per layer pass",
             f"{gpu.gpus_per_node} ranks on " + (f"{gpu.cores:g} shared cores" if gpu.cores
                                                 else "a core each"),
             f"gloo: latency {link.latency * 1e6:.0f} us, {link.bandwidth / 1e9:.2f} GB/s"]
    for name, per_pass, per_step, *per_token in gpu.framework:
        lines.append(f"framework work of {name}: {per_pass * 1e3:.2f} ms per layer pass"
                     f" + {sum(per_token) * 1e9:.0f} ns per token, {per_step * 1e3:.1f} ms per"
                     " step")
    return "\n".join(lines)


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


__all__ = ["calibrate", "measure", "fit", "layer_scale", "describe", "load_profile",
           "DEFAULT_PROFILE"]
