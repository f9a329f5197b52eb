"""The planner's FP8 (``loom plan --fp8``): the blocks' linear FLOPs at the accelerator's FP8
peak plus the casts, by recipe (torchao's: which GEMMs run in FP8, which casts each makes),
the rest unchanged; refused where there are no FP8 matmuls."""

import json

import pytest

from loom.cli import main
from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import make_cluster
from loom.plan.search import plan, simulate_step
from loom.plan.space import Workload
from loom.sim.cost_model import CostModel
from loom.sim.fp8_cost import converted_share
from loom.sim.frameworks import LOOM

MODEL = PRESETS["llama3-8b"]


def priced(fp8: bool, layout: Layout, model=MODEL, gpu="H100-SXM"):
    return CostModel(model, 8192, 64, make_cluster(gpu, 8, 8), fp8=fp8)


def test_fp8_makes_the_linear_layers_faster_by_at_most_the_peak_ratio():
    layout = Layout(dp_shard=8, zero_stage=3)
    plain, fp8 = priced(False, layout), priced(True, layout)
    f16, f8 = plain._times(layout, False)[0], fp8._times(layout, False)[0]
    mat, core = plain.layer_flops(8192, 1, False)
    converted, _ = converted_share(MODEL, 8192, 1, False)
    assert converted == pytest.approx(mat)  # a dense layer: every linear converts
    gpu = plain.cluster.gpu
    saved = mat / gpu.matmul_rate(min(8192, MODEL.dim, MODEL.ffn_dim)) / 2  # 2x the peak
    assert f16 - saved < f8 < f16  # faster, but the casts cost something
    assert fp8.evaluate(layout).step_time < plain.evaluate(layout).step_time


def test_routed_experts_and_the_router_stay_in_16_bits():
    moe = PRESETS["mixtral-8x7b"]
    plain = priced(False, Layout(dp_shard=8), model=moe)
    converted, _ = converted_share(moe, 4096, 1, True)
    proj = 2 * 4096 * moe.dim * moe.head_dim * (2 * moe.n_heads + 2 * moe.n_kv_heads)
    assert converted == pytest.approx(proj)  # no shared experts: only attention's projections
    assert converted < plain.layer_flops(4096, 1, True)[0] / 3


def test_an_accelerator_without_fp8_matmuls_is_refused(capsys):
    with pytest.raises(ValueError, match="A100-80GB has no FP8"):
        priced(True, Layout(dp_shard=8), gpu="A100-80GB")
    code = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "A100-80GB", "--seq",
                 "4096", "--global-batch-tokens", "262144", "--fp8", "tensorwise"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("loom plan: --fp8 tensorwise:") and "\n" not in err


def test_the_plan_follows_loom_fp8_rules(capsys):
    """Loom refuses tensorwise scaling with cp (and takes FP8 with tensor parallelism): the
    plan reports those layouts refused by that rule and ranks only the others."""
    code = main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "H100-SXM", "--seq",
                 "4096", "--global-batch-tokens", "1048576", "--fp8", "tensorwise", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ranked"]
    rules = " ".join(result["refused"])
    assert "train.fp8: with parallel.cp = 2" in rules and "parallel.tp" not in rules
    assert all(row["degrees"].get("cp", 1) == 1 for row in result["ranked"])


