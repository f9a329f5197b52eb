"""The planner on this machine: predicted vs measured step time, and does its ranking hold?

1. Validation table: for 9 layouts of the tiny model on 4 local processes (dp, tp, pp with three
   schedules and a searched one, cp, ZeRO-3, a combination), the measured step time against ``loom plan
   --layout``'s prediction from the calibration profile (``loom plan --calibrate --nproc 4``,
   measured first in the same run).
2. Ranking check: ``loom plan --gpu local`` ranks the layouts of the same workload; the first
   must be no slower than the second and third.

How steps are measured (default, ``--interleaved``): one Loom ``Trainer`` per layout, all in one
4-rank process group, built the way ``loom train`` builds them; after warm-up steps, every round
steps each layout once, in an order rotated per round, and a step's time is the slowest rank's
(a barrier before it). The machine is shared and drifts by +-15% over minutes, so layouts are
compared within a round: the ranking check uses the median over rounds of the first layout's
step time divided by the other's in the same round (< 1: faster), and reports the medians too.
``--processes`` instead runs ``loom train --nproc 4`` per layout and round, as before.

    python bench/planner_local.py [--steps 14] [--skip 4] [--ranking-rounds 96] [--ranking-only] [--processes] [--json bench/out/planner_local.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from loom.models.presets import PRESETS
from loom.calibration.measure import calibrate
from loom.plan.calibrate import load_profile
from loom.plan.hardware import Cluster
from loom.plan.search import plan, simulate_step
from loom.plan.space import Workload
from loom.layout import Layout
from loom.sim.cost_model import CostModel
from loom.sim.cost_model import search_costs

NPROC = 4
SEQ, BATCH = 256, 16
WORK = Workload("tiny", PRESETS["tiny"], SEQ, BATCH)

LAYOUTS = {
    "dp4": Layout(dp_replicate=4, micro_batch=2, microbatches=2),
    "tp4 sp": Layout(tp=4, sequence_parallel=True, micro_batch=4, microbatches=4),
    "pp2 dp2 1f1b": Layout(pp=2, dp_replicate=2, schedule="1f1b", micro_batch=2, microbatches=4),
    "pp2 dp2 interleaved": Layout(pp=2, dp_replicate=2, schedule="interleaved_1f1b", chunks=2,
                                  micro_batch=2, microbatches=4),
    "pp2 dp2 zbv": Layout(pp=2, dp_replicate=2, schedule="zbv", chunks=2, micro_batch=2,
                          microbatches=4),
    "cp4 ring": Layout(cp=4, micro_batch=4, microbatches=4),
    "zero3 dp4": Layout(dp_shard=4, zero_stage=3, micro_batch=2, microbatches=2),
    "dp2 tp2 sp": Layout(dp_replicate=2, tp=2, sequence_parallel=True, micro_batch=4,
                         microbatches=2),
    # the schedule search's own output (``schedule = "search"``), looped, at ZB-H2's 3 units
    "pp2 dp2 search": Layout(pp=2, dp_replicate=2, schedule="search", chunks=1, schedule_placement="looped",
                             schedule_memory_limit=3,                              micro_batch=2, microbatches=4),
}


def layout_config(layout: Layout):
    """The resolved config ``loom train`` runs ``layout`` with: the planner's own (by value),
    in fp32 on CPU (the profile measured fp32 matmuls), on the byte tokenizer, no evaluation."""
    from loom.config import resolve
    from loom.plan.search import to_config

    config = to_config(layout, WORK)
    config.train.dtype, config.data.tokenizer = "fp32", "byte"
    config.train.eval_every, config.train.steps = 0, 10_000
    return resolve(config, NPROC)


def measure(layout: Layout, steps: int, skip: int) -> float:
    """Median step time (s) of one ``loom train`` run of ``layout``."""
    from loom.config import to_toml

    with tempfile.TemporaryDirectory() as run_dir:
        config_path = Path(run_dir) / "layout.toml"
        config_path.write_text(to_toml(layout_config(layout)))
        cmd = [sys.executable, "-m", "loom", "train", "--nproc", str(NPROC),
               f"--config={config_path}", f"--train.steps={steps}",
               f"--train.run_dir={run_dir}/run"]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        rows = [json.loads(line)
                for line in Path(run_dir, "run", "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > skip]
        return statistics.median(times)


def _config_table(layout: Layout) -> dict:
    from loom.config import to_dict

    return to_dict(layout_config(layout))


def interleaved_steps(ctx, tables: dict[str, dict], data_dir: str, rounds: int,
                      skip: int) -> dict[str, list[float]]:
    """On every rank: one Trainer per layout in this process group; ``skip`` warm-up steps each,
    then ``rounds`` rounds in which each layout takes one step, the order rotated per round.
    Returns each layout's step times (s), a step's time being its slowest rank's."""
    import torch
    import torch.distributed as dist

    from loom.config import from_dict
    from loom.train.trainer import Trainer

    trainers = {name: Trainer(from_dict(table), data_dir, None, ctx)
                for name, table in tables.items()}
    for trainer in trainers.values():
        for _ in range(skip):
            trainer.train_step()
    names = list(trainers)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            trainers[name].train_step()
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[name].append(float(took))
    return times


