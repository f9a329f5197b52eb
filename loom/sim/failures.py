"""Expected wall-clock to a training target under random stage failures: checkpoint restarts
against CheckFree's rebuilds (issue 18 item 6's extrapolation, PREDICTED, never measured here).

The process: a pipeline of ``stages`` nodes, each failing as a Poisson process of
``rate_per_hour``; the run needs ``steps`` failure-free steps of ``step_s`` seconds to reach its
target. Every failure, at any moment (during a recovery too), costs:

* ``checkpoint``: a checkpoint every ``interval`` steps costs ``write_s``; a failure costs a
  restart (``restart_s``: processes, imports, loading) and the work since the last checkpoint;
* ``checkfree`` (and ``checkfree_plus``): a rebuild (``rebuild_s``: the replacement's start-up
  and its neighbours' weights), the interrupted step, and ``extra_steps`` steps the run needs to
  recover the loss the averaged stage lost (measured: 5 steps over 3 rebuilds on the tiny
  model, docs/benchmarks.md); CheckFree+'s out-of-order training can also need more steps to
  reach the target without any failure (``plus_convergence``, a factor on ``steps``).

With failures at rate ``lam = stages * rate_per_hour / 3600``, a piece of work of ``L``
seconds that a failure sends back to its start after a recovery of ``R`` takes
``e^(lam R) (e^(lam L) - 1) / lam`` in expectation (Daly 2006): checkpoint segments are such
pieces; under CheckFree each step is, and each failure adds ``extra_steps`` steps. The
checkpoint interval is the one of ``intervals`` with the least wall-clock (Young/Daly's optimum
lies near ``sqrt(2 write / lam) / step``). ``simulate`` runs the same process event by event (seeded), which the tests
compare with the closed form. What it leaves out: two failures of neighbouring stages at once
(CheckFree cannot rebuild those from their neighbours and would fall back to a checkpoint),
and the data-parallel replicas a real cluster would also lose. CheckFree+ is priced as
CheckFree with its convergence factor (its first and last stage rebuilt at the same cost).
Torch-free.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

MODES = ("checkpoint", "checkfree", "checkfree_plus")


@dataclass(frozen=True)
class FailureCosts:
    """What one run's recoveries cost (seconds, steps) and how fast it trains."""

    step_s: float
    restart_s: float  # checkpoint restart: every process back, the checkpoint loaded
    write_s: float  # one checkpoint written (blocking)
    rebuild_s: float  # CheckFree: the replacement started and rebuilt from its neighbours
    extra_steps: float  # CheckFree: steps to recover the loss after a rebuild
    plus_convergence: float = 1.0  # CheckFree+: steps to target over in-order training's


@dataclass(frozen=True)
class Outcome:
    mode: str
    wall_s: float  # expected wall-clock to the target (inf: failures outpace progress)
    failures: float  # expected failures over the run
    interval: int = 0  # checkpoint: the interval chosen


def failures_per_second(stages: int, rate_per_hour: float) -> float:
    return stages * rate_per_hour / 3600.0


def attempt_time(seconds: float, recovery_s: float, lam: float) -> float:
    """Expected wall-clock to get through ``seconds`` of work that a failure sends back to its
    start after ``recovery_s`` (failures during a recovery restart it too): exponential failures
    give ``e^(lam R) (e^(lam L) - 1) / lam`` (Daly 2006)."""
    if lam == 0:
        return seconds
    return math.exp(lam * recovery_s) * math.expm1(lam * seconds) / lam


def expected_wall(mode: str, steps: int, costs: FailureCosts, lam: float,
                  interval: int = 0) -> float:
    """Expected wall-clock of ``mode`` (module docstring); ``interval`` for checkpoints. Exact
    for the process ``simulate`` runs (Poisson failures)."""
    if mode == "checkpoint":
        if interval < 1:
            raise ValueError("checkpoint: interval must be >= 1")
        # segments of ``interval`` steps and a write, each restarted from its checkpoint; the
        # last has no write
        full, last = divmod(steps, interval)
        segments = [interval * costs.step_s + costs.write_s] * full
        if last:
            segments.append(last * costs.step_s)
        else:
            segments[-1] -= costs.write_s
        return sum(attempt_time(length, costs.restart_s, lam) for length in segments)
    if mode not in ("checkfree", "checkfree_plus"):
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    # every step is retried after a rebuild; each failure (in a step or a rebuild) adds
    # ``extra_steps`` steps, so n steps need n (1 + extra f) with f failures per done step
    per_step = attempt_time(costs.step_s, costs.rebuild_s, lam)
    failures = math.expm1(lam * costs.step_s) * math.exp(lam * costs.rebuild_s)
    load = costs.extra_steps * failures
    if load >= 1:
        return math.inf
    scale = costs.plus_convergence if mode == "checkfree_plus" else 1.0
    return steps * scale * per_step / (1 - load)


def predict(steps: int, costs: FailureCosts, stages: int, rate_per_hour: float,
            intervals: Sequence[int] = (5, 10, 20, 50, 100, 200, 500, 1000)) -> list[Outcome]:
    """Each mode's expected wall-clock to ``steps`` (checkpoints at their best interval)."""
    lam = failures_per_second(stages, rate_per_hour)
    out = []
    best = min(((expected_wall("checkpoint", steps, costs, lam, k), k) for k in intervals))
    out.append(Outcome("checkpoint", best[0], lam * best[0], best[1]))
    for mode in ("checkfree", "checkfree_plus"):
        wall = expected_wall(mode, steps, costs, lam)
        out.append(Outcome(mode, wall, lam * wall))
    return out


def simulate(mode: str, steps: int, costs: FailureCosts, lam: float, interval: int = 0,
             seed: int = 0) -> float:
    """One run of the same process, event by event: the wall-clock to ``steps``."""
    rng = random.Random(seed)
    clock = 0.0
    next_failure = rng.expovariate(lam) if lam > 0 else math.inf

    def spend(seconds: float) -> bool:
        """Advance by ``seconds`` unless a failure comes first; True if it completed."""
        nonlocal clock, next_failure
        if clock + seconds <= next_failure:
            clock += seconds
            return True
        clock = next_failure
        next_failure = clock + (rng.expovariate(lam) if lam > 0 else math.inf)
        return False

    def recover(seconds: float) -> None:
        while not spend(seconds):  # a failure during a recovery starts it again
            pass

    if mode == "checkpoint":
        saved = done = 0
        while done < steps:
            if spend(costs.step_s):
                done += 1
                if done % interval == 0 and done < steps:
                    if spend(costs.write_s):
                        saved = done
                    else:
                        recover(costs.restart_s)
                        done = saved
            else:
                recover(costs.restart_s)
                done = saved
        return clock
    scale = costs.plus_convergence if mode == "checkfree_plus" else 1.0
    remaining = steps * scale
    while remaining > 1e-9:
        if spend(min(1.0, remaining) * costs.step_s):
            remaining -= min(1.0, remaining)
        else:
            recover(costs.rebuild_s)
            remaining += costs.extra_steps
    return clock


__all__ = ["MODES", "FailureCosts", "Outcome", "attempt_time", "failures_per_second",
           "expected_wall",
           "predict", "simulate"]
