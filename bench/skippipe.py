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

``--emulated`` runs real training instead (issue 18 item 6; root: network namespaces): a
``--stages`` x ``--replicas`` pipeline (default 4 x 2, ``loom train --nproc 8
--parallel.schedule=skippipe``) of a small Llama on the standard-library corpus, on an emulated
two-region cluster (``loom train --cluster FILE --emulate``: each rank in its namespace, links
shaped by HTB, the pipeline messages' latency added in software, the second region's ranks
slowed to ``--slow``). Stage s replica r (rank s·R + r) is in region r for even s and 1 - r for
odd s, as in the simulation (at R = 1: stage s in region s mod 2). The trainer plans the paths
on that cluster. For each skip ratio of ``--skips`` (0: the full pipeline, its replicas chosen
by the same scheduler) it trains ``--steps`` steps and records the median step time (after
``--warmup`` steps) and the final validation loss (the full model, equal tokens for every
ratio); then it evaluates each run's final model along the paths that leave out half of the
middle stages, and the first and last stage alone (``loom.pipeline.path_inference``), for the
perplexity increase of leaving stages out. Writes ``bench/out/skippipe_emulated.json``.

    python bench/skippipe.py --emulated --steps 50 --micro 4 --seq 128 --dim 128 --inter-ms 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.cluster import Cluster, Link, Node, regions  # noqa: E402
from loom.schedule.path_replay import PathCosts  # noqa: E402
from loom.schedule.path_search import compare  # noqa: E402
from loom.schedule.paths import skip_count  # noqa: E402

GBIT = 1e9 / 8


