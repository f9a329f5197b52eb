"""Training over slow links: sync DP, outer loops and gradient compression on 4 emulated replicas.

    python bench/lowcomm.py                          # 100 Mbit/s and 1 Gbit/s, every mode
    python bench/lowcomm.py --gbit 0.1 --modes sync,diloco8 --steps 32   # a quick look

Each mode is one ``loom train --nproc 4 --cluster FILE --emulate`` (``loom.emulate``: every rank
in its own network namespace, every link shaped to ``--gbit``; root needed) of the tiny model on
the standard-library corpus, 4 data-parallel replicas, the same seed, data order and steps.
Reported per mode: the validation loss at the end and at every evaluation, the wall-clock of the
training steps (metrics' step times summed: start-up, evaluation and checkpointing left out), and
the bytes each rank put on the data-parallel wire per trained token (the communication ledger:
``comm/*/wire_bytes`` summed over the run, divided by the tokens). Targets (issue 19): diloco and
noloco within 5% of sync's validation loss at equal tokens in <= 1/3 of its wall-clock, >= 8x
fewer bytes per token; lgreco >= 1.5x fewer bytes than fixed-rank PowerSGD at the same final loss.

The losses do not depend on the links: bench/lowcomm_convergence.py runs the same modes without
the emulation (``run_mode`` with no cluster), longer, to compare their losses at equal tokens.

Runs are sequential, not interleaved: each mode is a separate job of several minutes. The link
emulation shapes bandwidth only (no latency: ``loom.emulate`` says why); on this 2-core machine
four ranks also share two cores, so compute is ~2x slower than on four.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {  # name: overrides
    "sync": {},
    "diloco8": {"parallel.dp_mode": "diloco", "parallel.outer_steps": 8},
    "diloco32": {"parallel.dp_mode": "diloco", "parallel.outer_steps": 32},
    "noloco8": {"parallel.dp_mode": "noloco", "parallel.outer_steps": 8},
    "co2-8": {"parallel.dp_mode": "co2", "parallel.outer_steps": 8},
    "powersgd4": {"parallel.grad_compression": "powersgd", "parallel.compression_rank": 4},
    "lgreco": {"parallel.grad_compression": "powersgd", "parallel.compression_rank": 4,
               "parallel.compression_adaptive": "lgreco", "parallel.compression_refresh": 16},
    "int8": {"parallel.grad_compression": "int8"},
}
BASE = {"model.preset": "tiny", "data.seq_len": 128, "data.max_bytes": 3_000_000,
        "train.global_batch_size": 16, "train.micro_batch_size": 4, "parallel.dp_replicate": 4,
        "optim.warmup_steps": 8, "metrics.comm": True, "metrics.progress": False,
        "checkpoint.interval": 0}


def cluster_toml(gbit: float, ranks: int) -> str:
    nodes = "".join(f'[[node]]\nname = "replica{r}"\n\n' for r in range(ranks))
    return f"[defaults]\nlatency_ms = 0\nbandwidth_gbit = {gbit}\n\n{nodes}"


def run_mode(name: str, overrides: dict, cluster: Path | None, steps: int, eval_every: int,
             workdir: Path, tag: str = "") -> dict:
    """One ``loom train --nproc 4`` of mode ``name``; over the emulated ``cluster``, or, with
    None, plain (no network namespaces: the losses are the same, only the time differs)."""
    stem = cluster.stem if cluster is not None else "local"
    run_dir = workdir / f"{name}-{stem}{tag}"  # one directory per mode, bandwidth and tag
    table = {**BASE, **overrides, "train.steps": steps, "train.eval_every": eval_every,
             "train.run_dir": str(run_dir)}
    args = [f"--{key}={value}" for key, value in table.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    emulation = ["--cluster", str(cluster), "--emulate"] if cluster is not None else []
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "loom", "train", "--nproc", "4", *emulation,
                           *args], cwd=workdir, env=env, text=True, capture_output=True,
                          timeout=3600)
    if done.returncode != 0:
        return {"mode": name, "error": done.stderr[-1500:]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "step_time_s" in row]
    evals = [(row["step"], row["val/loss"]) for row in rows if "val/loss" in row]
    wire = sum(value for row in train for key, value in row.items()
               if key.startswith("comm/") and key.endswith("/wire_bytes")
               and key.split("/")[1].startswith(("dp", "cp")))
    tokens = steps * BASE["train.global_batch_size"] * BASE["data.seq_len"]
    return {"mode": name, "val_loss": evals[-1][1] if evals else None, "evals": evals,
            "train_seconds": sum(row["step_time_s"] for row in train),
            "job_seconds": time.monotonic() - started,
            "wire_bytes_per_rank": wire, "bytes_per_token": wire / tokens,
            "final_train_loss": train[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbit", default="0.1,1", help="link bandwidths, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--eval-every", type=int, default=32)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "lowcomm.json"))
    args = parser.parse_args()
    report = {"steps": args.steps, "base": BASE, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="loom-lowcomm-") as tmp:
        for gbit in [float(g) for g in args.gbit.split(",")]:
            cluster = Path(tmp) / f"cluster-{gbit}.toml"
            cluster.write_text(cluster_toml(gbit, 4))
            results = []
            for name in args.modes.split(","):
                result = run_mode(name, MODES[name], cluster, args.steps, args.eval_every,
                                  Path(tmp))
                results.append(result)
                print(json.dumps({"gbit": gbit, **result}), flush=True)
            report["runs"][str(gbit)] = results
            print_table(gbit, results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


def print_table(gbit: float, results: list[dict]) -> None:
    sync = next((r for r in results if r["mode"] == "sync" and "error" not in r), None)
    print(f"\n{gbit:g} Gbit/s links, 4 replicas")
    print("| mode | val loss | vs sync | train s | vs sync | bytes/token | sync/this |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | failed: {r['error'].strip().splitlines()[-1]} | | | | | |")
            continue
        rel = (lambda a, b: f"{a / b:.3f}") if sync else (lambda a, b: "")
        print(f"| {r['mode']} | {r['val_loss']:.4f} | {rel(r['val_loss'], sync['val_loss'])} |"
              f" {r['train_seconds']:.1f} | {rel(r['train_seconds'], sync['train_seconds'])} |"
              f" {r['bytes_per_token']:.1f} |"
              f" {rel(sync['bytes_per_token'], max(r['bytes_per_token'], 1e-9))} |")


if __name__ == "__main__":
    main()
