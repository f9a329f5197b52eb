"""Benchmark: the price of Zeppelin's remapping all-to-alls in linear flops per byte (issue 17).

``loom.parallel.zeppelin_placement.REMAP_BYTE_FLOPS`` prices a byte a rank sends or receives in
the remapping layer's all-to-alls (``data.zeppelin_remap``) as that many flops of the linear
modules, so that the placement can weigh moving tokens against balancing their work. It was set
from two rough figures (gloo ~1 GB/s, one CPU thread ~40 GFLOP/s). This script measures both on
the machine it runs on, the way the trainer meets them:

* the linear modules' rate: one thread's fp32 matmul of ``--tokens`` rows through a
  ``dim x dim`` and a ``dim x ffn`` weight, forward shapes of the tiny preset by default (median
  over repeats, flops = 2 x rows x in x out);
* the all-to-all's rate: ``--ranks`` gloo processes on this machine (one thread each), each
  calling ``all_to_all_single`` with ``--tokens`` rows of the remap's width ((2 dim + 2 kv)
  fp32 values, q, k, v out and the attention output back), split evenly over the ranks; the
  bytes a rank sends (its rows for the other ranks) over the median time of a call.

The ratio (flops per second over bytes per second) is the measured ``REMAP_BYTE_FLOPS``. Both
rates move with the machine's load: read them with the load average printed beside them.

    python bench/remap_price.py [--ranks 4] [--tokens 2048] [--repeats 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loom.models.presets import PRESETS
from loom.parallel.zeppelin_placement import REMAP_BYTE_FLOPS


def matmul_flops_per_s(rows: int, dim: int, ffn: int, repeats: int) -> float:
    """One thread's fp32 rate over the block's two kinds of projection."""
    torch.manual_seed(0)
    x = torch.randn(rows, dim)
    weights = [torch.randn(dim, dim), torch.randn(dim, ffn)]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
    times = []
    for n in range(repeats + 3):
        start = time.perf_counter()
        for w in weights:
            torch.mm(x, w)
        if n >= 3:
            times.append(time.perf_counter() - start)
    return flops / statistics.median(times)


def _all_to_all_worker(rank: int, world: int, port: int, rows: int, width: int, repeats: int,
                       out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    send = torch.randn(rows, width)
    receive = torch.empty_like(send)
    times = []
    for n in range(repeats + 3):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(receive, send)
        if n >= 3:
            times.append(time.perf_counter() - start)
    out[rank] = statistics.median(times)
    dist.destroy_process_group()


def all_to_all_bytes_per_s(world: int, rows: int, width: int, repeats: int) -> float:
    """What one rank sends to the others per second (its own share stays local)."""
    manager = mp.Manager()
    out = manager.dict()
    port = 29500 + os.getpid() % 1000
    mp.spawn(_all_to_all_worker, args=(world, port, rows, width, repeats, out), nprocs=world)
    sent = 4 * rows * width * (world - 1) / world
    return sent / statistics.median(out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    options = parser.parse_args()
    torch.set_num_threads(1)
    args = PRESETS[options.preset]
    kv = args.dim * args.n_kv_heads // args.n_heads
    width = 2 * args.dim + 2 * kv
    flops = matmul_flops_per_s(options.tokens, args.dim, args.ffn_dim, options.repeats)
    bytes_per_s = all_to_all_bytes_per_s(options.ranks, options.tokens, width, options.repeats)
    print(f"load average {os.getloadavg()[0]:.1f}; {options.preset}: dim {args.dim}, "
          f"remap width {width} fp32 values, {options.tokens} rows, {options.ranks} gloo ranks")
    print(f"linear modules: {flops / 1e9:.1f} GFLOP/s on one thread")
    print(f"all-to-all: {bytes_per_s / 1e9:.3f} GB/s sent per rank")
    print(f"flops per byte: {flops / bytes_per_s:.1f} (REMAP_BYTE_FLOPS = {REMAP_BYTE_FLOPS:g})")


if __name__ == "__main__":
    main()
