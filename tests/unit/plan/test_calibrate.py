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


def test_layer_scale_recovers_how_much_slower_blocks_are_than_priced():
    """Blocks that take 1.5x the priced layer time plus the fixed per-pass cost give 1.5."""
    from dataclasses import replace

    from loom.models.llama import TransformerArgs
    from loom.plan.calibrate import BLOCKS, layer_scale
    from loom.plan.hardware import Cluster
    from loom.sim.cost_model import CostModel, Layout

    gpu, link = fit(synthetic(peak=4e10, knee=48.0, alpha=2e-5, beta=3e9, n=4), nproc=4)
    plain = replace(gpu, op_overhead=0.0)
    blocks = []
    for dim, ffn, heads, kv, seq, micro in BLOCKS[1:]:
        args = TransformerArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                               vocab_size=8, max_seq_len=seq)
        model = CostModel(args, seq, micro, Cluster(plain, 1, 1, link, link), dtype_bytes=4)
        f, i, w, _ = model._layer_times(Layout(micro_batch=micro), False)
        blocks.append([dim, ffn, heads, kv, seq, micro, 1.5 * (f + i + w) + 3 * gpu.op_overhead])
    assert layer_scale(gpu, link, blocks) == pytest.approx(1.5, rel=1e-9)
    assert layer_scale(gpu, link, []) == 1.0


def test_framework_fit_recovers_each_wrappers_work():
    """Probe step times made by the cost model with known per-pass and per-step work for each
    wrapper are solved back to that work (base first, the others on top of it)."""
    from dataclasses import replace

    from loom.plan.probes import PROBE_DEPTHS, _predict, fit_framework, probe_layouts

    gpu, link = fit(synthetic(peak=4e10, knee=48.0, alpha=2e-5, beta=3e9, n=4), nproc=4)
    gpu = replace(gpu, cores=2.0)
    truth = (("base", 2e-3, 0.05), ("tp", 4e-3, 0.01), ("zero3", 1e-3, 0.02),
             ("zero12", 0.0, 0.03), ("ring", 3e-3, 0.0), ("ulysses", 5e-4, 0.004),
             ("pp", 1e-3, 0.01))
    machine = replace(gpu, framework=truth)
    probes = {name: {d: _predict(lay, d, machine, link, 4) for d in PROBE_DEPTHS}
              for name, lay in probe_layouts(4).items()}
    fitted = fit_framework(probes, gpu, link, 4)
    assert [name for name, _, _ in fitted] == [name for name, _, _ in truth]
    for (name, x, y), (_, want_x, want_y) in zip(fitted, truth):
        assert x == pytest.approx(want_x, rel=0.05, abs=1e-5), name
        assert y == pytest.approx(want_y, rel=0.05, abs=1e-4), name
