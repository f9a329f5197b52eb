"""Predicted step times of variable-length training at 64 to 1024 GPUs: none, tokens, static cp
and Zeppelin on a long-tail length distribution (the shape of Zeppelin's comparison, Chen et al.
2025, arXiv 2509.21841). Every number is the cost model's (``loom.sim.varlen_cost``), never a
measurement: the runtime attention engine Zeppelin needs is not built (``loom.data.zeppelin``).

    python bench/varlen_predicted.py [--gpus 64,128,256,512,1024] [--steps 2] [--json OUT]

The distribution: log-normal lengths, median 2048, sigma 1.0, clipped at 32 x the median
(65536); a step holds 32768 tokens per GPU; llama3-8b on H100-SXM, 8 per node (NVLink 4, one
400 Gb/s NIC per GPU); all GPUs data parallel x cp (tp = pp = 1), static cp over one node.
"""

from __future__ import annotations

import argparse
import json
import time

from loom.models.presets import PRESETS
from loom.plan.hardware import make_cluster
from loom.sim.cost_model import CostModel
from loom.sim.varlen_cost import lognormal, rank_balances

MEDIAN, MAX_RATIO, SIGMA, TOKENS_PER_GPU = 2048, 32, 1.0, 32768
ORDER = ("none", "tokens", "static-cp8", "zeppelin", "zeppelin-noremap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="64,128,256,512,1024")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    dist = lognormal(MEDIAN, MAX_RATIO, SIGMA, seed=0)
    model = PRESETS[args.model]
    out = []
    print(f"{args.model}, H100-SXM x 8 per node, log-normal lengths (median {MEDIAN}, sigma"
          f" {SIGMA}, max {MAX_RATIO * MEDIAN}), {TOKENS_PER_GPU} tokens per GPU per step,"
          f" {args.steps} sampled steps; PREDICTED")
    print(f"{'gpus':>5} {'balance':<21}{'step (s)':>9}{'vs tokens':>10}{'attn imb':>9}"
          f"{'lin imb':>8}{'after':>7}{'remap s':>8}{'ring':>5}")
    for gpus in (int(g) for g in args.gpus.split(",")):
        started = time.time()
        cluster = make_cluster("H100-SXM", gpus, 8)
        cost_model = CostModel(model, MAX_RATIO * MEDIAN, 1, cluster)
        tokens = gpus * TOKENS_PER_GPU
        rows = {r.balance: r for r in rank_balances(cost_model, cluster, dist, tokens,
                                                    steps=args.steps).rows}
        pinned = rank_balances(cost_model, cluster, dist, tokens, steps=args.steps,
                               routing=False, balances=("zeppelin",)).rows[0]
        base = rows["tokens"].seconds
        for name in ORDER:
            r = rows[name]
            print(f"{gpus:>5} {name:<21}{r.seconds:>9.3f}{base / r.seconds:>9.2f}x"
                  f"{r.imbalance['attention']:>9.2f}{r.imbalance['linear_before']:>8.2f}"
                  f"{r.imbalance['linear_after']:>7.2f}{r.remap:>8.3f}{r.max_group:>5}")
            out.append({"gpus": gpus, "balance": name, "step_seconds": r.seconds,
                        "speedup_vs_tokens": base / r.seconds, **r.imbalance,
                        "remap_seconds": r.remap, "largest_ring": r.max_group})
        print(f"{gpus:>5} {'zeppelin, no routing':<21}{pinned.seconds:>9.3f}"
              f"{base / pinned.seconds:>9.2f}x{pinned.imbalance['attention']:>9.2f}"
              f"{'':>15}{pinned.remap:>8.3f}{pinned.max_group:>5}"
              f"   ({time.time() - started:.0f} s to price)")
        out.append({"gpus": gpus, "balance": "zeppelin-no-routing",
                    "step_seconds": pinned.seconds, "speedup_vs_tokens": base / pinned.seconds,
                    **pinned.imbalance, "remap_seconds": pinned.remap})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
