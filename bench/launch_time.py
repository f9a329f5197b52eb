"""Wall-clock of a short ``loom train --nproc N`` from the command to its exit, for one or more
source trees side by side (issue 18's and every end-to-end run's start-up cost).

    python bench/launch_time.py [--nproc 2,4] [--repeats 5] [--trees .,/path/to/other/checkout]

Each run trains the debug model for ``--steps`` (default 2) steps on 100 kB of the standard
library, no evaluation, no plots: what remains is the interpreter start, the launcher, the
workers' start-up (imports, process group, model build) and the exit. The trees run in turn
within each repeat (interleaved, so a load change hits both), each through ``PYTHONPATH``, with
``OMP_NUM_THREADS=1``. Reports the median and the spread per tree and world size, the losses'
agreement across trees (they must be equal: only the start-up differs), and the load average
before and after. Writes ``bench/out/launch_time.json``.
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

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--model.preset=debug", "--data.max_bytes=100000", "--data.seq_len=32",
        "--train.eval_every=0", "--metrics.progress=false", "--metrics.tensorboard=false",
        "--metrics.plot=false"]


def one_run(tree: Path, nproc: int, steps: int, run_dir: Path) -> tuple[float, list[float]]:
    """(seconds from the command to its exit, the logged losses)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE"}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "loom", "train", "--nproc", str(nproc),
                           f"--train.steps={steps}", f"--train.run_dir={run_dir}", *ARGS],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{tree}: loom train exited {done.returncode}:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return wall, [row["loss"] for row in rows if "loss" in row]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--trees", default=str(ROOT),
                        help="source trees to compare, comma-separated (default: this one)")
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",") if t]
    sizes = [int(n) for n in args.nproc.split(",") if n]
    for tree in trees:
        if not (tree / "loom" / "__init__.py").exists():
            parser.error(f"--trees: {tree} holds no loom package")
    if args.repeats < 1 or not sizes or min(sizes) < 1:
        parser.error("--repeats and every --nproc must be >= 1")
    load_before = os.getloadavg()
    walls: dict[tuple[str, int], list[float]] = {}
    losses: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for nproc in sizes:
                for n, tree in enumerate(trees):
                    run_dir = Path(tmp) / f"r{repeat}_n{nproc}_t{n}"
                    wall, loss = one_run(tree, nproc, args.steps, run_dir)
                    walls.setdefault((str(tree), nproc), []).append(wall)
                    losses[(str(tree), nproc)] = loss
                    print(f"repeat {repeat} nproc {nproc} {tree}: {wall:.2f} s", flush=True)
    load_after = os.getloadavg()
    print(f"\nload average (1 / 5 / 15 min) before {load_before}, after {load_after}")
    print(f"{'tree':<40} {'nproc':>5} {'median s':>9} {'min s':>7} {'max s':>7}")
    for (tree, nproc), values in walls.items():
        print(f"{tree[-40:]:<40} {nproc:>5} {statistics.median(values):>9.2f}"
              f" {min(values):>7.2f} {max(values):>7.2f}")
    for nproc in sizes:
        runs = {losses[(str(t), nproc)] == losses[(str(trees[0]), nproc)] for t in trees}
        print(f"nproc {nproc}: losses equal across trees: {runs == {True}}")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "launch_time.json").write_text(json.dumps({
        "args": vars(args), "load_before": load_before, "load_after": load_after,
        "walls": {f"{tree}|{nproc}": v for (tree, nproc), v in walls.items()},
        "losses": {f"{tree}|{nproc}": v for (tree, nproc), v in losses.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
