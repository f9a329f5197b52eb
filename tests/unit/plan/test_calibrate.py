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


def test_a_measured_optimizer_step_prices_the_optimizer_per_parameter():
    """A CPU profile carries AdamW's measured seconds per parameter; the cost model charges it
    per parameter a rank steps (a ZeRO shard steps 1/d of them), instead of 28 bytes at the
    memory bandwidth."""
    from loom.models.presets import PRESETS
    from loom.plan.hardware import Cluster
    from loom.layout import Layout
    from loom.sim.cost_model import CostModel

    raw = synthetic(peak=4e10, knee=48.0, alpha=2e-5, beta=3e9, n=4)
    raw[0] = {**raw[0], "optimizer_per_param": 5e-9}
    gpu, link = fit(raw, nproc=4)
    assert gpu.optimizer_per_param == 5e-9
    model = CostModel(PRESETS["tiny"], 64, 8, Cluster(gpu, 4, 4, link, link), dtype_bytes=4)
    plain = model.evaluate(Layout(dp_replicate=4, micro_batch=2, microbatches=1)).optimizer
    sharded = model.evaluate(Layout(dp_shard=4, zero_stage=1, micro_batch=2,
                                    microbatches=1)).optimizer
    params = model.ranks.end_rank_params(Layout())[0]  # without a pipeline one rank holds them all
    assert plain == pytest.approx(5e-9 * params)
    assert sharded == pytest.approx(plain / 4)
    unmeasured, _ = fit(synthetic(peak=4e10, knee=48.0, alpha=2e-5, beta=3e9, n=4), nproc=4)
    assert unmeasured.optimizer_per_param == 0.0  # priced from the bandwidth


def test_planning_for_the_local_machine_needs_a_profile(tmp_path):
    with pytest.raises(HardwareError, match="--calibrate"):
        load_profile(tmp_path / "missing.json")


def test_layer_scale_recovers_how_much_slower_blocks_are_than_priced():
    """Blocks that take 1.5x the priced layer time plus the fixed per-pass cost give 1.5."""
    from dataclasses import replace

    from loom.models.layers import TransformerArgs
    from loom.plan.calibrate import BLOCKS, layer_scale
    from loom.plan.hardware import Cluster
    from loom.layout import Layout
    from loom.sim.cost_model import CostModel

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
    """Probe step times made by the cost model with known per-pass, per-step and per-token work
    for each wrapper are solved back to that work (base first, the others on top of it), and a
    wrapper that adds nothing gets nothing (the fit is non-negative)."""
    from dataclasses import replace

    from loom.plan.probes import PROBE_SHAPES, _key, _predict, fit_framework, probe_layouts

    gpu, link = fit(synthetic(peak=4e10, knee=48.0, alpha=2e-5, beta=3e9, n=4), nproc=4)
    gpu = replace(gpu, cores=2.0)
    truth = (("base", 2e-3, 0.05, 1e-6), ("tp", 4e-3, 0.01, 3e-6), ("zero3", 1e-3, 0.02, 0.0),
             ("zero1", 0.0, 0.01, 0.0), ("zero2", 5e-4, 0.03, 0.0), ("ring", 3e-3, 0.0, 2e-6),
             ("ulysses", 0.0, 0.0, 0.0),
             ("pp", 1e-3, 0.01, 5e-7))
    machine = replace(gpu, framework=truth)
    probes = {name: {_key(d, b): _predict(probe_layouts(4, b)[name], d, machine, link, 4)
                     for d, b in PROBE_SHAPES} for name in probe_layouts(4)}
    fitted = fit_framework(probes, gpu, link, 4)
    assert [entry[0] for entry in fitted] == [entry[0] for entry in truth]
    for got, want in zip(fitted, truth):
        assert got[1:] == pytest.approx(want[1:], rel=0.05, abs=2e-5), got[0]
