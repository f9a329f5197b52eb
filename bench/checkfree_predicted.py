"""PREDICTED wall-clock to a training target under stage failures, checkpoint restarts vs
CheckFree, extrapolated by ``loom.sim.failures`` to pipelines and failure rates this machine
cannot run (issue 18 item 6). Never measured: labelled as predicted in docs/benchmarks.md.

    python bench/checkfree_predicted.py      # markdown tables on stdout

Two cost settings:
- ``measured here``: the tiny model's costs from bench/checkfree.py (docs/benchmarks.md, load
  15-25): 1.5 s steps, a checkpoint restart 29 s plus the lost steps (33-39 s per failure
  measured with 4 steps recomputed), 0.5 s per checkpoint write, 10 s per rebuild, 5 steps to
  recover the loss over 3 rebuilds (target reached at step 50 instead of 45): 5/3 per rebuild,
  45 steps to target. CheckFree+ left out: its out-of-order training did not reach the target.
- ``a large model (assumed)``: 10 s steps, 600 s restarts, 120 s writes, 60 s rebuilds, 20
  steps to recover per rebuild, 20,000 steps, CheckFree+ needing 5% more steps in order: the
  scale of the CheckFree paper's setting, not a measurement.
"""

from __future__ import annotations

import math

from loom.sim.failures import FailureCosts, predict

SETTINGS = {  # name: (steps to target, costs, unit of the table: seconds or hours)
    "measured here (tiny model)": (45, FailureCosts(step_s=1.5, restart_s=29.0, write_s=0.5,
                                                    rebuild_s=10.0, extra_steps=5 / 3,
                                                    plus_convergence=math.inf), 1.0),
    "a large model (assumed)": (20_000, FailureCosts(step_s=10.0, restart_s=600.0, write_s=120.0,
                                                     rebuild_s=60.0, extra_steps=20.0,
                                                     plus_convergence=1.05), 3600.0),
}
STAGES = (8, 32, 128)
RATES = (0.05, 0.10, 0.16)  # failures per stage per hour


def shown(seconds: float, unit: float) -> str:
    return "diverges" if math.isinf(seconds) else f"{seconds / unit:.2f}"


def main() -> None:
    for name, (steps, costs, unit) in SETTINGS.items():
        u = "s" if unit == 1 else "h"
        print(f"\n{name}: {steps} steps to target (PREDICTED, loom.sim.failures)\n")
        print(f"| stages | failures / stage / hour | checkpoint {u} (interval) | checkfree {u} |"
              f" checkfree_plus {u} | checkpoint / checkfree |")
        print("|---|---|---|---|---|---|")
        for stages in STAGES:
            for rate in RATES:
                ckpt, free, plus = predict(steps, costs, stages, rate)
                ratio = (f"{ckpt.wall_s / free.wall_s:.2f}x" if math.isfinite(free.wall_s)
                         and math.isfinite(ckpt.wall_s) else "-")
                extra = ("not reached" if math.isinf(costs.plus_convergence)
                         else shown(plus.wall_s, unit))
                print(f"| {stages} | {rate:.0%} | {shown(ckpt.wall_s, unit)} ({ckpt.interval}) |"
                      f" {shown(free.wall_s, unit)} | {extra} | {ratio} |")


if __name__ == "__main__":
    main()
