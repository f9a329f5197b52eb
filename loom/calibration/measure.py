"""Measuring this machine for the planner (``loom plan --calibrate``): the part that runs torch,
local processes and Loom's trainer, so it lives above the planner, which only reads the profile.

``measure(nproc)`` starts ``nproc`` local processes (as a training job would) on a gloo group and
returns their raw measurements (``loom.plan.calibrate``'s docstring lists them);
``calibrate(nproc, path)`` then has ``loom.plan.calibrate.write_profile`` fit and store them.
Communication: the all-reduces it times, and the probes' training steps (``probes``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from loom.config import DataConfig
from loom.data.loader import prepare_data
from loom.models.layers import TransformerArgs, rope_tables
from loom.models.llama import TransformerBlock
from loom.plan.calibrate import (ALLREDUCE_BYTES, BLOCKS, OPTIMIZER_PARAMS, SMALLEST_DIMS,
                                 write_profile)
from loom.plan.probes import PROBE_DATA
from loom.train.distributed import init_distributed


def _median_time(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
        from loom.calibration.probes import run_probes  # imports the trainer (0.9 s)
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
            fields = {k.split(".", 1)[1]: v for k, v in PROBE_DATA.items()}
            fields["extensions"] = tuple(fields["extensions"].split(","))
            data_dir = os.path.join(tmp, "data")
            prepare_data(DataConfig(**fields), data_dir)
        mp.start_processes(_worker, args=(nproc, store, tmp, data_dir), nprocs=nproc,
                           join=True, start_method="spawn")
        return {rank: json.loads(Path(tmp, f"rank{rank}.json").read_text())
                for rank in range(nproc)}


def calibrate(nproc: int, path: str | Path | None = None, *, probes: bool = True) -> Path:
    """Measure, fit and store the profile; returns its path."""
    if nproc < 1:
        raise ValueError(f"--nproc {nproc}: must be >= 1")
    raw = measure(nproc, probes=probes)
    shared = float(cores()) if nproc > cores() else 0.0
    return write_profile(raw, nproc, path, cores_shared=shared)


__all__ = ["measure", "calibrate", "cores"]
