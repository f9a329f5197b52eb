"""Benchmark A, schedule quality: Loom's ``schedule search`` vs the best PyTorch 2.13 schedule.

For every cell (p, m, cost profile, memory limit) this builds every schedule family that
``torch.distributed.pipelining`` 2.13 ships, at 1..8 stages per rank where the class takes more
than one (the search's range), from torch's own ``pipeline_order`` (computed by the
schedule constructors on fake stages, no processes, as in
``tests/unit/pipeline/test_pipeline_torch_interop.py``), keeps those whose peak activation memory
fits the limit, and simulates them with Loom's simulator; then it runs ``loom.schedule.search``
with the same costs and limit and compares makespans. Both sides use the same cost convention:
the profile gives a full stage's F, I, W; a chunk of a v-chunk placement gets 1/v of them.

torch's ``Schedule1F1B`` order names a microbatch that does not exist on its last rank (an
off-by-one recorded in the interop tests; its runtime uses its own loop, not that order), so the
1F1B baseline is that order with the off-by-one repaired, which is exactly Loom's ``1f1b``.

    python bench/schedules.py            # full grid; torch's constructors at 8 chunks make
                                         # p = 32 alone take most of an hour on 2 cores
    python bench/schedules.py --quick    # p in {4, 8} only
    python bench/schedules.py --sizes 16 # chosen p values
    python bench/schedules.py --extra    # also W=0.75 with latency 0 and 0.02 (m=4p, limit 2p)

Writes ``bench/out/schedules.md`` (the table), ``bench/out/schedules.json`` and Gantt charts
``docs/img/schedules_*.png``. This is a script, not a test: nothing here runs in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.distributed.pipelining import schedules as ts

from loom.pipeline.torch_orders import TORCH_CLASSES, torch_schedule
from loom.schedule import Schedule
from loom.schedule.search import MAX_CHUNKS, placement_costs, search
from loom.schedule.replay import encode, peak_units
from loom.schedule.cost import StageCosts
from loom.schedule.render import render_gantt
from loom.schedule.simulate import SimResult, simulate

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The corners of the range: W in {0.5, 1} x latency in {0, 5% of F}
PROFILES = {
    "F=1 I=1 W=1 lat=0": StageCosts.uniform(1, 1, 1, 0),
    "F=1 I=1 W=1 lat=0.05": StageCosts.uniform(1, 1, 1, 0.05),
    "F=1 I=1 W=0.5 lat=0": StageCosts.uniform(1, 1, 0.5, 0),
    "F=1 I=1 W=0.5 lat=0.05": StageCosts.uniform(1, 1, 0.5, 0.05),
    # the worst cells for the two-chunk search (I twice F, latency a tenth of F)
    "F=1 I=2 W=1 lat=0.1": StageCosts.uniform(1, 2, 1, 0.1),
}
# Checked inside the range (``--extra``): only the cells the bubble target is about
EXTRA = {
    "F=1 I=1 W=0.75 lat=0": StageCosts.uniform(1, 1, 0.75, 0),
    "F=1 I=1 W=0.75 lat=0.02": StageCosts.uniform(1, 1, 0.75, 0.02),
}
CHARTED = {"F=1 I=1 W=1 lat=0": "w1", "F=1 I=1 W=0.5 lat=0.05": "w05"}
# The charts above hold up to p = 8 ranks x m = 32 microbatches x 8 chunks x F, I, W: past
# ``loom schedule show``'s limit, and about half a minute each to draw, which the docs' charts
# are worth
CHART_ACTIONS = 8 * 32 * 8 * 3
# (torch class, stages per rank): every class torch 2.13 ships at every chunk count the search
# goes up to; torch_schedule drops the ones torch refuses (ZB-V and DualPipeV take exactly 2)
TORCH = [(cls, chunks) for cls in TORCH_CLASSES for chunks in range(1, MAX_CHUNKS + 1)
         if chunks == 1 or not issubclass(cls, ts.PipelineScheduleSingle)]


def best_torch(p: int, m: int, costs: StageCosts, limit: float
               ) -> tuple[Schedule, SimResult] | None:
    best = None
    for cls, chunks in TORCH:
        schedule = torch_schedule(cls, chunks, p, m)
        if schedule is None or max(peak_units(encode(schedule), schedule.placement)) > limit:
            continue
        result = simulate(schedule, placement_costs(costs, schedule.placement))
        if best is None or result.makespan < best[1].makespan:
            best = (schedule, result)
    return best


def run(sizes: list[int], charts: bool, profiles: dict[str, StageCosts] = PROFILES,
        target_only: bool = False) -> list[dict]:
    rows = []
    for profile, costs in profiles.items():
        for p in sizes:
            for m in ((4 * p,) if target_only else (p, 2 * p, 4 * p)):
                for limit in ((2 * p,) if target_only else (p, 2 * p)):
                    started = time.monotonic()
                    found = search(p, m, costs, limit)
                    seconds = time.monotonic() - started
                    theirs = best_torch(p, m, costs, limit)
                    ours = found.sim_result
                    row = {
                        "profile": profile, "p": p, "m": m, "limit": limit,
                        "loom_makespan": float(ours.makespan), "loom": found.best.label,
                        "loom_bubble_zb": float(ours.bubble_zb),
                        "loom_peak": float(max(ours.peak_memory)), "search_s": seconds,
                        "torch_makespan": None if theirs is None else float(theirs[1].makespan),
                        "torch": None if theirs is None else theirs[0].name,
                        "torch_bubble_zb": None if theirs is None else float(theirs[1].bubble_zb),
                    }
                    rows.append(row)
                    print(_line(row), flush=True)
                    if charts and (p, m) in ((4, 8), (8, 32)) and theirs is not None:
                        _charts(found.schedule, ours, theirs, p, m, limit, profile)
                    if charts and (p, m, limit) == (8, 32, 16) and profile in CHARTED:
                        render_gantt(found.schedule, ours, os.path.join(
                            ROOT, "docs", "img", f"schedules_loom_p8_m32_L16_{CHARTED[profile]}.png"),
                            max_actions=CHART_ACTIONS)
    return rows


def _charts(schedule: Schedule, ours: SimResult, theirs: tuple[Schedule, SimResult], p: int,
            m: int, limit: float, profile: str) -> None:
    tag = CHARTED.get(profile)
    if tag is None or not (limit == p and (tag == "w05" or p == 4)):
        return
    folder = os.path.join(ROOT, "docs", "img")
    os.makedirs(folder, exist_ok=True)
    render_gantt(schedule, ours, os.path.join(folder, f"schedules_loom_p{p}_m{m}_{tag}.png"),
                 max_actions=CHART_ACTIONS)
    render_gantt(theirs[0], theirs[1], os.path.join(folder, f"schedules_torch_p{p}_m{m}_{tag}.png"),
                 max_actions=CHART_ACTIONS)


def _ratio(row: dict) -> float | None:
    return None if row["torch_makespan"] is None else row["loom_makespan"] / row["torch_makespan"]


def _line(row: dict) -> str:
    ratio = _ratio(row)
    torch_part = "no torch schedule fits" if ratio is None else (
        f"{row['torch_makespan']:.2f} {row['torch']:<28} ratio {ratio:.4f}")
    return (f"{row['profile']:<22} p={row['p']:<2} m={row['m']:<3} limit={row['limit']:<3} "
            f"loom {row['loom_makespan']:.2f} (bubble {row['loom_bubble_zb']:.2%}) | {torch_part}")


def markdown(rows: list[dict]) -> str:
    lines = [
        "| profile | p | m | limit | Loom makespan | Loom bubble (ZB) | Loom schedule | "
        "best torch makespan | torch bubble (ZB) | best torch schedule | Loom / torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = _ratio(row)
        torch_cells = ("-", "-", "none fits") if ratio is None else (
            f"{row['torch_makespan']:.2f}", f"{row['torch_bubble_zb']:.2%}", row["torch"])
        lines.append(
            f"| {row['profile']} | {row['p']} | {row['m']} | {row['limit']} | "
            f"{row['loom_makespan']:.2f} | {row['loom_bubble_zb']:.2%} | {row['loom']} | "
            f"{' | '.join(torch_cells)} | {'-' if ratio is None else f'{ratio:.4f}'} |")
    better = sum(1 for r in rows if _ratio(r) is not None and _ratio(r) < 1 - 1e-9)
    worse = sum(1 for r in rows if _ratio(r) is not None and _ratio(r) > 1 + 1e-9)
    equal = sum(1 for r in rows if _ratio(r) is not None) - better - worse
    lines.append("")
    lines.append(f"{len(rows)} cells: Loom better in {better}, equal in {equal}, worse in {worse}.")
    target = [r for r in rows if r["limit"] == 2 * r["p"] and r["m"] >= 3 * r["p"]]
    met = [r for r in target if r["loom_bubble_zb"] < 0.01]
    lines.append(f"Bubble under 1% at limit 2p with m >= 3p: {len(met)} of {len(target)} cells.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="p in {4, 8} only")
    parser.add_argument("--sizes", help="comma-separated p values (overrides --quick)")
    parser.add_argument("--no-charts", action="store_true")
    parser.add_argument("--extra", action="store_true", help="also the W=0.75 profiles")
    args = parser.parse_args(argv)
    sizes = [4, 8] if args.quick else [4, 8, 16, 32]
    if args.sizes:
        sizes = [int(p) for p in args.sizes.split(",")]
    rows = run(sizes, charts=not args.no_charts)
    if args.extra:
        rows += run(sizes, charts=False, profiles=EXTRA, target_only=True)
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    table = markdown(rows)
    with open(os.path.join(out, "schedules.md"), "w") as handle:
        handle.write(table)
    with open(os.path.join(out, "schedules.json"), "w") as handle:
        json.dump({"torch": torch.__version__, "rows": rows}, handle, indent=1)
    print("\n".join(table.splitlines()[-2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
