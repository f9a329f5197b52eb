"""The step's gradient-handling and optimizer traffic (``loom.sim.optimizer_cost``) against the
byte counts its docstring derives from each stack's code, written out by hand here, and the
cost model's optimizer time against those bytes over the HBM bandwidth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom.layout import Layout
from loom.models.presets import PRESETS, parameter_count
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS, LOOM, Framework
from loom.sim.optimizer_cost import StepTraffic, step_traffic

DEBUG = PRESETS["debug"]
P = parameter_count(DEBUG)  # every parameter on one rank at pp = tp = 1
FAST = Link("fast", 100 * GB, 1e-6, efficiency=1.0)
UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)


def traffic(stack: str, m: int, master: bool = True, **kw) -> tuple[float, float]:
    t = step_traffic(stack, microbatches=m, master=master, **kw)
    return t.full, t.shard


def test_loom_bf16_one_rank_counts_fold_clip_step_and_copy_back():
    """fold 6 then 10 per microbatch; norm 4 + scale 8; fused AdamW 28; masters to bf16 6."""
    assert traffic("loom", 1) == (6, 4 + 8 + 28 + 6)
    assert traffic("loom", 2) == (6 + 10, 46)  # 62 per parameter: 34 more than AdamW's 28
    assert traffic("loom", 5) == (6 + 4 * 10, 46)


def test_each_microbatch_adds_a_fold_for_loom_and_none_for_megatrons_fused_accumulation():
    for m in (1, 2, 3, 8):
        loom_more = traffic("loom", m + 1)[0] - traffic("loom", m)[0]
        megatron_more = traffic("megatron", m + 1)[0] - traffic("megatron", m)[0]
        assert (loom_more, megatron_more) == (10, 0)
    # Megatron: the main_grad buffer zeroed (4); norm 4, scale 8, fused Adam 28, copy back 6
    assert traffic("megatron", 4) == (4, 46)
    # DeepSpeed: a fold of 10 every microbatch into the zeroed fp32 buffer; at ZeRO-2/3 a
    # bucket copy of the full gradient (4) and the fold on the reduced partition instead
    assert traffic("deepspeed", 2) == (2 * 10 + 4, 46)
    assert traffic("deepspeed", 2, zero_stage=3) == (2 * 4, 2 * 10 + 4 + 46)


def test_fp32_parameters_have_no_master_copy_back():
    """fp32: autograd's in-place add after the first microbatch (12), no rounding back."""
    assert traffic("loom", 1, master=False) == (0, 4 + 8 + 28)
    assert traffic("loom", 3, master=False) == (2 * 12, 40)
    assert traffic("megatron", 2, master=False) == (4, 40)
    assert traffic("deepspeed", 2, master=False)[1] == 40
    # the copy back is the whole difference on the stepped side, for every non-FSDP path
    for stack in ("loom", "megatron", "deepspeed"):
        assert traffic(stack, 2)[1] - traffic(stack, 2, master=False)[1] == 6


def test_loom_zero_stages_fold_full_gradients_and_step_their_slices():
    # ZeRO-1: every microbatch adds into the zeroed full buffer (10 m + 4); the slice copied
    # and divided (16), squared norm 12 + scale 8, AdamW 28, copied to the gather's input 6
    assert traffic("loom", 2, zero_stage=1) == (2 * 10 + 4, 16 + 12 + 8 + 28 + 6)
    assert traffic("loom", 2, master=False, zero_stage=1) == (2 * 12 + 4, 16 + 20 + 28 + 8)
    # ZeRO-2: accumulated per parameter, then zero-filled and packed (4 + 8)
    assert traffic("loom", 2, zero_stage=2) == (6 + 10 + 12, 70)
    # ZeRO-3 (FSDP2): upcast 6, add 10, copy-in 8; per gather full 4 and shard 6
    assert traffic("loom", 2, zero_stage=3, gathers=4) == (6 + 10 + 8 + 4 * 4,
                                                           4 * 6 + 12 + 8 + 28)
    assert traffic("loom", 1, zero_stage=3, gathers=2) == (6 + 2 * 4, 2 * 6 + 48)
    assert traffic("loom", 2, master=False, zero_stage=3, gathers=4) == (12 + 8 + 4 * 8,
                                                                         4 * 8 + 48)
    # torchtitan: FSDP2's counts, its norm one read; without FSDP fp32 under autocast
    assert traffic("torchtitan", 1, zero_stage=3, gathers=2) == (6 + 8, 12 + 4 + 8 + 28)
    assert traffic("torchtitan", 2, zero_stage=0) == (12, 40)
    # its ZeRO-2 is FSDP2 kept gathered: one gather per step
    assert traffic("torchtitan", 2, zero_stage=2, gathers=1) == (6 + 10 + 8 + 4, 6 + 40)


