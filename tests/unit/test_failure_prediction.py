"""The expected wall-clock under stage failures (``loom.sim.failures``): the closed form agrees
with the same process run event by event (300 seeded runs, within 4%: the runs' own spread at
the higher failure rate), and it behaves as recovery costs say it must."""

import math
import statistics

import pytest

from loom.sim.failures import (FailureCosts, expected_wall, failures_per_second, predict,
                               simulate)

COSTS = FailureCosts(step_s=2.0, restart_s=60.0, write_s=10.0, rebuild_s=15.0, extra_steps=5.0,
                     plus_convergence=1.1)


@pytest.mark.parametrize("mode,interval", [("checkpoint", 20), ("checkpoint", 100),
                                           ("checkfree", 0), ("checkfree_plus", 0)])
@pytest.mark.parametrize("stages,rate", [(16, 0.1), (64, 0.5)])
def test_the_closed_form_is_the_mean_of_the_simulated_runs(mode, interval, stages, rate):
    lam = failures_per_second(stages, rate)
    expected = expected_wall(mode, 2000, COSTS, lam, interval)
    runs = [simulate(mode, 2000, COSTS, lam, interval, seed=seed) for seed in range(300)]
    assert statistics.mean(runs) == pytest.approx(expected, rel=0.04)
    assert min(runs) >= (2000 * COSTS.step_s * (COSTS.plus_convergence
                                                 if mode == "checkfree_plus" else 1))


def test_without_failures_the_modes_cost_their_steps_and_writes():
    assert expected_wall("checkfree", 100, COSTS, 0.0) == 200.0
    assert expected_wall("checkfree_plus", 100, COSTS, 0.0) == pytest.approx(220.0)
    # 9 writes: none after the last step
    assert expected_wall("checkpoint", 100, COSTS, 0.0, interval=10) == 290.0


def test_checkfree_gains_grow_with_the_failure_rate_and_failures_can_outpace_progress():
    ratios = []
    for rate in (0.01, 0.1, 0.3):
        ckpt, free, _ = predict(20_000, COSTS, 32, rate)
        ratios.append(ckpt.wall_s / free.wall_s)
    assert ratios == sorted(ratios) and ratios[0] > 1
    # each failure adding more steps than a step survives failures: CheckFree never finishes
    lam = 1 / COSTS.step_s
    assert math.isinf(expected_wall("checkfree", 10, COSTS, lam))
    # a checkpoint segment's expected time grows exponentially with its length
    assert expected_wall("checkpoint", 100, COSTS, lam, 100) > 1e6 * expected_wall(
        "checkpoint", 100, COSTS, lam, 1)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="checkfree"):
        expected_wall("pray", 10, COSTS, 0.0)