def measure_interleaved(layouts: dict[str, Layout], rounds: int, skip: int,
                        registry) -> dict[str, list[float]]:
    from loom.config import from_dict
    from loom.data.loader import prepare_data

    tables = {name: _config_table(layout) for name, layout in layouts.items()}
    data_dir = Path("bench/out/planner_local_data")
    prepare_data(from_dict(next(iter(tables.values()))).data, data_dir)
    return registry.run(NPROC, interleaved_steps, tables, str(data_dir), rounds, skip,
                        task_timeout_s=7200.0)[0]


def bootstrap_interval(ratios: list[float], *, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of ``ratios`` resampled with replacement: how
    far the paired median could move with other rounds of the same noise."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return medians[resamples // 20], medians[resamples - 1 - resamples // 20]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14,
                        help="--processes: steps per run; interleaved: rounds per phase x 4")
    parser.add_argument("--ranking-only", action="store_true",
                        help="calibrate, then only the ranking check (no validation table)")
    parser.add_argument("--processes", action="store_true",
                        help="one loom train run per layout and round instead of interleaving")
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="--processes: ranking rounds")
    parser.add_argument("--ranking-rounds", type=int, default=96,
                        help="interleaved: rounds of the ranking check (each steps all three)")
    parser.add_argument("--layout-rounds", type=int, default=2, help="validation rounds")
    parser.add_argument("--profile", default="bench/out/local4.json")
    parser.add_argument("--json", default="bench/out/planner_local.json")
    args = parser.parse_args(argv)
    started = time.time()
    calibrate(NPROC, args.profile)
    gpu, link = load_profile(args.profile)
    cluster = Cluster(gpu, NPROC, NPROC, link, link)
    model = CostModel(WORK.model, SEQ, BATCH, cluster, dtype_bytes=4)
    out: dict = {"profile": json.loads(Path(args.profile).read_text())["gpu"], "layouts": []}
    # every layout once per round, rounds alternating, so a slow spell of the shared machine
    # falls on one measurement of each layout rather than on all of one layout's
    registry = None
    layouts = {} if args.ranking_only else {
        # a searched schedule is searched for the relative costs the planner writes
        name: replace(lay, schedule_costs=search_costs(model, lay))
        if lay.schedule == "search" else lay for name, lay in LAYOUTS.items()}
    if args.processes:
        samples: dict[str, list[float]] = {name: [] for name in layouts}
        for _ in range(args.layout_rounds):
            for name, layout in layouts.items():
                samples[name].append(measure(layout, args.steps, args.skip))
    else:
        from loom.testing.harness import PoolRegistry

        registry = PoolRegistry(pg_timeout_s=600.0)
        samples = measure_interleaved(layouts, args.steps, args.skip, registry) if layouts \
            else {}
    print("| layout | predicted step (s) | measured step (s), median (rounds) | error |")
    print("|---|---|---|---|")
    for name, layout in layouts.items():
        predicted = simulate_step(model, model.evaluate(layout)).step_time
        measured = statistics.median(samples[name])
        error = predicted / measured - 1
        out["layouts"].append({"name": name, "layout": layout.label(), "predicted_s": predicted,
                               "measured_s": measured, "rounds": samples[name], "error": error})
        rounds = ", ".join(f"{t:.3f}" for t in samples[name])
        print(f"| {name} ({layout.label()}) | {predicted:.3f} | {measured:.3f} ({rounds}) |"
              f" {error:+.0%} |", flush=True)
    ranked = plan(WORK, cluster, top=3, cost_model=model).ranked
    if registry is None:
        runs: dict[str, list[float]] = {cost.layout.label(): [] for cost in ranked}
        for _ in range(args.rounds):
            for cost in ranked:
                runs[cost.layout.label()].append(measure(cost.layout, args.steps, args.skip))
    else:
        runs = measure_interleaved({cost.layout.label(): cost.layout for cost in ranked},
                                   args.ranking_rounds, args.skip, registry)
        registry.close()
    print()
    print("| planner rank | layout | predicted step (s) | measured step (s), median of rounds |")
    print("|---|---|---|---|")
    out["ranking"] = []
    for rank, cost in enumerate(ranked, 1):
        label = cost.layout.label()
        measured = statistics.median(runs[label])
        out["ranking"].append({"rank": rank, "layout": label, "predicted_s": cost.step_time,
                               "measured_s": measured, "rounds": runs[label]})
        print(f"| {rank} | {label} | {cost.step_time:.3f} | {measured:.3f}"
              f" ({len(runs[label])} rounds) |")
    first = out["ranking"][0]
    paired, intervals = {}, {}
    for r in out["ranking"][1:]:
        ratios = [a / b for a, b in zip(first["rounds"], r["rounds"])]
        paired[r["layout"]] = statistics.median(ratios)
        intervals[r["layout"]] = bootstrap_interval(ratios)
    out["paired_ratio_first_to"] = paired
    out["paired_ratio_90pct_interval"] = intervals
    print("\nfirst / other, median over rounds of the same round's steps [90% bootstrap"
          " interval]: " + ", ".join(f"{label}: {ratio:.3f} [{intervals[label][0]:.3f},"
                                     f" {intervals[label][1]:.3f}]"
                                     for label, ratio in paired.items()))
    out["first_no_slower"] = all(first["measured_s"] <= r["measured_s"]
                                 for r in out["ranking"][1:])
    out["first_no_slower_paired"] = all(ratio <= 1.0 for ratio in paired.values())
    print(f"first-ranked no slower than the next two: by medians {out['first_no_slower']},"
          f" by paired rounds {out['first_no_slower_paired']}"
          f" (bench took {time.time() - started:.0f} s; load {os.getloadavg()[0]:.1f})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
