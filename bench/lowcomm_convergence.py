"""Convergence of the outer loops against sync DP at equal tokens, without the link emulation.

    python bench/lowcomm_convergence.py --seed 1234 --runs sync,diloco8 --outer-lr 0.5,0.7,1.0
    python bench/lowcomm_convergence.py --seed 1234 --runs co2-8 --outer-lr 1.0 \\
        --outer-momentum 0 --set parallel.co2_gap_penalty=2
    python bench/lowcomm_convergence.py --seed 4321 --runs diloco32,noloco32 --outer-lr 1.0 \\
        --outer-momentum 0
    python bench/lowcomm_convergence.py --table            # every run recorded so far
    python bench/lowcomm_convergence.py --seed 11 --runs powersgd4 --steps 96 \
        --set parallel.compression_rank=2                  # one point of a fixed-rank sweep
    python bench/lowcomm_convergence.py --lgreco-table     # L-GreCo against the fixed ranks

The validation loss after a given number of tokens does not depend on the links' speed (the
emulation changes time, not arithmetic: bench/lowcomm.py's runs at 0.1 and 1 Gbit/s gave identical
losses), so these runs are plain ``loom train --nproc 4`` jobs: the tiny model, dp_replicate = 4,
the same data, batch and schedule as bench/lowcomm.py (its ``BASE``), longer (``--steps``), with an
evaluation every ``--eval-every`` steps. ``--seed`` is ``train.seed``: the initial weights and the
order of the training samples. Tune the outer lr and momentum on one seed, then report the chosen
setting on a seed that was not tuned on. Every run appends one JSON line to ``--out`` (so runs can
be made one at a time on a loaded machine and gathered later); ``--table`` prints, per seed, each
run's validation loss at every evaluation and its ratio to sync's at the same step (= the same
tokens: every mode trains on global_batch x seq_len tokens per step) and the evaluations at which
it is within issue 19's 5%. The runs, their grid and the held-out table: docs/benchmarks.md,
"Convergence at equal tokens, without the emulation".

``--lgreco-table`` answers issue 19's "L-GreCo >= 1.5x fewer bytes than fixed-rank PowerSGD at
the same final loss": per seed and number of steps, the final validation loss and bytes per
token of each fixed-rank ``powersgd4`` run (``--set parallel.compression_rank=R``) and of the
``lgreco`` run, and the bytes a fixed rank would need for L-GreCo's loss, interpolated between
the two fixed ranks whose losses bracket it, linearly in the logarithm of the bytes (each rank
doubles them; the loss falls about evenly per doubling); outside the sweep it says so instead.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lowcomm import BASE, ROOT, run_mode  # noqa: E402
from lowcomm import MODES as EMULATED_MODES  # noqa: E402

# bench/lowcomm.py's modes, and the H = 32 variants of the other outer modes (issue 19)
MODES = {**EMULATED_MODES,
         "noloco32": {"parallel.dp_mode": "noloco", "parallel.outer_steps": 32},
         "co2-32": {"parallel.dp_mode": "co2", "parallel.outer_steps": 32}}

TOKENS_PER_STEP = BASE["train.global_batch_size"] * BASE["data.seq_len"]
TARGET = 1.05  # issue 19: an outer mode's validation loss within 5% of sync's at equal tokens


def run_specs(runs: list[str], outer_lrs: list[float],
              outer_momenta: list[float]) -> list[tuple[str, dict, dict]]:
    """(mode name, overrides, the outer settings recorded) for every run asked for: sync once,
    each outer mode once per (outer lr, momentum) pair."""
    specs = []
    for name in runs:
        overrides = dict(MODES[name])
        if "parallel.dp_mode" not in overrides:
            specs.append((name, overrides, {}))
            continue
        for lr, mu in itertools.product(outer_lrs, outer_momenta):
            outer = {"parallel.outer_lr": lr, "parallel.outer_momentum": mu}
            specs.append((name, {**overrides, **outer}, outer))
    return specs


def print_table(records: list[dict]) -> None:
    for seed in sorted({r["seed"] for r in records}):
        rows = [r for r in records if r["seed"] == seed and "error" not in r]
        sync = next((r for r in rows if r["mode"] == "sync"), None)
        steps = sorted({step for r in rows for step, _ in r["evals"]})
        print(f"\nseed {seed}: validation loss (ratio to sync at the same tokens); the last "
              f"column: the evaluations at which the run is within {TARGET - 1:.0%} of sync")
        print("| run | " + " | ".join(f"{s * TOKENS_PER_STEP / 1e3:.0f}k" for s in steps)
              + " | within |")
        print("| --- |" + " ---: |" * len(steps) + " --- |")
        for r in rows:
            outer = r.get("outer", {})
            label = r["mode"] + "".join(f", {key.split('.')[-1]} {value}"
                                        for key, value in outer.items())
            evals, cells, within = dict(r["evals"]), [], []
            for s in steps:
                if s not in evals:
                    cells.append("")
                    continue
                base = dict(sync["evals"]).get(s) if sync else None
                cells.append(f"{evals[s]:.3f}" + (f" ({evals[s] / base:.3f})" if base else ""))
                if base and r is not sync and evals[s] <= TARGET * base:
                    within.append(f"{s * TOKENS_PER_STEP / 1e3:.0f}k")
            shown = ", ".join(within) if within else ("" if r is sync else "never")
            print(f"| {label} | " + " | ".join(cells) + f" | {shown} |")


def fixed_rank_bytes_at(loss: float, sweep: list[tuple[float, float]]) -> float | None:
    """Bytes per token a fixed rank needs for ``loss``: ``sweep`` holds (loss, bytes) of the
    fixed ranks; interpolated in log bytes between the two whose losses bracket ``loss``, None
    outside the sweep."""
    points = sorted(sweep, key=lambda point: point[1])  # by bytes: rank 1, 2, 4, ...
    for (loss_lo, bytes_lo), (loss_hi, bytes_hi) in zip(points, points[1:]):
        if loss_hi <= loss <= loss_lo and loss_lo > loss_hi:
            fraction = (loss_lo - loss) / (loss_lo - loss_hi)
            return math.exp(math.log(bytes_lo) + fraction * math.log(bytes_hi / bytes_lo))
    return None


def print_lgreco_table(records: list[dict]) -> None:
    print("| seed | steps | fixed ranks: val loss @ bytes/token | lgreco (reference rank) | "
          "fixed rank's bytes at lgreco's loss | lgreco's fewer bytes |")
    print("| ---: | ---: | --- | --- | ---: | ---: |")
    default_rank = MODES["lgreco"]["parallel.compression_rank"]
    ratios: dict[int, list[tuple[float, str]]] = {}
    pooled: dict[int, list[tuple[dict[int, dict], dict, dict | None]]] = {}  # (fixed, lgreco,
    # sync) per seed, by reference rank
    for seed, steps in sorted({(r["seed"], r["steps"]) for r in records}):
        rows = [r for r in records if (r["seed"], r["steps"]) == (seed, steps)
                and "error" not in r]
        fixed = {int(r["outer"]["parallel.compression_rank"]): r for r in rows
                 if r["mode"] == "powersgd4" and set(r["outer"]) == {"parallel.compression_rank"}}
        lgreco = {}  # by reference rank: the latest run (the file keeps earlier versions' too)
        for r in rows:
            if r["mode"] == "lgreco" and set(r["outer"]) <= {"parallel.compression_rank"}:
                lgreco[int(r["outer"].get("parallel.compression_rank", default_rank))] = r
        if len(fixed) < 2:
            continue
        sync = next((r for r in rows if r["mode"] == "sync" and not r["outer"]), None)
        sweep = [(r["val_loss"], r["bytes_per_token"]) for r in fixed.values()]
        cells = ", ".join(f"r{rank} {r['val_loss']:.3f} @ {r['bytes_per_token']:.0f}"
                          for rank, r in sorted(fixed.items()))
        for reference, run in sorted(lgreco.items()):
            pooled.setdefault(reference, []).append((fixed, run, sync))
            ratio, shown = _ratio(run, sweep)
            ratios.setdefault(reference, []).append((ratio, shown))
            print(f"| {seed} | {steps} | {cells} | {run['val_loss']:.3f} @ "
                  f"{run['bytes_per_token']:.0f} (r{reference}) | {shown} |")
    for reference, values in sorted(ratios.items()):
        bounds = sum("<" in shown or ">" in shown for _, shown in values)
        middle = statistics.median(ratio for ratio, _ in values)
        print(f"\nreference rank {reference}, per seed: median {middle:.2f}x over {len(values)}"
              f" seeds" + (f" ({bounds} of them a bound: outside the sweep)" if bounds else ""))
        _print_pooled(reference, pooled[reference])


def _ratio(run: dict, sweep: list[tuple[float, float]]) -> tuple[float, str]:
    """(fixed-rank bytes at ``run``'s loss / its bytes, the table's two cells); outside the
    sweep a bound: below the smallest rank's ratio when worse than every rank, above the
    largest's when better than every rank."""
    needed = fixed_rank_bytes_at(run["val_loss"], sweep)
    if needed:
        ratio = needed / run["bytes_per_token"]
        return ratio, f"{needed:.0f} | {ratio:.2f}x"
    worst = max(sweep, key=lambda point: point[0])
    best = min(sweep, key=lambda point: point[0])
    if run["val_loss"] > worst[0]:
        ratio = min(size for _, size in sweep) / run["bytes_per_token"]
        return ratio, f"worse than every rank | < {ratio:.2f}x"
    ratio = best[1] / run["bytes_per_token"]
    return ratio, f"better than every rank | > {ratio:.2f}x"


