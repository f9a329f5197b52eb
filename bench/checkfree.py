"""Wall-clock to a target validation loss under injected stage failures: CheckFree recovery
(``--fault.recovery=checkfree``), CheckFree+ (``checkfree_plus``) vs restarting every worker
from the newest checkpoint (``--max-restarts``, ``checkpoint.interval``), and a run without
failures.

    python bench/checkfree.py [--trials 2] [--steps 80] [--every 20] [--interval 10]
                              [--modes none,checkfree,checkfree_plus,checkpoint] [--plus-stage 0]
    python bench/checkfree.py --trials 20 --failure-rate 0.06 --seed 0 --none-every 5 ...

Each run is a 4-stage pipeline of the tiny model (pp = 4, one rank per stage) on the standard
library corpus. Failures, a stage's process SIGKILLed at the start of a step, come either
periodically (``--every``: steps every, 2*every, ...; stage 2 for checkfree and checkpoint,
stage ``--plus-stage`` for checkfree_plus) or at random (``--failure-rate r``: each step from
2 on fails with probability r, a Bernoulli process drawn per trial from ``--seed`` + trial). A
random failure draws one uniform x: checkfree and checkpoint lose middle stage 1 + floor(2x),
checkfree_plus stage floor(4x) (any stage: only CheckFree+ rebuilds the first and the last), so
the three modes of a trial fail at the same steps, on the same stage where both can lose it.
The checkfree runs are killed by ``fault.test_kill_stages`` / ``test_kill_steps`` inside the
worker; the checkpoint runs from outside, once step k - 1 is logged, so all lose step k.

The target is the validation loss the failure-free run reaches at ``--target-step`` (default
its last evaluation: an earlier one can sit on a plateau of the loss, which every run touches
at about the same step, docs/benchmarks.md; its losses are deterministic, so
``--none-every K`` runs it only in every K-th trial); reported per run: wall-clock from launch
to the first evaluation at or below the target (or "not reached"), the same from the first
logged step (start-up left out: on a loaded machine it dominates), the final validation loss,
and the cost of each failure: the wall-clock between the logged steps k - 1 and k minus the
run's median step-to-step time; then per mode over the trials the median and mean of those.
Prints tables and writes ``bench/out/checkfree.json``. Measured on a shared 2-core machine:
timings are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
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


def failure_schedule(steps: int, every: int, rate: float | None, seed: int,
                     plus_stage: int) -> list[tuple[int, int, int]]:
    """(step, middle stage, any stage) of each failure: periodic (every ``every`` steps; stage
    2, and ``plus_stage`` for checkfree_plus) without ``rate``, else a Bernoulli process over
    steps 2..steps with one uniform draw per failure for its stage (see the module's text)."""
    if rate is None:
        return [(k * every, 2, plus_stage) for k in range(1, (steps - 1) // every + 1)]
    rng = random.Random(seed)
    out = []
    for step in range(2, steps + 1):
        if rng.random() < rate:
            x = rng.random()
            out.append((step, 1 + int(2 * x), int(4 * x)))
    return out


def run(mode: str, workdir: Path, steps: int, interval: int, eval_every: int,
        failures: list[tuple[int, int, int]]) -> dict:
    run_dir = workdir / mode
    args = base_args(steps, eval_every) + [f"--train.run_dir={run_dir}"]
    kill_steps = [step for step, _, _ in failures] if mode in (
        "checkfree", "checkfree_plus", "checkpoint") else []
    stages = [plus if mode == "checkfree_plus" else middle for _, middle, plus in failures]
    kills = len(kill_steps)
    if mode in ("checkfree", "checkfree_plus"):
        args += [f"--fault.recovery={mode}"]
        if kills:
            args += [f"--fault.test_kill_stages={','.join(map(str, stages))}",
                     f"--fault.test_kill_steps={','.join(map(str, kill_steps))}"]
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
                    and row["step"] == kill_steps[killed] - 1):
                _kill_rank(proc.pid, stages[killed])
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
            "kill_steps": kill_steps, "kill_stages": stages[:kills],
            "failure_cost_s": failure_costs(logged, kill_steps),
            "stderr_tail": stderr[-1500:]}


def failure_costs(logged: dict[int, float], kill_steps: list[int]) -> list[float | None]:
    """Per kill at step k: the wall-clock between the rows of steps k - 1 and k, minus the
    median gap between consecutive rows of steps no kill touched (None where a row is missing).
    Rows are seen by polling every 50 ms, and an evaluation step's row comes later by the
    evaluation's time: a few tenths of a second of noise."""
    killed = set(kill_steps)
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
    parser.add_argument("--failure-rate", type=float, default=None,
                        help="instead of --every: each step fails with this probability")
    parser.add_argument("--seed", type=int, default=0, help="trial t draws its failures from"
                        " seed + t (with --failure-rate)")
    parser.add_argument("--interval", type=int, default=10, help="checkpoint interval")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target-step", type=int, default=None,
                        help="the failure-free run's evaluation that sets the target")
    parser.add_argument("--none-every", type=int, default=1,
                        help="run the failure-free mode in every K-th trial only")
    parser.add_argument("--modes", default="none,checkfree,checkfree_plus,checkpoint",
                        help="comma-separated: none, checkfree, checkfree_plus, checkpoint,"
                        " checkfree_plus_nofail (out of order, no kill)")
    parser.add_argument("--plus-stage", type=int, default=0,
                        help="the stage killed in the periodic checkfree_plus runs (0..3)")
    parser.add_argument("--report", metavar="JSON", default=None,
                        help="run nothing: report the runs saved in JSON (a checkfree.json)"
                        " against --target-step (with the --steps and --eval-every they ran)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"none", "checkfree", "checkfree_plus", "checkpoint",
                            "checkfree_plus_nofail"}
    if unknown or "none" not in modes:
        parser.error(f"--modes: unknown {sorted(unknown)}" if unknown
                     else "--modes must include none (it sets the target)")
    if not 0 <= args.plus_stage <= 3:
        parser.error(f"--plus-stage must be in 0..3 (pp = 4), got {args.plus_stage}")
    if args.failure_rate is not None and not 0 <= args.failure_rate < 1:
        parser.error(f"--failure-rate must be in [0, 1), got {args.failure_rate}")
    if args.eval_every < 1 or args.steps < 2 or args.trials < 1 or args.every < 1:
        parser.error("--eval-every, --every and --trials must be >= 1 and --steps >= 2")
    if args.none_every < 1:
        parser.error(f"--none-every must be >= 1, got {args.none_every}")
    target_step = args.target_step
    if target_step is None:  # the last evaluation
        target_step = args.steps // args.eval_every * args.eval_every
    if target_step % args.eval_every or not 0 < target_step <= args.steps:
        parser.error(f"--target-step must be an evaluation step in (0, {args.steps}],"
                     f" got {target_step}")
    if args.report:  # the runs of an earlier invocation, measured against --target-step
        saved = json.loads(Path(args.report).read_text())
        results, modes = saved["results"], list(dict.fromkeys(r["mode"] for r in saved["results"]))
        report(results, modes, target_step, "as recorded in " + args.report, args.interval)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            failures = failure_schedule(args.steps, args.every, args.failure_rate,
                                        args.seed + trial, args.plus_stage)
            for mode in modes:
                if mode == "none" and trial % args.none_every:
                    continue
                workdir = Path(tmp) / f"t{trial}"
                workdir.mkdir(exist_ok=True)
                res = run(mode, workdir, args.steps, args.interval, args.eval_every, failures)
                res["trial"] = trial
                results.append(res)
                print(f"trial {trial} {mode:10s} exit {res['exit_code']} wall {res['wall_s']:.1f}s"
                      f" kills {list(zip(res['kill_steps'], res['kill_stages']))}"
                      f" recoveries {res['recoveries']} evals"
                      f" {[(round(t, 1), s, round(v, 3)) for t, s, v in res['evals']]}",
                      flush=True)
                shutil.rmtree(workdir / mode, ignore_errors=True)
    failures = ("periodic: a kill every %d steps" % args.every if args.failure_rate is None
                else f"random: each step fails with probability {args.failure_rate}"
                f" (seeds {args.seed}..{args.seed + args.trials - 1})")
    report(results, modes, target_step, failures, args.interval)
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "checkfree.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                   indent=1))
    return 0


