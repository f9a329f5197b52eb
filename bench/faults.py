"""Fault-injection trials: SIGKILL a random worker at a random step under `--max-restarts`, and
check that every run completes with final weights bit-identical to an uninterrupted run.

    python bench/faults.py [--trials 20] [--seed 0]

Prints one line per trial and the count of bit-identical completions; writes
``bench/out/faults.json``. Each trial is a 2-process `loom train` of the tiny model (24 steps,
a checkpoint every 4 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.e2e.test_fault_restart import ARGS, ENV, STEPS, _steps_logged, _weights  # noqa: E402
from tests.e2e.test_cli_train import _worker_pids  # noqa: E402


def trial(workdir: Path, kill_after: int, victim: int, expected) -> dict:
    run_dir = workdir / "runs" / "faulty"
    proc = subprocess.Popen([sys.executable, "-m", "loom", "train", *ARGS, "--max-restarts", "1",
                             "--train.run_dir=runs/faulty"], cwd=workdir, env=ENV, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while _steps_logged(run_dir) < kill_after and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    killed = False
    pids = _worker_pids(proc.pid)
    if proc.poll() is None and victim in pids:
        os.kill(pids[victim], signal.SIGKILL)
        killed = True
    _, stderr = proc.communicate(timeout=600)
    identical = False
    if proc.returncode == 0:
        got = _weights(run_dir)
        identical = set(got) == set(expected) and all(
            (got[k] == v).all().item() for k, v in expected.items())
    return {"kill_after_step": kill_after, "victim_rank": victim, "killed": killed,
            "exit_code": proc.returncode, "bit_identical": identical,
            "resumed": "resume: continuing from" in stderr}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        subprocess.run([sys.executable, "-m", "loom", "train", *ARGS,
                        "--train.run_dir=runs/straight"], cwd=base, env=ENV, check=True,
                       capture_output=True)
        expected = _weights(base / "runs" / "straight")
        results = []
        for i in range(args.trials):
            workdir = base / f"trial{i}"
            workdir.mkdir()
            (workdir / "runs").mkdir()
            result = trial(workdir, rng.randint(1, STEPS - 2), rng.randint(0, 1), expected)
            results.append(result)
            print(f"trial {i + 1}: {result}", flush=True)
    ok = sum(r["bit_identical"] for r in results)
    print(f"{ok} / {len(results)} runs completed bit-identical"
          f" ({sum(r['killed'] for r in results)} had a worker killed)")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"trials": results, "identical": ok,
                                                 "command": " ".join(sys.argv)}, indent=1))
    return 0 if ok == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
