"""Random multi-rank layouts trained for real: ``loom train`` on 2 or 4 local ranks, 2 steps each,
with a random combination of the parallel axes and the features that interact with them.

    python bench/layout_fuzz.py [--seed 1] [--budget-s 1800] [--out bench/out/layout_fuzz.jsonl]
    python bench/layout_fuzz.py --summarize bench/out/layout_fuzz.jsonl   # an earlier run's summary

The suite proves each named combination against one process (``tests/dist``); this probes the
combinations nobody named. Each draw sets tp, pp, cp, dp_shard and ep to 1 or 2 within the world
size, and independently a schedule, sequence parallelism, a cp mode, a ZeRO stage, recomputation,
packing and balancing, a dtype, tied embeddings, q/k norms, a GELU MLP, a sliding window, MoE
experts, gradient compression, an outer data-parallel mode, vocabulary parallelism over the
pipeline, bf16 reduction, checkpointing every step and activation offload. Every run must end in
one of two ways:

* ``ok``: exit 0, a finite loss logged for both steps, and nothing on stderr that Python or torch
  flags (a traceback, a ``Warning``);
* ``refused``: exit 2 and one line naming the field and the rule (a combination not built).

Anything else is a ``FINDING``: its command line and the last lines of its output are kept.

With ``--parity`` each trained run whose arithmetic does not depend on the layout is also held to
one process: the same model, data and features with every ``parallel.*`` key dropped, trained on
one rank (one reference per feature set, cached). Left out are the draws whose numbers depend on
the layout by design: gradient compression, the outer data-parallel modes, bf16 weights or
reductions (a parity run skips those draws). Each step's loss and gradient norm (the norm of
step 1 is the gradient before any update) and the validation loss must agree within
``PARITY_RTOL``; otherwise the run is a ``MISMATCH``, a finding too.

Writes one JSON line per run and prints a summary with every refusal's rule and count. The
draws depend only on ``--seed``; the time budget decides how many are run.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXED = ["--train.steps=2", "--train.global_batch_size=8", "--train.micro_batch_size=2",
         "--data.seq_len=128", "--train.eval_every=2", "--train.eval_batches=1",
         "--metrics.plot=false", "--metrics.tensorboard=false", "--metrics.progress=false",
         "--train.timeout_s=60"]
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv", "looped_bfs", "search"]
AXES = ["tp", "pp", "cp", "dp_shard", "ep"]
FLAGGED = re.compile(r"Traceback|Warning\b|Error\b")
# Keys whose numbers differ from one process's by design (lossy or lower-precision reductions,
# outer optimisers over replicas): such runs are only checked to train.
INEXACT = {"parallel.grad_compression", "parallel.dp_mode", "train.dtype",
           "train.grad_reduce_dtype"}
# Fixed before the first parity run: the parity suite's tolerance for the steps after the first
# (tests/dist/test_layouts_parity.py's RTOL; step 1 is held to 1e-5 there). The largest gap
# measured since is 3.0e-6 over 190 layouts (docs/benchmarks.md).
PARITY_RTOL = 1e-4


def draw(rng: random.Random) -> tuple[int, dict[str, object]]:
    """One random layout: the world size and its ``section.key -> value`` overrides."""
    world = rng.choice([2, 4])
    over: dict[str, object] = {}
    left = world
    for axis in rng.sample(AXES, len(AXES)):
        if left > 1 and rng.random() < 0.45:
            over[f"parallel.{axis}"] = 2
            left //= 2
    if "parallel.ep" in over or rng.random() < 0.15:
        over["model.n_experts"] = 4
    if "parallel.pp" in over:
        over["parallel.schedule"] = rng.choice(SCHEDULES)
    if "parallel.tp" in over and rng.random() < 0.5:
        over["parallel.sequence_parallel"] = "true"
    if "parallel.cp" in over:
        over["parallel.cp_mode"] = rng.choice(["ring", "ulysses", "allgather"])
    if "parallel.dp_shard" in over:
        over["parallel.zero_stage"] = rng.choice([1, 2, 3])
    for key, chance, values in [
            ("train.recompute", 0.3, ["full", "selective", "every_k"]),
            ("data.packing", 0.3, ["pack", "varlen"]),
            ("data.balance", 0.2, ["tokens", "zeppelin"]),
            ("train.dtype", 0.2, ["bf16", "bf16_autocast"]),
            ("model.tie_embeddings", 0.15, ["true"]),
            ("model.qk_norm", 0.15, ["true"]),
            ("model.mlp", 0.1, ["gelu"]),
            ("model.sliding_window", 0.1, [64]),
            ("parallel.grad_compression", 0.15, ["powersgd", "int8", "topk"]),
            ("parallel.dp_mode", 0.15, ["diloco", "noloco", "co2"]),
            ("parallel.vocab_parallel_pp", 0.1, ["true"]),
            ("train.grad_reduce_dtype", 0.1, ["bf16"]),
            ("checkpoint.interval", 0.1, [1]),
            ("train.offload_activations", 0.1, ["true"])]:
        if rng.random() < chance:
            over[key] = rng.choice(values)
    if over.get("data.packing") == "varlen":
        over["data.tokens_per_microbatch"] = 512
    if "parallel.dp_mode" in over:
        over["parallel.outer_steps"] = 1
    return world, over


def numbers(run_dir: Path) -> dict[str, float]:
    """What a run logged, in step order: each step's loss and gradient norm (``loss@1``,
    ``grad_norm@1``, ...) and the validation losses (``val/loss@2``); parity compares them all."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    found: dict[str, float] = {}
    for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip()):
        for key in ("loss", "grad_norm", "val/loss"):
            if key in r and "step" in r:
                found[f"{key}@{r['step']}"] = r[key]
    return found


