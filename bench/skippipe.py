"""Benchmark: SkipPipe's path scheduler on a simulated two-region cluster (issue 18).

For each shape (stages x replicas, microbatches) and skip ratio, the iteration makespan that
``loom.schedule.path_replay`` gives for:

* the full pipeline, every microbatch on replica m % R of every stage;
* the full pipeline with the replicas chosen by the path scheduler (skip 0);
* random valid paths at the skip ratio (mean and best of ``--samples`` draws);
* the scheduled paths (``loom.schedule.path_search``).

The cluster: two regions of ``stages x replicas / 2`` nodes, 10 Gbit/s and 1 ms inside a region,
``--inter-gbit`` and ``--inter-ms`` between them, the second region's nodes ``--slow`` times as
fast. Each stage has one replica in each region, alternating (stage s replica r in region r for
even s, 1 - r for odd s), so the ordinary pipeline crosses the slow link at every hop. Costs:
``--forward-ms`` per stage and microbatch at speed 1, backward twice that, activation messages
of micro x seq x dim fp32, the replicas' gradient averaging of ``--stage-mparams`` M fp32
parameters per stage. Everything is predicted (simulated), nothing runs on devices.

    python bench/skippipe.py [--samples 10] [--inter-gbit 0.1] [--inter-ms 50]

Writes ``bench/out/skippipe.json``; results in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.cluster import Link, regions  # noqa: E402
from loom.schedule.path_replay import PathCosts  # noqa: E402
from loom.schedule.path_search import compare  # noqa: E402
from loom.schedule.paths import skip_count  # noqa: E402

GBIT = 1e9 / 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--inter-gbit", type=float, default=0.1)
    parser.add_argument("--inter-ms", type=float, default=50.0)
    parser.add_argument("--slow", type=float, default=0.5)
    parser.add_argument("--forward-ms", type=float, default=100.0)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--stage-mparams", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "skippipe.json"))
    args = parser.parse_args(argv)
    # stages, replicas, microbatches, swaps, skip ratios (at most (S-3)/S: a path visits at
    # least one middle stage, see loom.schedule.paths.skip_count)
    shapes = [(4, 2, 8, 0, (0.25,)), (4, 2, 8, 1, (0.25,)), (8, 2, 16, 1, (0.25, 0.5))]
    rows = []
    for stages, replicas, microbatches, swaps, ratios in shapes:
        cluster = regions([stages * replicas // 2] * 2, intra=Link(1e-3, 10 * GBIT),
                          inter=Link(args.inter_ms / 1e3, args.inter_gbit * GBIT),
                          compute=[1.0, args.slow])
        half = stages * replicas // 2
        allocation = {(s, r): (r if s % 2 == 0 else 1 - r) * half + s  # one node per stage
                      for s in range(stages) for r in range(replicas)}
        costs = PathCosts.uniform(stages, args.forward_ms / 1e3,
                                  activation_bytes=args.micro * args.seq * args.dim * 4,
                                  gradient_bytes=args.stage_mparams * 1e6 * 4)
        for ratio in ratios:
            rules = skip_count(stages, ratio, max_swaps=swaps)
            start = time.perf_counter()
            result = compare(rules, replicas, microbatches, cluster, allocation, costs,
                             samples=args.samples)
            row = {"stages": stages, "replicas": replicas, "microbatches": microbatches,
                   "skip_ratio": ratio, "max_swaps": swaps,
                   "scheduler_s": round(time.perf_counter() - start, 2),
                   **{name: round(value, 4) for name, value in result.rows()}}
            rows.append(row)
            print(f"{stages} stages x {replicas} replicas, m={microbatches}, skip {ratio}, "
                  f"swaps<={swaps} (compare took {row['scheduler_s']} s)")
            for name, value in result.rows():
                print(f"  {name:<36} {value:8.3f} s   {result.full / value:5.2f}x vs full")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
