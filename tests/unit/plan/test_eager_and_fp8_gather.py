"""Eager against compiled blocks (``Framework.compiled``, ``loom.sim.eager_cost``) and FSDP2's
float8 all-gather (``CostModel(fp8_all_gather=True)``), each against a count written out by
hand from the docstrings, and the ``loom plan`` flags for both."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from loom.cli import main
from loom.layout import Layout
from loom.models.presets import PRESETS
from loom.plan.hardware import GB, Cluster, Gpu, Link, make_cluster
from loom.sim.collectives import gather_time
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS, LOOM

MODEL = PRESETS["llama3-8b"]
UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * GB, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)
FAST = Link("fast", bandwidth=1e11, latency=0.0, efficiency=1.0)
EAGER, COMPILED = LOOM.compiled_as(False), LOOM.compiled_as(True)


def _layer(stack, lay: Layout, e: int = 2) -> tuple[float, float, float]:
    f, i, w, _ = CostModel(MODEL, 1024, 8, Cluster(UNIT, 8, 8, FAST, FAST), dtype_bytes=e,
                           framework=stack)._layer_times(lay, False)
    return f, i, w


def test_profiles_say_whether_their_blocks_are_compiled():
    assert not FRAMEWORKS["loom"].compiled  # train.compile's default
    assert not FRAMEWORKS["torchtitan"].compiled  # its published BF16 rows ran eager
    assert FRAMEWORKS["megatron"].compiled and FRAMEWORKS["deepspeed"].compiled  # fused kernels


@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_an_eager_block_moves_its_element_wise_bytes_more_than_a_compiled_one(tp, sp):
    """bf16, per token: forward 74 bytes per D element, 44 per q and k element, 4 per MLP
    column; backward 182, 68 and 8 (the module docstring's count); D split by tp only under
    sequence parallelism; at 1 TB/s. The weight-gradient pass W has no element-wise work."""
    lay = Layout(tp=tp, sequence_parallel=sp, micro_batch=1, microbatches=1)
    eager, compiled = _layer(EAGER, lay), _layer(COMPILED, lay)
    d = 4096 / (tp if sp else 1)
    qk = 128 * (32 + 8) / tp
    ffn = 14336 / tp
    forward = 1024 * (74 * d + 44 * qk + 4 * ffn) / 1e12
    backward = 1024 * (182 * d + 68 * qk + 8 * ffn) / 1e12
    assert eager[0] - compiled[0] == pytest.approx(forward, rel=1e-9)
    assert eager[1] - compiled[1] == pytest.approx(backward, rel=1e-9)
    assert eager[2] == compiled[2]


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True)])
def test_an_eager_block_with_a_norm_kernel_moves_only_the_rest_of_its_eager_bytes(tp, sp):
    """An eager stack whose RMSNorms are one kernel each way (``fused_norm``: Scaling's "+ RMS
    kernel" cells): per D element, bf16, the kernel moves 2e forward and 3e backward per norm
    beside the residual adds' 6e and the accumulations' 15e, e and 3e beyond compiled, where
    the eager norms moved 74 and 182; q, k and the MLP's columns are unchanged."""
    lay = Layout(tp=tp, sequence_parallel=sp, micro_batch=1, microbatches=1)
    kernel = _layer(replace(EAGER, fused_norm=True), lay)
    eager, compiled = _layer(EAGER, lay), _layer(COMPILED, lay)
    d = 4096 / (tp if sp else 1)
    qk = 128 * (32 + 8) / tp
    ffn = 14336 / tp
    assert kernel[0] - compiled[0] == pytest.approx(
        1024 * (2 * d + 44 * qk + 4 * ffn) / 1e12, rel=1e-9)
    assert kernel[1] - compiled[1] == pytest.approx(
        1024 * (6 * d + 68 * qk + 8 * ffn) / 1e12, rel=1e-9)
    assert eager[0] - kernel[0] == pytest.approx(1024 * 72 * d / 1e12, rel=1e-9)
    assert kernel[2] == compiled[2]


def test_compiling_a_stack_fuses_its_norms_and_eager_restores_the_profiles_own():
    """``Framework.compiled_as``: inductor fuses each norm's ops, so a compiled Loom or
    torchtitan has fused norms; run eager again, each has its registered profile's norm."""
    for name in ("loom", "torchtitan", "scaling"):
        own = FRAMEWORKS[name]
        assert not own.fused_norm  # eager norm ops: Loom's Function, nn.RMSNorm, Scaling's own
        assert own.compiled_as(True).fused_norm and own.compiled_as(True).compiled
        assert own.compiled_as(True).compiled_as(False) == own
    assert FRAMEWORKS["megatron"].compiled_as(False).fused_norm  # Apex's / TE's norm kernel


def test_in_fp32_the_casts_are_free():
    """fp32 activations: the upcasts and downcasts are the tensors themselves, so the norms
    lose 2 x 2 casts forward and 3 x 2 backward, RoPE 2 each way: D 56 - 12 = 44, Q + KV
    36 - 8 = 28, F 8 forward; D 152 - 12 = 140, Q + KV 60 - 8 = 52, F 16 backward."""
    lay = Layout(micro_batch=1, microbatches=1)
    eager, compiled = _layer(EAGER, lay, e=4), _layer(COMPILED, lay, e=4)
    forward = 1024 * (44 * 4096 + 28 * 128 * 40 + 8 * 14336) / 1e12
    backward = 1024 * (140 * 4096 + 52 * 128 * 40 + 16 * 14336) / 1e12
    assert eager[0] - compiled[0] == pytest.approx(forward, rel=1e-9)
    assert eager[1] - compiled[1] == pytest.approx(backward, rel=1e-9)


def test_full_recomputation_repeats_the_eager_forward():
    none, full = Layout(micro_batch=1), Layout(micro_batch=1, recompute="full")
    extra_f = _layer(EAGER, none)[0] - _layer(COMPILED, none)[0]
    extra_i = _layer(EAGER, none)[1] - _layer(COMPILED, none)[1]
    assert _layer(EAGER, full)[1] - _layer(COMPILED, full)[1] == pytest.approx(extra_i + extra_f)


def test_the_float8_all_gather_moves_the_converted_weights_at_one_byte():
    """ZeRO-3 over 8 ranks of one node: the all-gather of every layer's parameters drops by
    exactly (2 - 1) x the FP8 linears' elements (attention projections and the SwiGLU MLP of
    every layer); the reduce-scatter of the gradients and everything else are unchanged."""
    cluster = make_cluster("H100-SXM", 8, 8)
    lay = Layout(dp_shard=8, zero_stage=3, micro_batch=1, microbatches=2)
    plain = CostModel(MODEL, 8192, 16, cluster, fp8=True)
    gathered = CostModel(MODEL, 8192, 16, cluster, fp8=True, fp8_all_gather=True)
    m = MODEL
    linears = m.n_layers * (m.dim * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
                            + 3 * m.dim * m.ffn_dim)
    assert gathered.ranks.fp8_gathered_params(lay) == {0: pytest.approx(linears)}
    link = cluster.link_for(8, 1)
    passes = 2 * lay.microbatches  # forward and backward of each microbatch, no pipeline
    psi = plain.ranks.end_rank_params(lay)[0]
    saved = passes * (gather_time(2 * psi, 8, link) - gather_time(2 * psi - linears, 8, link))
    assert plain.evaluate(lay).comm["dp"] - gathered.evaluate(lay).comm["dp"] == \
        pytest.approx(saved, rel=1e-9)
    # the bytes themselves: alpha-beta is linear in them, so the drop is (2 - 1) x linears
    one = gather_time(2 * psi, 8, link) - gather_time(2 * psi - 1, 8, link)
    assert saved == pytest.approx(passes * linears * one, rel=1e-6)
    # the gathered units' memory: two blocks in flight at 1 byte for the converted weights
    block_linears = linears / m.n_layers
    assert plain.memory(lay)["transient"] - gathered.memory(lay)["transient"] == \
        pytest.approx(2 * block_linears, rel=1e-9)


def test_the_float8_all_gather_changes_nothing_but_zero_3():
    cluster = make_cluster("H100-SXM", 8, 8)
    for lay in (Layout(dp_shard=8, zero_stage=1, micro_batch=1, microbatches=2),
                Layout(dp_replicate=8, micro_batch=1, microbatches=2)):
        plain = CostModel(MODEL, 8192, 16, cluster, fp8=True).evaluate(lay)
        gathered = CostModel(MODEL, 8192, 16, cluster, fp8=True,
                             fp8_all_gather=True).evaluate(lay)
        assert plain.step_time == gathered.step_time and plain.memory == gathered.memory
    for off in (False, "none", "rowwise"):  # no FP8, or a recipe with more than one scale
        with pytest.raises(ValueError, match="fp8_all_gather needs fp8 tensorwise"):
            CostModel(MODEL, 8192, 16, cluster, fp8=off, fp8_all_gather=True)


PLAN = ["plan", "--model", "llama3-8b", "--gpu", "H100-SXM", "--gpus", "8", "--seq", "8192",
        "--global-batch-tokens", str(8 * 8192), "--layout",
        "dp_shard=8,zero_stage=3,micro_batch=1,microbatches=1", "--json"]


def _step(capsys, *flags: str) -> float:
    assert main([*PLAN, *flags]) == 0
    return json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]


def test_plan_prices_compile_and_the_float8_gather(capsys):
    eager, compiled = _step(capsys), _step(capsys, "--compile", "true")
    assert compiled < eager == _step(capsys, "--compile", "false")
    fp8 = _step(capsys, "--fp8", "tensorwise")
    assert _step(capsys, "--fp8", "tensorwise", "--fp8-all-gather") < fp8


@pytest.mark.parametrize("flags, message", [
    (["--compile", "yes"], "--compile yes: true or false"),
    (["--fp8-all-gather"], "--fp8-all-gather: .* needs --fp8 tensorwise \\(not none\\)"),
    (["--fp8", "rowwise", "--fp8-all-gather"], "needs --fp8 tensorwise \\(not rowwise\\)"),
])
def test_plan_refuses_bad_compile_and_gather_flags_by_name(capsys, flags, message):
    assert main([*PLAN, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err


def test_plan_follows_the_model_configs_train_compile(capsys, tmp_path):
    config = tmp_path / "compiled.toml"
    config.write_text('[model]\npreset = "llama3-8b"\n\n[train]\ncompile = true\n')
    flags = [f if f != "llama3-8b" else str(config) for f in PLAN]
    assert main(flags) == 0
    from_config = json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]
    assert from_config == pytest.approx(_step(capsys, "--compile", "true"), rel=1e-12)
    assert main([*flags, "--compile", "false"]) == 0
    assert json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"] > from_config


def test_loom_prices_no_float8_gather_where_its_trainer_builds_none():
    """``train.fp8_all_gather`` with tp > 1 is refused by Loom's config rules, so a tp = 2
    ZeRO-3 layout is priced with its 2-byte gather; another stack's is not held to that."""
    cluster = make_cluster("H100-SXM", 8, 8)
    lay = Layout(tp=2, dp_shard=4, zero_stage=3, micro_batch=1, microbatches=2)
    plain = CostModel(MODEL, 8192, 8, cluster, fp8=True).evaluate(lay)
    assert CostModel(MODEL, 8192, 8, cluster, fp8=True, fp8_all_gather=True
                     ).evaluate(lay).step_time == plain.step_time
    titan = [CostModel(MODEL, 8192, 8, cluster, fp8=True, fp8_all_gather=gather,
                       framework=FRAMEWORKS["torchtitan"]).evaluate(lay) for gather in (0, 1)]
    assert titan[1].comm["dp"] < titan[0].comm["dp"]
