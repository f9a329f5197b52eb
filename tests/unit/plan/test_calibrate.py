"""Calibration: the fits recover known machine constants, and a missing profile is named."""

from __future__ import annotations

import pytest

from loom.plan.calibrate import ALLREDUCE_BYTES, SMALLEST_DIMS, fit, load_profile
from loom.plan.hardware import HardwareError


def synthetic(peak: float, knee: float, alpha: float, beta: float, n: int) -> dict:
    """What ``measure`` would return on a machine that follows the cost model exactly."""
    rank = {
        "matmul": {str(d): peak * d / (d + knee) for d in SMALLEST_DIMS},
        "memory_bandwidth": 5e9,
        "block_pass": 3e-3,
        "allreduce": {str(m): 2 * (n - 1) * alpha + 2 * (n - 1) / n * m / beta
                      for m in ALLREDUCE_BYTES},
    }
    return {r: rank for r in range(n)}


def test_fit_recovers_the_matmul_curve_and_the_link():
    gpu, link = fit(synthetic(peak=4e10, knee=48.0, alpha=2e-5, beta=3e9, n=4), nproc=4)
    assert gpu.peak_flops == pytest.approx(4e10, rel=1e-9)
    assert gpu.matmul_knee == pytest.approx(48.0, rel=1e-9)
    assert gpu.matmul_rate(48.0) == pytest.approx(2e10, rel=1e-9)
    assert gpu.op_overhead == pytest.approx(1e-3)
    assert link.latency == pytest.approx(2e-5, rel=1e-6)
    assert link.bandwidth == pytest.approx(3e9, rel=1e-6)


def test_planning_for_the_local_machine_needs_a_profile(tmp_path):
    with pytest.raises(HardwareError, match="--calibrate"):
        load_profile(tmp_path / "missing.json")