def test_clipping_off_keeps_the_norm_and_foreach_adamw_makes_eight_passes():
    assert traffic("loom", 2, clip=False)[1] == 4 + 28 + 6
    assert traffic("loom", 2, fused=False)[1] == 12 + 80 + 6
    assert traffic("loom", 2, zero_stage=1, clip=False)[1] == 70 - 8
    assert StepTraffic(10, 20).bytes(3, 1) == 50


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="microbatches"):
        step_traffic("loom", microbatches=0, master=True)
    with pytest.raises(ValueError, match="zero_stage"):
        step_traffic("loom", microbatches=1, master=True, zero_stage=4)
    with pytest.raises(ValueError, match="stack"):
        step_traffic("nemo", microbatches=1, master=True)
    with pytest.raises(ValueError, match="step_path"):
        replace(LOOM, step_path="nemo")


def test_profiles_name_their_own_paths():
    assert {name: fw.step_path for name, fw in FRAMEWORKS.items()} == {
        "loom": "loom", "megatron": "megatron", "torchtitan": "torchtitan",
        "deepspeed": "deepspeed", "scaling": "megatron"}


def _model(gpus: int, framework: Framework = LOOM, **kw) -> CostModel:
    return CostModel(DEBUG, 32, 2 * gpus, Cluster(UNIT, gpus, 8, FAST, FAST),
                     framework=framework, **kw)


def test_the_optimizer_time_is_these_bytes_over_the_bandwidth():
    """On a 1 TB/s part with no per-step framework work: one rank, bf16, m = 2, 62 bytes per
    parameter; ZeRO-1 over 4 ranks 24 per held and 70 per stepped (a quarter) parameter;
    ZeRO-3 40 and 72; Megatron's distributed optimizer 4 and 46; fp32 (4-byte compute) 12 + 40."""
    one = Layout(micro_batch=1, microbatches=2)
    assert _model(1).evaluate(one).optimizer == pytest.approx(62 * P / 1e12, rel=1e-12)
    assert _model(1, dtype_bytes=4).evaluate(one).optimizer == \
        pytest.approx((12 + 40) * P / 1e12, rel=1e-12)
    for stage, full, shard in ((1, 24, 70), (3, 40, 72)):
        lay = Layout(dp_shard=4, zero_stage=stage, micro_batch=1, microbatches=2)
        assert _model(4).evaluate(lay).optimizer == \
            pytest.approx((full * P + shard * P / 4) / 1e12, rel=1e-12)
    lay = Layout(dp_shard=4, zero_stage=1, micro_batch=1, microbatches=2)
    assert _model(4, FRAMEWORKS["megatron"]).evaluate(lay).optimizer == \
        pytest.approx((4 * P + 46 * P / 4) / 1e12, rel=1e-12)


def test_the_step_time_moves_by_exactly_the_scale_bytes_over_the_bandwidth():
    """Clipping's scale (8 bytes per stepped parameter) is all that turning it off removes."""
    lay = Layout(micro_batch=1, microbatches=2)
    on = _model(1).evaluate(lay).step_time
    off = _model(1, grad_clip=False).evaluate(lay).step_time
    assert on - off == pytest.approx(8 * P / 1e12, rel=1e-9)