def reference_overrides(over: dict[str, object]) -> dict[str, object] | None:
    """The one-process twin of a draw, or None where its numbers depend on the layout."""
    if INEXACT & set(over):
        return None
    return {k: v for k, v in over.items() if not k.startswith("parallel.")}


def relative_gap(got: dict[str, float], want: dict[str, float]) -> float:
    """The largest relative difference over the numbers both runs logged (inf if they differ
    in what they logged)."""
    if not want or got.keys() != want.keys():
        return math.inf
    return max(abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in want)


def run_one(world: int, over: dict[str, object], run_dir: Path) -> dict:
    argv = [sys.executable, "-m", "loom", "train", "--config", str(ROOT / "configs/tiny.toml"),
            "--nproc", str(world), *FIXED, f"--train.run_dir={run_dir}",
            *[f"--{k}={v}" for k, v in over.items()]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    started = time.time()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired:
        code, out, err = "timeout", "", ""
    logged = numbers(run_dir)
    seen = [value for key, value in logged.items() if key.startswith("loss@")]
    lines = [line for line in (out + err).splitlines() if line.strip()]
    if code == 0 and len(seen) == 2 and all(map(math.isfinite, seen)) and not FLAGGED.search(err):
        verdict = "ok"
    elif code == 2 and len(lines) == 1:
        verdict = "refused"
    else:
        verdict = "FINDING"
    return {"world": world, "overrides": over, "exit": code, "verdict": verdict,
            "seconds": round(time.time() - started, 1), "losses": seen,
            "numbers": logged,
            "last": lines[-1][:300] if lines else "",
            "tail": lines[-30:] if verdict == "FINDING" else []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/out/layout_fuzz.jsonl")
    parser.add_argument("--parity", action="store_true",
                        help="also hold each exact trained run to a one-process run")
    parser.add_argument("--summarize", type=Path, metavar="JSONL",
                        help="print the summary of an earlier run's records; run nothing")
    args = parser.parse_args(argv)
    if args.summarize:
        records = [json.loads(line) for line in args.summarize.read_text().splitlines() if line]
        return summarize(records, str(args.summarize), args.summarize)
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    references: dict[str, dict] = {}
    started = time.time()
    with args.out.open("w") as sink, tempfile.TemporaryDirectory() as scratch:
        while time.time() - started < args.budget_s:
            world, over = draw(rng)
            if args.parity and reference_overrides(over) is None:
                continue  # a parity run spends its budget on the draws it can compare
            run_dir = Path(scratch) / f"run{len(results)}"
            result = run_one(world, over, run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
            twin = reference_overrides(over) if args.parity else None
            if result["verdict"] == "ok" and twin is not None:
                key = json.dumps(twin, sort_keys=True)
                if key not in references:
                    ref_dir = Path(scratch) / f"ref{len(references)}"
                    references[key] = run_one(1, twin, ref_dir)
                    shutil.rmtree(ref_dir, ignore_errors=True)
                reference = references[key]
                if reference["verdict"] == "ok":
                    gap = relative_gap(result["numbers"], reference["numbers"])
                    result["parity_gap"] = gap if math.isfinite(gap) else "logged differently"
                    if not gap <= PARITY_RTOL:
                        result["verdict"] = "MISMATCH"
                        result["reference"] = reference["numbers"]
            results.append(result)
            sink.write(json.dumps(result) + "\n")
            sink.flush()
            print(f"{len(results):4d} {result['verdict']:8s} world {world} {over}", flush=True)
    return summarize(results, f"seed {args.seed}", args.out)


def summarize(results: list[dict], label: str, path: Path) -> int:
    """The counts docs/benchmarks.md quotes, from the runs' records; 1 if any run is a finding."""
    kinds = collections.Counter(r["verdict"] for r in results)
    trained = [r for r in results if r["verdict"] in ("ok", "MISMATCH")]
    print(f"\n{len(results)} runs ({label}): {len(trained)} trained ("
          f"{sum(r['world'] == 4 for r in trained)} on 4 ranks), {kinds['refused']} refused,"
          f" {kinds['FINDING']} findings; {path}")
    compared = [r for r in trained if "parity_gap" in r]
    if compared:
        gaps = [r["parity_gap"] for r in compared if isinstance(r["parity_gap"], float)]
        print(f"held to one process: {len(compared)}, {kinds['MISMATCH']} mismatches (relative"
              f" tolerance {PARITY_RTOL:g}); largest gap of the matches:"
              f" {max((g for g in gaps if g <= PARITY_RTOL), default=0.0):.1e}")
        features = collections.Counter(k for r in compared for k in r["overrides"]
                                       if not k.startswith("parallel."))
        print("held to one process, by feature: "
              + ", ".join(f"{k} {n}" for k, n in features.most_common()))
    if trained:
        print(f"median seconds per trained run: {statistics.median(r['seconds'] for r in trained):.1f}")
    axes = collections.Counter(" x ".join(sorted(
        k.split(".")[1] for k in r["overrides"] if k.split(".")[1] in AXES)) or "dp_replicate only"
        for r in trained)
    print("trained, by the axes above 1: " + ", ".join(f"{a} {n}" for a, n in axes.most_common()))
    rules = collections.Counter(re.sub(r"^loom train: config error: ", "", r["last"])[:160]
                                for r in results if r["verdict"] == "refused")
    print(f"{len(rules)} distinct refusals:")
    for rule, count in rules.most_common():
        print(f"  {count:3d} refused: {rule}")
    for r in results:
        if r["verdict"] == "FINDING":
            print(f"\nFINDING (exit {r['exit']}, world {r['world']}): {r['overrides']}")
            print("\n".join("    " + line for line in r["tail"][-12:]))
        if r["verdict"] == "MISMATCH":
            print(f"\nMISMATCH (gap {r['parity_gap']}, world {r['world']}): {r['overrides']}")
            print(f"    layout:      {r['numbers']}\n    one process: {r['reference']}")
    return 1 if kinds["FINDING"] or kinds["MISMATCH"] else 0


if __name__ == "__main__":
    sys.exit(main())
