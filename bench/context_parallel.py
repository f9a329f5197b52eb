"""Benchmark: the context-parallel attention core (Ulysses, ring, hybrid) against one process.

Times forward + backward of causal attention on a ``[B, N, S, Hd]`` problem: one process running
``sdpa_causal`` on the whole sequence, then ``cp`` gloo ranks (the shared test harness) each
running ``ContextParallelAttention`` on its shard. Reports the median wall time per
forward+backward over the repetitions (the slowest rank's), and the bytes each rank's ledger
counted. On a CPU box with gloo this measures the Python + message overhead of the
implementations, not what NVLink would give; the byte counts are exact everywhere.

    python bench/context_parallel.py [--seq 2048] [--cp 2] [--reps 5]

Writes ``bench/out/context_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from loom.models.layers import sdpa_causal  # noqa: E402
from loom.parallel.comm import CommLedger  # noqa: E402
from loom.parallel.context import (CPLayout, ContextParallelAttention, new_cp_groups,  # noqa: E402
                                   sequence_positions)
from loom.testing.harness import WorkerPool  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
B, N, K, HD = 1, 8, 4, 64


def _inputs(seq: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, n, seq, HD, generator=g) for n in (N, K, K, N)]


def _time(fn, reps: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def single(seq: int, reps: int) -> float:
    q, k, v, dout = _inputs(seq)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    return statistics.median(_time(lambda: sdpa_causal(*leaves).backward(dout), reps))


def rank_body(ctx, mode: str, cp: int, seq: int, reps: int) -> tuple[list[float], dict]:
    layout = CPLayout.from_mode(mode, cp)
    groups = new_cp_groups([list(range(cp))], layout, ctx.rank)
    ledger = CommLedger()
    core = ContextParallelAttention(groups, ledger)
    positions = sequence_positions(seq, groups.cp_rank, layout)
    q, k, v, dout = (t[:, :, positions].contiguous() for t in _inputs(seq))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> None:
        ledger.reset()
        core(*leaves).backward(dout)

    times = _time(step, reps)
    return times, {f"{a}/{op}": r.payload_bytes for (a, op), r in ledger.records.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread per rank, as the ranks get
    report = {"shape": {"B": B, "N": N, "K": K, "Hd": HD, "S": args.seq, "cp": args.cp},
              "single_s": single(args.seq, args.reps), "modes": {}}
    pool = WorkerPool(args.cp)
    try:
        for mode in ("ulysses", "ring", "hybrid"):
            results = pool.run(rank_body, mode, args.cp, args.seq, args.reps)
            per_rep = [max(ts) for ts in zip(*(times for times, _ in results))]  # slowest rank
            report["modes"][mode] = {"median_s": statistics.median(per_rep),
                                     "bytes_per_rank": results[0][1]}
    finally:
        pool.close()
    out = ROOT / "bench" / "out" / "context_parallel.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"single process: {report['single_s'] * 1e3:.1f} ms")
    for mode, row in report["modes"].items():
        print(f"{mode:8s} cp={args.cp}: {row['median_s'] * 1e3:.1f} ms  {row['bytes_per_rank']}")


if __name__ == "__main__":
    main()