def _print_pooled(reference: int, runs: list[tuple[dict[int, dict], dict, dict | None]]
                  ) -> None:
    """The same comparison on the losses averaged over the seeds (each configuration's bytes
    are the same on every seed): the fixed ranks every seed ran, against the mean L-GreCo;
    where every seed has a sync run, each fixed rank's mean loss over sync's."""
    common = set.intersection(*(set(fixed) for fixed, _, _ in runs))
    if len(common) < 2:
        return
    sweep = [(statistics.mean(fixed[rank]["val_loss"] for fixed, _, _ in runs),
              statistics.mean(fixed[rank]["bytes_per_token"] for fixed, _, _ in runs))
             for rank in sorted(common)]
    mean = {"val_loss": statistics.mean(run["val_loss"] for _, run, _ in runs),
            "bytes_per_token": statistics.mean(run["bytes_per_token"] for _, run, _ in runs)}
    cells = ", ".join(f"r{rank} {loss:.3f} @ {size:.0f}"
                      for rank, (loss, size) in zip(sorted(common), sweep))
    _, shown = _ratio(mean, sweep)
    print(f"reference rank {reference}, mean over the {len(runs)} seeds: fixed {cells}; lgreco"
          f" {mean['val_loss']:.3f} @ {mean['bytes_per_token']:.0f}; fixed rank's bytes at its"
          f" loss | fewer: {shown}")
    if all(sync is not None for _, _, sync in runs):
        base = statistics.mean(sync["val_loss"] for _, _, sync in runs)
        print(f"  sync {base:.3f} on the mean; fixed rank / sync: " + ", ".join(
            f"r{rank} {loss / base:.3f}" for rank, (loss, _) in zip(sorted(common), sweep)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1234, help="train.seed")
    parser.add_argument("--runs", default="sync,diloco8,noloco8,co2-8",
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--outer-lr", default="0.7", help="outer lrs to try, comma-separated")
    parser.add_argument("--outer-momentum", default="0.9", help="outer momenta, comma-separated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further config override for every run, e.g. "
                             "parallel.co2_gap_penalty=0 (recorded with the run)")
    parser.add_argument("--steps", type=int, default=384)
    parser.add_argument("--eval-every", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "lowcomm_convergence.jsonl"))
    parser.add_argument("--table", action="store_true", help="print what --out holds and stop")
    parser.add_argument("--lgreco-table", action="store_true",
                        help="print L-GreCo against the fixed-rank sweeps in --out and stop")
    args = parser.parse_args()
    out = Path(args.out)
    if args.lgreco_table:
        print_lgreco_table([json.loads(line) for line in out.read_text().splitlines()
                            if line.strip()])
        return
    if not args.table:
        out.parent.mkdir(parents=True, exist_ok=True)
        extra = dict(item.split("=", 1) for item in args.set)
        specs = [(name, {**overrides, **extra}, {**outer, **extra}) for name, overrides, outer
                 in run_specs(args.runs.split(","), [float(v) for v in args.outer_lr.split(",")],
                              [float(v) for v in args.outer_momentum.split(",")])]
        with tempfile.TemporaryDirectory(prefix="loom-lowcomm-conv-") as tmp:
            for k, (name, overrides, outer) in enumerate(specs):
                result = run_mode(name, {**overrides, "train.seed": args.seed}, None, args.steps,
                                  args.eval_every, Path(tmp), tag=f"-{k}")
                record = {"seed": args.seed, "steps": args.steps, "outer": outer, **result}
                print(json.dumps(record), flush=True)
                with out.open("a") as f:
                    f.write(json.dumps(record) + "\n")
    print_table([json.loads(line) for line in out.read_text().splitlines() if line.strip()])


if __name__ == "__main__":
    main()
