"""Wall-clock to a target validation loss under injected stage failures: CheckFree recovery
(``--fault.recovery=checkfree``) vs restarting every worker from the newest checkpoint
(``--max-restarts``, ``checkpoint.interval``), and a run without failures.

    python bench/checkfree.py [--trials 2] [--steps 80] [--every 20] [--interval 10]

Each run is a 4-stage pipeline of the tiny model (pp = 4, one rank per stage) on the standard
library corpus. Stage 2's process is SIGKILLed at the start of steps every, 2*every, ... (the
checkfree runs by ``fault.test_kill_*`` inside the worker; the checkpoint runs from outside, once
step k*every - 1 is logged, so both lose the same step). The target is the validation loss the
failure-free run reaches at step ``steps - every``; reported: wall-clock from launch to the first
evaluation at or below it (or "not reached"), the same from the first logged step (start-up left
out: on a loaded machine it dominates), and the final validation loss. Prints a table and
writes ``bench/out/checkfree.json``. Measured on a shared 2-core machine: timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def base_args(steps: int, eval_every: int) -> list[str]:
    return ["--nproc", "4", "--parallel.pp=4", "--model.preset=tiny", "--data.max_bytes=300000",
            "--data.seq_len=64", "--train.global_batch_size=8", "--train.micro_batch_size=2",
            f"--train.steps={steps}", f"--train.eval_every={eval_every}", "--train.eval_batches=2",
            "--optim.warmup_steps=10", "--train.timeout_s=30", "--metrics.tensorboard=false",
            "--metrics.plot=false"]


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            break
    return out


def run(mode: str, workdir: Path, steps: int, every: int, interval: int, eval_every: int,
        kills: int) -> dict:
    run_dir = workdir / mode
    args = base_args(steps, eval_every) + [f"--train.run_dir={run_dir}"]
    if mode == "checkfree":
        args += ["--fault.recovery=checkfree", "--fault.test_kill_stage=2",
                 f"--fault.test_kill_step={every}", f"--fault.test_kill_count={kills}"]
    elif mode == "checkpoint":
        args += [f"--checkpoint.interval={interval}", "--max-restarts", str(kills)]
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "loom", "train", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    evals: list[tuple[float, int, float]] = []  # (wall s, step, val loss)
    seen, killed = 0, 0
    first_step = None  # wall s at the first logged step: start-up (imports) is left out below
    while proc.poll() is None:
        rows = _rows(run_dir / "metrics.jsonl")
        for row in rows[seen:]:
            if "val/loss" in row:
                evals.append((time.monotonic() - start, row["step"], row["val/loss"]))
            if first_step is None and "loss" in row:
                first_step = time.monotonic() - start
            if (mode == "checkpoint" and "loss" in row and killed < kills
                    and row["step"] == (killed + 1) * every - 1):
                _kill_rank(proc.pid, 2)
                killed += 1
        seen = len(rows)
        if time.monotonic() - start > 900:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    stderr = proc.communicate()[1]
    for row in _rows(run_dir / "metrics.jsonl")[seen:]:
        if "val/loss" in row:
            evals.append((time.monotonic() - start, row["step"], row["val/loss"]))
    return {"mode": mode, "exit_code": proc.returncode, "wall_s": time.monotonic() - start,
            "first_step_s": first_step,
            "evals": evals, "kills": kills if mode == "checkfree" else killed,
            "recoveries": stderr.count("rebuilt after step") if mode == "checkfree"
            else stderr.count("resume: continuing from"), "stderr_tail": stderr[-1500:]}


def _kill_rank(launcher: int, rank: int) -> None:
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "comm").read_text().strip() == f"loom-rank{rank}" \
                    and os.getpgid(int(entry.name)) == launcher:
                os.kill(int(entry.name), signal.SIGKILL)
                return
        except (OSError, ValueError):
            continue


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=20, help="a kill every this many steps")
    parser.add_argument("--interval", type=int, default=10, help="checkpoint interval")
    parser.add_argument("--eval-every", type=int, default=10)
    args = parser.parse_args()
    kills = (args.steps - 1) // args.every
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            for mode in ("none", "checkfree", "checkpoint"):
                workdir = Path(tmp) / f"t{trial}"
                workdir.mkdir(exist_ok=True)
                res = run(mode, workdir, args.steps, args.every, args.interval, args.eval_every,
                          kills)
                res["trial"] = trial
                results.append(res)
                print(f"trial {trial} {mode:10s} exit {res['exit_code']} wall {res['wall_s']:.1f}s"
                      f" kills {res['kills']} recoveries {res['recoveries']} evals"
                      f" {[(round(t, 1), s, round(v, 3)) for t, s, v in res['evals']]}",
                      flush=True)
    target_step = args.steps - args.every
    for trial in range(args.trials):
        base = next(r for r in results if r["trial"] == trial and r["mode"] == "none")
        target = next((v for _, s, v in base["evals"] if s == target_step), None)
        for res in (r for r in results if r["trial"] == trial):
            res["target"] = target
            hit = next((t for t, _, v in res["evals"] if target is not None and v <= target), None)
            res["time_to_target_s"] = hit
            res["train_to_target_s"] = hit - res["first_step_s"] if hit is not None \
                and res["first_step_s"] is not None else None
    print(f"\ntarget: the failure-free run's validation loss at step {target_step};"
          f" a kill of stage 2 every {args.every} steps ({kills} in {args.steps} steps),"
          f" checkpoints every {args.interval} steps for the restart mode")
    print(f"{'trial':>5} {'mode':>10} {'target':>7} {'to target (s)':>14}"
          f" {'from step 1 (s)':>15} {'final val':>9} {'wall (s)':>8}")
    for res in results:
        final = res["evals"][-1][2] if res["evals"] else float("nan")
        hit, train = res["time_to_target_s"], res["train_to_target_s"]
        print(f"{res['trial']:>5} {res['mode']:>10} {res['target'] or float('nan'):>7.3f}"
              f" {('%.1f' % hit) if hit is not None else 'not reached':>14}"
              f" {('%.1f' % train) if train is not None else '-':>15} {final:>9.3f}"
              f" {res['wall_s']:>8.1f}")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "checkfree.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                   indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