def test_rowwise_with_gw_hp_runs_the_weight_gradient_in_high_precision_uncast():
    """torchao's ``rowwise_with_gw_hp`` keeps the weight gradient's GEMM in high precision from
    the saved inputs (its casts for it are disabled): W is the 16-bit GEMMs alone, F and I are
    tensorwise's. Rowwise casts and runs its GEMMs as tensorwise does in an eager stack (the
    same count of casts in torchao's backward, and its rowwise GEMM as fast as tensorwise's
    with a rescale), so it is priced alike there."""
    layout = Layout(dp_shard=8, zero_stage=3)
    plain = priced(False, layout)
    tensorwise, rowwise, gw_hp = (CostModel(MODEL, 8192, 64, make_cluster("H100-SXM", 8, 8),
                                            fp8=recipe)
                                  for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    f16, f8, hp = (m._times(layout, False)[:3] for m in (plain, tensorwise, gw_hp))
    assert hp[0] == f8[0] and hp[1] == f8[1]  # forward and input gradient: FP8, cast
    assert hp[2] == pytest.approx(f16[2], rel=1e-12)  # the weight gradient: 16-bit, no casts
    assert f8[2] < f16[2]
    assert rowwise._times(layout, False) == tensorwise._times(layout, False)
    assert priced(True, layout)._times(layout, False) == tensorwise._times(layout, False)
    with pytest.raises(ValueError, match="fp8 'blockwise': one of none, tensorwise"):
        CostModel(MODEL, 8192, 64, make_cluster("H100-SXM", 8, 8), fp8="blockwise")


def test_the_weight_gradient_casts_again_as_torchaos_backward_does():
    """Per pass of casts (each converted operand read for its amax, read again, written as one
    byte: 5 bytes per element in bf16): torchao's backward casts the output gradient and the
    saved input again for the weight gradient, two passes more in eager; compiled, tensorwise's
    output-gradient cast is the first one (the graph's CSE) and the input's is not, rowwise's
    run along the other axis (test_fp8_compiled_casts.py counts them in the graphs)."""
    layout = Layout(dp_shard=8, zero_stage=3)
    cluster = make_cluster("H100-SXM", 8, 8)

    def w(recipe, compiled):
        return CostModel(MODEL, 8192, 64, cluster, fp8=recipe,
                         framework=LOOM.compiled_as(compiled))._times(layout, False)[2]
    cast = converted_share(MODEL, 8192, 1, False)[1] * 5 \
        / cluster.gpu.hbm_bandwidth
    assert w("tensorwise", False) - w("tensorwise", True) == pytest.approx(cast, rel=1e-9)
    assert w("rowwise", True) - w("tensorwise", True) == pytest.approx(cast, rel=1e-9)
    assert w("rowwise", False) == w("tensorwise", False)
    plain = CostModel(MODEL, 8192, 64, cluster, framework=LOOM.compiled_as(False))
    assert w("rowwise_with_gw_hp", False) == pytest.approx(plain._times(layout, False)[2])


def test_loom_plan_prices_the_recipe_it_is_given(capsys):
    """``loom plan --fp8 rowwise_with_gw_hp`` prices a longer step than tensorwise at the same
    layout (its weight gradient in 16 bits), and a shorter one than no FP8."""
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "H100-SXM", "--seq", "4096",
            "--global-batch-tokens", "262144", "--layout", "dp_shard=8,zero_stage=3", "--json"]
    step = {}
    for recipe in ("none", "tensorwise", "rowwise_with_gw_hp"):
        assert main(base + ["--fp8", recipe]) == 0
        step[recipe] = json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]
    assert step["tensorwise"] < step["rowwise_with_gw_hp"] < step["none"]


def test_a_plan_built_without_a_cost_model_prices_the_workloads_recipe():
    """``plan(work, cluster)`` builds its cost model from the workload: its FP8 recipe too
    (it had priced every workload in 16 bits), so the same layout steps faster in FP8."""
    cluster = make_cluster("H100-SXM", 8, 8)
    steps = {}
    for recipe in ("none", "tensorwise"):
        work = Workload("llama3-8b", MODEL, 4096, 64, fp8=recipe)
        best = plan(work, cluster, top=1, simulation_seconds=float("inf")).ranked[0]
        model = CostModel(MODEL, 4096, 64, cluster, fp8=recipe)
        steps[recipe] = simulate_step(model, model.evaluate(best.layout)).step_time
        assert best.step_time == pytest.approx(steps[recipe], rel=1e-9)  # priced the same way
    assert steps["tensorwise"] < steps["none"]
