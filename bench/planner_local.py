"""The planner on this machine: predicted vs measured step time, and does its ranking hold?

1. Validation table: for 8 layouts of the tiny model on 4 local processes (dp, tp, pp with three
   schedules, cp, ZeRO-3, a combination) run ``loom train --nproc 4`` ``--layout-rounds`` times
   (all layouts per round) and compare the median over rounds of each run's median step time
   (steps after the first few) with ``loom plan --layout``'s prediction from
   the calibration profile (``loom plan --calibrate --nproc 4``, measured first in the same run).
2. Ranking check: ``loom plan --gpu local`` ranks the layouts of the same workload; the top 3 are
   each run ``--rounds`` times, alternating, and the first must be no slower than the second and
   third (medians over rounds of the per-run median step time).

    python bench/planner_local.py [--steps 14] [--layout-rounds 2] [--rounds 5] [--json bench/out/planner_local.json]
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
from pathlib import Path

from loom.models.presets import PRESETS
from loom.plan.calibrate import calibrate, load_profile
from loom.plan.hardware import Cluster
from loom.plan.search import plan, simulate_step
from loom.plan.space import Workload
from loom.sim.cost_model import CostModel, Layout

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
}


def overrides(layout: Layout) -> list[str]:
    from loom.plan.search import to_overrides

    values = to_overrides(layout, WORK)
    values["train.dtype"] = "fp32"  # CPU: fp32 compute (the profile measured fp32 matmuls)
    return [f"--{key}={value}" for key, value in values.items()]


def measure(layout: Layout, steps: int, skip: int) -> float:
    """Median step time (s) of one ``loom train`` run of ``layout``."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "loom", "train", "--nproc", str(NPROC),
               f"--train.steps={steps}", "--train.eval_every=0", f"--train.run_dir={run_dir}",
               "--data.tokenizer=byte", *overrides(layout)]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE)
        rows = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        times = [r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", 0) > skip]
        return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="ranking check rounds")
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
    samples: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(args.layout_rounds):
        for name, layout in LAYOUTS.items():
            samples[name].append(measure(layout, args.steps, args.skip))
    print("| layout | predicted step (s) | measured step (s), median (rounds) | error |")
    print("|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        predicted = simulate_step(model, model.evaluate(layout)).step_time
        measured = statistics.median(samples[name])
        error = predicted / measured - 1
        out["layouts"].append({"name": name, "layout": layout.label(), "predicted_s": predicted,
                               "measured_s": measured, "rounds": samples[name], "error": error})
        rounds = ", ".join(f"{t:.3f}" for t in samples[name])
        print(f"| {name} ({layout.label()}) | {predicted:.3f} | {measured:.3f} ({rounds}) |"
              f" {error:+.0%} |", flush=True)
    ranked = plan(WORK, cluster, top=3, cost_model=model).ranked
    runs: dict[str, list[float]] = {cost.layout.label(): [] for cost in ranked}
    for _ in range(args.rounds):
        for cost in ranked:
            runs[cost.layout.label()].append(measure(cost.layout, args.steps, args.skip))
    print()
    print("| planner rank | layout | predicted step (s) | measured step (s), median of rounds |")
    print("|---|---|---|---|")
    out["ranking"] = []
    for rank, cost in enumerate(ranked, 1):
        label = cost.layout.label()
        measured = statistics.median(runs[label])
        out["ranking"].append({"rank": rank, "layout": label, "predicted_s": cost.step_time,
                               "measured_s": measured, "rounds": runs[label]})
        print(f"| {rank} | {label} | {cost.step_time:.3f} | {measured:.3f} ({runs[label]}) |")
    first = out["ranking"][0]["measured_s"]
    out["first_no_slower"] = all(first <= r["measured_s"] for r in out["ranking"][1:])
    print(f"\nfirst-ranked no slower than the next two: {out['first_no_slower']}"
          f" (bench took {time.time() - started:.0f} s; load {os.getloadavg()[0]:.1f})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
