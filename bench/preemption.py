"""Preemption trials: SIGTERM `loom train` (the launcher, one random worker, or the whole process
group as Slurm does) at a random moment of training, resume with `--resume auto`, and check that
the final weights are bit-identical to an uninterrupted run.

    python bench/preemption.py [--trials 20] [--seed 0]

Each trial is a 2-process `loom train` of the debug model (150 steps, no periodic checkpoints:
the preemption checkpoint is the only one). The signal goes out once a uniformly random number
of steps (1 to 149) is logged, plus a uniformly random fraction of the mean step time, so it lands
in any phase of a step (forward, all-reduce, optimizer, logging). Prints one line per trial
(target, step reached, seconds from the signal to exit 0, bit-identical) and the counts; writes
``bench/out/preemption.json``. A run that finished before its signal landed is compared as is.
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

from tests.e2e.test_cli_train import _worker_pids  # noqa: E402
from tests.e2e.test_fault_restart import ENV, _steps_logged, _weights  # noqa: E402
from tests.e2e.test_preemption import ARGS as TEST_ARGS, PREEMPTED  # noqa: E402

STEPS = 150  # the test's arguments, with a longer run to preempt at random moments
ARGS = [a for a in TEST_ARGS if not a.startswith("--train.steps=")] + [f"--train.steps={STEPS}"]


def launch(workdir: Path, *extra: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "loom", "train", *ARGS, *extra,
                             "--train.run_dir=runs/r"], cwd=workdir, env=ENV, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, **kwargs)


def straight(workdir: Path) -> tuple[dict, float]:
    """The uninterrupted run's weights and its training time (first logged step to exit)."""
    proc = launch(workdir)
    while _steps_logged(workdir / "runs" / "r") < 1:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.01)
    first = time.monotonic()
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    return _weights(workdir / "runs" / "r"), time.monotonic() - first


def trial(workdir: Path, after_steps: int, delay: float, target: str, expected: dict) -> dict:
    proc = launch(workdir)
    result = {"target": target, "after_steps": after_steps, "delay_s": round(delay, 4)}
    try:
        pids: dict[int, int] = {}
        while _steps_logged(workdir / "runs" / "r") < after_steps and proc.poll() is None:
            if len(pids) < 2:
                pids = _worker_pids(proc.pid)
            time.sleep(0.002)
        time.sleep(delay)
        pid = proc.pid if target in ("launcher", "group") else pids.get(int(target[4:]))
        if proc.poll() is not None or pid is None:
            proc.communicate(timeout=600)
            return {**result, "signalled": False, "exit_code": proc.returncode,
                    "bit_identical": proc.returncode == 0 and same(workdir, expected)}
        if target == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=600)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    found = PREEMPTED.findall(stderr)
    result.update(signalled=True, exit_code=proc.returncode, seconds_to_exit=round(took, 2),
                  preempted_at_step=int(found[0][0]) if found else None,
                  traceback="Traceback" in stderr)
    if proc.returncode == 0 and not found:  # the signal landed after the last step
        result["bit_identical"] = same(workdir, expected)
        return result
    if proc.returncode != 0:
        result["stderr_tail"] = stderr[-1500:]
    resumed = subprocess.run([sys.executable, "-m", "loom", "train", *ARGS, "--resume", "auto",
                              "--train.run_dir=runs/r"], cwd=workdir, env=ENV, text=True,
                             capture_output=True, timeout=600)
    result["resume_exit_code"] = resumed.returncode
    result["bit_identical"] = resumed.returncode == 0 and same(workdir, expected)
    return result


def same(workdir: Path, expected: dict) -> bool:
    got = _weights(workdir / "runs" / "r")
    return set(got) == set(expected) and all((got[k] == v).all().item()
                                              for k, v in expected.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        (base / "straight").mkdir()
        expected, window = straight(base / "straight")
        print(f"uninterrupted: {STEPS} steps, training took {window:.1f} s", flush=True)
        results = []
        for i in range(args.trials):
            workdir = base / f"trial{i}"
            workdir.mkdir()
            target = rng.choice(["launcher", "rank0", "rank1", "group"])
            result = trial(workdir, rng.randint(1, STEPS - 1), rng.uniform(0, window / STEPS),
                           target, expected)
            results.append(result)
            print(f"trial {i + 1}: {result}", flush=True)
    signalled = [r for r in results if r["signalled"]]
    stopped = [r for r in signalled if r["exit_code"] == 0 and r["preempted_at_step"]
               and not r["traceback"]]
    finished = [r for r in results if r["exit_code"] == 0 and not r.get("preempted_at_step")]
    failed = [r for r in results if r["exit_code"] != 0]
    ok = sum(r["bit_identical"] for r in results)
    times = sorted(r["seconds_to_exit"] for r in stopped) or [0.0]
    print(f"{len(stopped)} / {len(results)} runs preempted mid-training with exit 0 and a"
          f" checkpoint (signal to exit {times[0]:.1f}-{times[-1]:.1f} s, median"
          f" {times[len(times) // 2]:.1f} s); {len(finished)} finished before the signal"
          f" took effect; {len(failed)} failed; {ok} / {len(results)} final weights"
          " bit-identical to the uninterrupted run")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "preemption.json").write_text(json.dumps({
        "trials": results, "preempted": len(stopped), "finished_first": len(finished),
        "failed": len(failed), "identical": ok, "training_window_s": window,
        "command": " ".join(sys.argv)}, indent=1))
    return 0 if ok == len(results) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