def report(results: list[dict], modes: list[str], target_step: int, failures: str,
           interval: int) -> None:
    """Time to the failure-free run's validation loss at ``target_step``, per run and per mode
    (adds the target's fields to each result)."""
    base = next(r for r in results if r["mode"] == "none")
    target = next((v for _, s, v in base["evals"] if s == target_step), None)
    for res in results:
        res["target"] = target
        hit = next((t for t, _, v in res["evals"] if target is not None and v <= target), None)
        res["time_to_target_s"] = hit
        res["train_to_target_s"] = hit - res["first_step_s"] if hit is not None \
            and res["first_step_s"] is not None else None
        res["steps_to_target"] = next((s for _, s, v in res["evals"]
                                       if target is not None and v <= target), None)
    print(f"\ntarget: the failure-free run's validation loss at step {target_step}"
          f" ({target if target is not None else float('nan'):.4f}); failures {failures};"
          f" checkpoints every {interval} steps for the restart mode")
    print(f"{'trial':>5} {'mode':>14} {'kills':>5} {'to target (s)':>14}"
          f" {'from step 1 (s)':>15} {'at step':>7} {'final val':>9} {'wall (s)':>8}"
          "  per failure (s)")
    for res in results:
        final = res["evals"][-1][2] if res["evals"] else float("nan")
        hit, train = res["time_to_target_s"], res["train_to_target_s"]
        costs = " ".join("-" if c is None else f"{c:.1f}" for c in res["failure_cost_s"])
        print(f"{res['trial']:>5} {res['mode']:>14} {len(res['kill_steps']):>5}"
              f" {('%.1f' % hit) if hit is not None else 'not reached':>14}"
              f" {('%.1f' % train) if train is not None else '-':>15}"
              f" {res['steps_to_target'] or '-':>7} {final:>9.3f}"
              f" {res['wall_s']:>8.1f}  {costs}")
    print("\nper mode over the trials: median / mean; 'steps' is the evaluation at which the"
          " target was reached")
    print(f"{'mode':>14} {'runs':>4} {'reached':>7} {'kills':>5} {'from step 1 (s)':>17}"
          f" {'steps':>11} {'per failure (s)':>17} {'final val':>17}")
    for mode in modes:
        rows = [r for r in results if r["mode"] == mode]
        reached = [r for r in rows if r["train_to_target_s"] is not None]
        costs = [c for r in rows for c in r["failure_cost_s"] if c is not None]
        finals = [r["evals"][-1][2] for r in rows if r["evals"]]
        print(f"{mode:>14} {len(rows):>4} {len(reached):>7}"
              f" {sum(len(r['kill_steps']) for r in rows):>5}"
              f" {_stat([r['train_to_target_s'] for r in reached], '.1f'):>17}"
              f" {_stat([r['steps_to_target'] for r in reached], '.1f'):>11}"
              f" {_stat(costs, '.1f'):>17} {_stat(finals, '.3f'):>17}")


def _stat(values: list[float], spec: str) -> str:
    """'median / mean' of ``values``, or '-' when there are none."""
    if not values:
        return "-"
    return f"{statistics.median(values):{spec}} / {statistics.fmean(values):{spec}}"


if __name__ == "__main__":
    raise SystemExit(main())