def emulated_cluster(stages: int, replicas: int, *, intra: Link, inter: Link,
                     slow: float) -> Cluster:
    """Two regions; stage s replica r (rank ``s * replicas + r``) in region r mod 2 for even s
    and the other region for odd s; the second region's nodes at speed ``slow``."""
    nodes, region_of = [], []
    for rank in range(stages * replicas):
        s, r = divmod(rank, replicas)
        region = r % 2 if s % 2 == 0 else 1 - r % 2
        region_of.append(region)
        nodes.append(Node(f"r{region}-s{s}", 1.0 if region == 0 else slow, 0.0, f"r{region}"))
    links = {(a, b): inter for a in range(len(nodes)) for b in range(len(nodes))
             if a != b and region_of[a] != region_of[b]}
    return Cluster(tuple(nodes), intra, links)


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def run_emulated(args: argparse.Namespace) -> int:
    import math
    import os
    import subprocess

    import torch

    from loom.data.loader import DataFiles, eval_batches
    from loom.generate import load_trained_model
    from loom.pipeline.partition import partition_model
    from loom.pipeline.path_inference import half_of_the_middle, path_loss

    stages, replicas = args.stages, args.replicas
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cluster = emulated_cluster(stages, replicas, intra=Link(args.intra_ms / 1e3,
                                                            args.intra_gbit * GBIT),
                               inter=Link(args.inter_ms / 1e3, args.inter_gbit * GBIT),
                               slow=args.slow)
    (work / "cluster.toml").write_text(cluster.to_toml())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    heads = max(1, args.dim // 32)
    common = [f"--model.preset={args.preset}", f"--model.n_layers={args.layers}",
              f"--model.dim={args.dim}", f"--model.n_heads={heads}",
              f"--model.n_kv_heads={max(1, heads // 2)}", f"--model.ffn_dim={3 * args.dim}",
              f"--data.seq_len={args.seq}", f"--data.max_bytes={args.max_bytes}",
              f"--train.steps={args.steps}", f"--train.micro_batch_size={args.micro}",
              f"--train.global_batch_size={args.micro * args.microbatches * replicas}",
              f"--train.eval_every={args.steps}", f"--train.eval_batches={args.eval_batches}",
              f"--optim.warmup_steps={max(1, args.steps // 10)}", f"--optim.lr={args.lr}",
              "--metrics.progress=false", f"--parallel.pp={stages}",
              f"--parallel.dp_replicate={replicas}", f"--parallel.stage_replicas={replicas}",
              "--parallel.schedule=skippipe"]
    rows = []
    for ratio in [float(x) for x in args.skips.split(",")]:
        run = work / f"skip{ratio:g}"
        if run.exists() and not args.reuse:
            raise SystemExit(f"{run} exists: remove it or pass --reuse")
        if not (run / "model.safetensors").exists():
            started = time.time()
            done = subprocess.run(
                [sys.executable, "-m", "loom", "train", "--nproc", str(stages * replicas),
                 "--cluster", str(work / "cluster.toml"), "--emulate",
                 f"--train.run_dir={run}", f"--parallel.skip_ratio={ratio}", *common],
                cwd=ROOT, env=env, text=True, capture_output=True)
            (work / f"skip{ratio:g}.log").write_text(done.stdout + done.stderr)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            print(f"skip {ratio:g}: trained in {time.time() - started:.0f} s", flush=True)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in lines if "step_time_s" in r]
        val = [r["val/loss"] for r in lines if "val/loss" in r][-1]
        rows.append({"skip_ratio": ratio, "steps": len(times),
                     "step_time_median_s": round(_median(times[args.warmup:]), 4),
                     "step_time_mean_s": round(sum(times[args.warmup:])
                                               / len(times[args.warmup:]), 4),
                     "val_loss": round(val, 4), "run": str(run)})
    # inference along partial paths: every run's final model, the same validation batches
    torch.set_num_threads(1)
    first = Path(rows[0]["run"])
    data = DataFiles.open(first / "data")
    val_set = data.val_set(args.seq, packing="concat")
    batches = list(eval_batches(val_set, args.micro * args.microbatches * replicas,
                                args.eval_batches))
    paths = {"full": [list(range(stages))], "half of the middle": half_of_the_middle(stages),
             "first and last only": [[0, stages - 1]]}
    for row in rows:
        model, _, config = load_trained_model(Path(row["run"]), torch.device("cpu"))
        layers = partition_model(model.args, stages, args.seq)
        for name, options in paths.items():
            losses = [path_loss(model, layers, p, batches) for p in options]
            row[f"loss {name}"] = round(sum(losses) / len(losses), 4)
        full = row["loss full"]
        for name in list(paths)[1:]:
            row[f"ppl increase {name}"] = round(math.exp(row[f"loss {name}"] - full) - 1, 4)
    base = rows[0]
    for row in rows:
        row["speedup_vs_first"] = round(base["step_time_median_s"] / row["step_time_median_s"], 3)
        row["val_loss_vs_first"] = round(row["val_loss"] / base["val_loss"] - 1, 4)
        print(json.dumps(row))
    out = Path(args.out_emulated)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "cluster": cluster.to_toml(),
                               "load_average": os.getloadavg(), "rows": rows}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emulated", action="store_true",
                        help="real training on an emulated two-region cluster (root)")
    parser.add_argument("--skips", default="0,0.25")
    parser.add_argument("--stages", type=int, default=4, help="emulated: pipeline stages")
    parser.add_argument("--replicas", type=int, default=2, help="emulated: replicas per stage")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--microbatches", type=int, default=4, help="per replica")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--max-bytes", type=int, default=2_000_000)
    parser.add_argument("--intra-gbit", type=float, default=1.0)
    parser.add_argument("--intra-ms", type=float, default=1.0)
    parser.add_argument("--work", default=str(ROOT / "bench" / "out" / "skippipe_runs"))
    parser.add_argument("--reuse", action="store_true", help="keep finished runs in --work")
    parser.add_argument("--out-emulated",
                        default=str(ROOT / "bench" / "out" / "skippipe_emulated.json"))
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
    if args.emulated:
        return run_emulated(args)
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
