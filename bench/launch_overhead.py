"""Benchmark: the host time per kernel that ``Gpu.launch_overhead`` charges (issue 21).

``loom.sim.launch_cost`` prices a layer pass as the longer of its device time and its kernels
times a fixed host time per kernel (``loom.plan.hardware.HOST_LAUNCH``, 25 us). This script
measures that host time the way the constant was set: Loom's ``TransformerBlock`` at a size where
its kernels do no work (dim 64, 16 tokens; ``--dim``/``--tokens`` change it), one thread, forward
and backward timed separately (median over ``--repeats`` after ``--warmup``), each divided by the
dispatcher's count of its kernels (``launch_cost.block_kernels``, pinned to the dispatcher by
``tests/unit/plan/test_launch_cost.py``). What it includes: Python, autograd and the dispatcher,
plus a tiny kernel's own run on the CPU. On ``--device cuda`` the host enqueues and the device
runs each kernel in a few microseconds, so the time per kernel there is the host's dispatch and
``cudaLaunchKernel`` (the device is synchronised after each pass, which a pass of empty kernels
never waits on for long).

    python bench/launch_overhead.py [--device cpu|cuda] [--dtypes fp32,bf16] [--json FILE]

It prints one row per (dtype, direction) and the machine's load average (``os.getloadavg``):
a loaded machine inflates the result, so read it next to the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from loom.models.args import TransformerArgs
from loom.models.llama import TransformerBlock
from loom.models.rope import rope_tables
from loom.plan.hardware import HOST_LAUNCH
from loom.sim.launch_cost import block_kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def time_passes(dim: int, tokens: int, dtype: torch.dtype, device: torch.device, warmup: int,
                repeats: int) -> tuple[float, float]:
    """Median seconds of one forward and one backward of the block (device synchronised)."""
    args = TransformerArgs(dim=dim, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim,
                           vocab_size=8, max_seq_len=tokens)
    torch.manual_seed(0)
    block = TransformerBlock(args).to(device=device, dtype=dtype)
    cos, sin = (t.to(device) for t in rope_tables(args.head_dim, tokens, args.rope_theta))
    x = torch.randn(2, tokens, dim, dtype=dtype, device=device, requires_grad=True)
    grad = torch.ones(2, tokens, dim, dtype=dtype, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    forwards, backwards = [], []
    for n in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        y = block(x, cos, sin)
        sync()
        middle = time.perf_counter()
        y.backward(grad)
        sync()
        end = time.perf_counter()
        x.grad = None
        block.zero_grad(set_to_none=True)
        if n >= warmup:
            forwards.append(middle - start)
            backwards.append(end - middle)
    return statistics.median(forwards), statistics.median(backwards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", help="also write the rows to this file")
    options = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(options.device)
    load = os.getloadavg()
    print(f"device {device}, dim {options.dim}, {options.tokens} tokens, one thread; "
          f"load average {load[0]:.1f}; HOST_LAUNCH = {HOST_LAUNCH * 1e6:.0f} us")
    print(f"{'dtype':<6} {'pass':<9} {'median ms':>10} {'kernels':>8} {'us / kernel':>12}")
    rows = []
    args = TransformerArgs(dim=options.dim, n_layers=1, n_heads=4, n_kv_heads=2,
                           ffn_dim=2 * options.dim, vocab_size=8, max_seq_len=options.tokens)
    for name in options.dtypes.split(","):
        dtype = DTYPES[name]
        forward_kernels, i, w = block_kernels(args, False, compiled=False,
                                              e=torch.finfo(dtype).bits // 8)
        forward_s, backward_s = time_passes(options.dim, options.tokens, dtype, device,
                                            options.warmup, options.repeats)
        for direction, seconds, kernels in (("forward", forward_s, forward_kernels),
                                            ("backward", backward_s, i + w)):
            per_kernel = seconds / kernels
            rows.append({"dtype": name, "pass": direction, "seconds": seconds,
                         "kernels": kernels, "per_kernel_s": per_kernel})
            print(f"{name:<6} {direction:<9} {seconds * 1e3:>10.3f} {kernels:>8} "
                  f"{per_kernel * 1e6:>12.1f}")
    if options.json:
        with open(options.json, "w") as handle:
            json.dump({"device": str(device), "load": load[0], "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
