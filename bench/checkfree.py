"""Wall-clock to a target validation loss under injected stage failures: CheckFree recovery
(``--fault.recovery=checkfree``), CheckFree+ (``checkfree_plus``) vs restarting every worker
from the newest checkpoint (``--max-restarts``, ``checkpoint.interval``), and a run without
failures.

    python bench/checkfree.py [--trials 2] [--steps 80] [--every 20] [--interval 10]
                              [--modes none,checkfree,checkfree_plus,checkpoint] [--plus-stage 0]

Each run is a 4-stage pipeline of the tiny model (pp = 4, one rank per stage) on the standard
library corpus. A stage's process is SIGKILLed at the start of steps every, 2*every, ...: stage
2 (a middle stage) for checkfree and checkpoint, stage ``--plus-stage`` (default 0, the first,
which only CheckFree+ can rebuild) for checkfree_plus (the checkfree runs by ``fault.test_kill_*``
inside the worker; the checkpoint runs from outside, once step k*every - 1 is logged, so all lose
the same step). The target is the validation loss the failure-free run reaches at step
``steps - every``; reported: wall-clock from launch to the first evaluation at or below it (or
"not reached"), the same from the first logged step (start-up left out: on a loaded machine it
dominates), the final validation loss, and the cost of each failure: the wall-clock between the
logged steps k*every - 1 and k*every minus the run's median step-to-step time. Prints a table and
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
        kills: int, plus_stage: int = 0) -> dict:
    run_dir = workdir / mode
    args = base_args(steps, eval_every) + [f"--train.run_dir={run_dir}"]
    if mode in ("checkfree", "checkfree_plus"):
        stage = 2 if mode == "checkfree" else plus_stage
        args += [f"--fault.recovery={mode}", f"--fault.test_kill_stage={stage}",
                 f"--fault.test_kill_step={every}", f"--fault.test_kill_count={kills}"]
    elif mode == "checkfree_plus_nofail":  # the out-of-order microbatches' own cost
        args += ["--fault.recovery=checkfree_plus"]
    elif mode == "checkpoint":
        args += [f"--checkpoint.interval={interval}", "--max-restarts", str(kills)]
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "loom", "train", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    evals: list[tuple[float, int, float]] = []  # (wall s, step, val loss)
    logged: dict[int, float] = {}  # step -> wall s when its row was first seen
    seen, killed = 0, 0
    first_step = None  # wall s at the first logged step: start-up (imports) is left out below
    while proc.poll() is None:
        rows = _rows(run_dir / "metrics.jsonl")
        for row in rows[seen:]:
            if "val/loss" in row:
                evals.append((time.monotonic() - start, row["step"], row["val/loss"]))
            if first_step is None and "loss" in row:
                first_step = time.monotonic() - start
            if "loss" in row:
                logged.setdefault(row["step"], time.monotonic() - start)
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
    inside = mode in ("checkfree", "checkfree_plus")
    return {"mode": mode, "exit_code": proc.returncode, "wall_s": time.monotonic() - start,
            "first_step_s": first_step,
            "evals": evals, "kills": kills if inside else killed,
            "recoveries": stderr.count("rebuilt after step") if inside
            else stderr.count("resume: continuing from"),
            "failure_cost_s": failure_costs(logged, every,
                                            0 if mode.endswith(("none", "nofail")) else kills),
            "stderr_tail": stderr[-1500:]}


def failure_costs(logged: dict[int, float], every: int, kills: int) -> list[float | None]:
    """Per kill k: the wall-clock between the rows of steps k*every - 1 and k*every, minus the
    median gap between consecutive rows of steps no kill touched (None where a row is missing).
    Rows are seen by polling every 50 ms, and an evaluation step's row comes later by the
    evaluation's time: a few tenths of a second of noise."""
    killed = {k * every for k in range(1, kills + 1)}
    gaps = sorted(logged[s] - logged[s - 1] for s in logged
                  if s - 1 in logged and s not in killed)
    median = gaps[len(gaps) // 2] if gaps else 0.0
    return [logged[s] - logged[s - 1] - median if s in logged and s - 1 in logged else None
            for s in sorted(killed)]


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
    parser.add_argument("--modes", default="none,checkfree,checkfree_plus,checkpoint",
                        help="comma-separated: none, checkfree, checkfree_plus, checkpoint,"
                        " checkfree_plus_nofail (out of order, no kill)")
    parser.add_argument("--plus-stage", type=int, default=0,
                        help="the stage killed in the checkfree_plus runs (0..3)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"none", "checkfree", "checkfree_plus", "checkpoint",
                            "checkfree_plus_nofail"}
    if unknown or "none" not in modes:
        parser.error(f"--modes: unknown {sorted(unknown)}" if unknown
                     else "--modes must include none (it sets the target)")
    if not 0 <= args.plus_stage <= 3:
        parser.error(f"--plus-stage must be in 0..3 (pp = 4), got {args.plus_stage}")
    kills = (args.steps - 1) // args.every
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            for mode in modes:
                workdir = Path(tmp) / f"t{trial}"
                workdir.mkdir(exist_ok=True)
                res = run(mode, workdir, args.steps, args.every, args.interval, args.eval_every,
                          kills, args.plus_stage)
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
          f" a kill every {args.every} steps ({kills} in {args.steps} steps) of stage 2"
          f" (checkfree, checkpoint) or stage {args.plus_stage} (checkfree_plus),"
          f" checkpoints every {args.interval} steps for the restart mode")
    print(f"{'trial':>5} {'mode':>14} {'target':>7} {'to target (s)':>14}"
          f" {'from step 1 (s)':>15} {'final val':>9} {'wall (s)':>8}  per failure (s)")
    for res in results:
        final = res["evals"][-1][2] if res["evals"] else float("nan")
        hit, train = res["time_to_target_s"], res["train_to_target_s"]
        costs = " ".join("-" if c is None else f"{c:.1f}" for c in res["failure_cost_s"])
        print(f"{res['trial']:>5} {res['mode']:>14} {res['target'] or float('nan'):>7.3f}"
              f" {('%.1f' % hit) if hit is not None else 'not reached':>14}"
              f" {('%.1f' % train) if train is not None else '-':>15} {final:>9.3f}"
              f" {res['wall_s']:>8.1f}  {costs}")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "checkfree.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                   indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
