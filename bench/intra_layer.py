"""Benchmark: 4-rank CPU step time of tp=4 and cp=4 (each mode) vs dp=4 on the same model, and
the share of each step spent in communication.

Every layout trains the same model on the same global batch through the real ``Trainer`` on 4
long-lived gloo ranks (``loom.testing.harness.WorkerPool``). Layouts are measured in alternating
rounds (dp, tp, cp-ring, ... then again) so machine noise hits them alike; the median step time
over rounds is reported. The communication share is the fraction of a step's wall time spent
inside collective calls, as seen by ``torch.profiler`` on rank 0: the summed duration of c10d /
gloo collective and wait events over the step time. It is an approximation on CPU: gloo runs its
transfers on background threads, so time counted is time the rank *waited*, and transfers that
overlap compute are not counted at all.

    python bench/intra_layer.py [--rounds 3] [--steps 4] [--seq-len 256]

Prints a markdown table and writes ``bench/out/intra_layer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "dp=4": {"dp_replicate": 4},
    "tp=4": {"tp": 4},
    "tp=4+SP": {"tp": 4, "sequence_parallel": True},
    "cp=4 ring": {"cp": 4, "cp_mode": "ring"},
    "cp=4 ulysses": {"cp": 4, "cp_mode": "ulysses"},
    "cp=4 hybrid": {"cp": 4, "cp_mode": "hybrid"},
}
COMM_WORDS = ("c10d", "gloo", "all_reduce", "allreduce", "all_gather", "allgather",
              "reduce_scatter", "alltoall", "all_to_all", "send", "recv", "wait")


def timed_steps(ctx, config_table, data_dir, steps):
    """Rank-local: warm up one step, then time ``steps`` steps; profile one more on rank 0."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from loom.config import from_dict
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(config_table), data_dir, None, ctx)
    trainer.train_step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        trainer.train_step()
        profiled = time.perf_counter() - start
    comm_us = sum(e.cpu_time_total for e in prof.key_averages()
                  if any(w in e.key.lower() for w in COMM_WORDS) and "::" in e.key)
    return {"times": times, "comm_share": min(1.0, comm_us / 1e6 / profiled)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    from loom.data.loader import prepare_data
    from loom.testing.harness import WorkerPool
    from loom.testing.parity import layout_config

    base = {"model.preset": "tiny", "model.n_kv_heads": 4, "data.seq_len": args.seq_len,
            "data.max_bytes": 2_000_000, "train.global_batch_size": 8,
            "train.micro_batch_size": 2, "train.steps": 100}
    results: dict[str, dict] = {name: {"times": [], "comm_share": []} for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as data_dir:
        from loom.config import load_config

        prepare_data(load_config(None, base).data, data_dir)
        pool = WorkerPool(4, pg_timeout_s=600)
        try:
            for _ in range(args.rounds):
                for name, parallel in LAYOUTS.items():
                    # Same global batch everywhere: dp=4 takes 2 sequences per rank, the
                    # others all 8 (4 microbatches of 2).
                    config = layout_config(base, 4, **{"dp_replicate": 1, **parallel})
                    out = pool.run(timed_steps, config, data_dir, args.steps,
                                   task_timeout_s=1800)[0]
                    results[name]["times"] += out["times"]
                    results[name]["comm_share"].append(out["comm_share"])
        finally:
            pool.close()
    dp_time = statistics.median(results["dp=4"]["times"])
    rows = []
    for name, r in results.items():
        step = statistics.median(r["times"])
        rows.append({"layout": name, "median_step_s": step, "vs_dp": step / dp_time,
                     "comm_share": statistics.median(r["comm_share"])})
    print("| layout | median step (s) | step time / dp=4 | communication share |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['layout']} | {row['median_step_s']:.3f} | {row['vs_dp']:.2f} |"
              f" {row['comm_share']:.0%} |")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "intra_layer.json").write_text(json.dumps(
        {"rows": rows, "raw": results, "command": "python " + " ".join(sys.argv)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
