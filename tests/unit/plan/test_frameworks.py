"""Framework profiles (``loom.sim.frameworks``): what ``--framework`` changes in the cost model's
memory and overlap, against numbers written out by hand from the profiles' definitions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from loom.cli import main
from loom.formulas.memory import block_activation_bytes, korthikanti_block_activation_bytes
from loom.layout import Layout
from loom.models.presets import PRESETS, parameter_count
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_model import CostModel, allreduce_time, gather_time
from loom.sim.frameworks import FRAMEWORKS, LOOM, framework
from loom.sim.cost_memory import _activation_bytes
from loom.sim.dp_cost import flush_window
from loom.sim.streams import Pieces, chunked_overlap, layer_overlap

DEBUG = PRESETS["debug"]  # h 64, 4 layers, 4 heads, 2 KV heads, FFN 128, vocab 320
FAST = Link("fast", 100 * GB, 1e-6, efficiency=1.0)
SLOW = Link("slow", 10 * GB, 1e-5, efficiency=1.0)
UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)


def model(name: str, gpus: int = 2, per_node: int = 8, **kw) -> CostModel:
    return CostModel(DEBUG, 32, 8, Cluster(UNIT, gpus, per_node, FAST, SLOW),
                     framework=FRAMEWORKS[name], **kw)


def test_an_unknown_framework_is_refused_by_name():
    assert framework("loom") is LOOM
    with pytest.raises(ValueError, match="--framework nemo: one of loom, megatron"):
        framework("nemo")


def test_model_state_bytes_per_parameter_follow_the_profile():
    """ZeRO-1 over 2 ranks, Ψ parameters, 2-byte elements. torchtitan (FSDP2's fp32 shards):
    fp32 params 4Ψ, fp32 grads 4Ψ, moments 8Ψ/2. Megatron's distributed optimizer: bf16 params
    2Ψ, fp32 main grads 4Ψ, master + moments 12Ψ/2 (its "6 + 12/d"); DeepSpeed the same, and
    Loom's own bf16 (``train.dtype = bf16``: bf16 parameters, fp32 masters in the optimizer)."""
    lay = Layout(dp_shard=2, zero_stage=1, micro_batch=4, microbatches=1)
    psi = parameter_count(DEBUG)
    assert model("loom").ranks.end_rank_params(lay)[0] == psi
    memory = model("torchtitan").memory(lay)
    assert (memory["parameters"], memory["gradients"], memory["optimizer"]) == \
        (4 * psi, 4 * psi, 4 * psi)
    for name in ("megatron", "deepspeed", "loom"):
        memory = model(name).memory(lay)
        assert (memory["parameters"], memory["gradients"], memory["optimizer"]) == \
            (2 * psi, 4 * psi, 6 * psi), name


def test_korthikanti_block_by_hand():
    """GPT block (GELU f = 4h, dropout, no flash) at e = 2: 34·s·b·h + 5·a·s²·b; tp 2 without
    SP splits all but 10·s·b·h; Megatron's SP splits everything; selective drops the s² part."""
    kw = dict(s=8, b=1, h=64, f=256, a=4, kv=4, e=2, flash=False, dropout=True, gated=False)
    x = 8 * 64
    assert korthikanti_block_activation_bytes(t=1, **kw) == 34 * x + 5 * 4 * 64
    assert korthikanti_block_activation_bytes(t=2, **kw) == 10 * x + 24 * x / 2 + 5 * 4 * 64 / 2
    assert korthikanti_block_activation_bytes(t=2, sequence_parallel=True, **kw) == \
        (34 * x + 5 * 4 * 64) / 2
    assert korthikanti_block_activation_bytes(t=2, sequence_parallel=True, recompute="selective",
                                              **kw) == 34 * x / 2
    # Loom-like SP keeps the QKV and MLP inputs (2e·x) whole
    assert korthikanti_block_activation_bytes(t=2, sequence_parallel=True, sp_shards_all=False,
                                              **kw) == 4 * x + (30 * x + 5 * 4 * 64) / 2
    assert korthikanti_block_activation_bytes(t=2, sequence_parallel=True, recompute="full",
                                              **kw) == 2 * x / 2


def test_megatron_sequence_parallel_activations_follow_korthikanti():
    """One block at tp 2 with SP (s 32, b 4, h 64, f 2h, kv = a/2, e 2; x = s·b·h). Megatron
    shards all of it: (norms 4x, QKV and MLP inputs 4x, masks 2x, Q K V proj-in e·x·3, gated
    MLP 3e·2x)/2 + the flash kernel's lse 4·s·b·a/2. Loom's profile is Loom's own formula."""
    lay = Layout(tp=2, sequence_parallel=True, micro_batch=4, microbatches=1)
    x, sb = 32 * 4 * 64, 32 * 4
    mega = _activation_bytes(model("megatron"), lay)[0]
    assert mega == (4 + 4 + 2 + 6 + 12) * x / 2 + 4 * sb * 4 / 2
    assert _activation_bytes(model("loom"), lay)[0] == block_activation_bytes(
        s=32, b=4, h=64, f=128, a=4, kv=2, t=2, sequence_parallel=True, e=2)
    assert mega < _activation_bytes(model("loom"), lay)[0]


def test_torchtitan_full_recomputation_keeps_the_sequence_sharded_block_input():
    """Full recomputation keeps each block's input, the residual stream, which torchtitan's
    sequence parallelism (DTensor, Shard(1) between blocks) leaves split over tp: e·x/t per
    block at tp 2 with SP (x = s·b·h), e·x without SP, as Megatron's."""
    x = 32 * 4 * 64
    for sp, kept in ((True, 2 * x / 2), (False, 2 * x)):
        lay = Layout(tp=2, sequence_parallel=sp, micro_batch=4, microbatches=1,
                     recompute="full")
        assert _activation_bytes(model("torchtitan"), lay)[0] == kept
        assert _activation_bytes(model("megatron"), lay)[0] == kept


def test_other_stacks_hold_only_their_gradient_shard_between_microbatches():
    """FSDP2, DeepSpeed's ZeRO-3 and Megatron's FSDP reduce-scatter every microbatch's
    gradients into the rank's shard: with 4 microbatches a ZeRO-3 rank holds the same
    gradient bytes as with one (grad_bytes·Ψ/2 over 2 ranks), not every parameter's. Inside
    a pipeline, torch's pipelining defers FSDP's gradient sync to a stage's last microbatch,
    so a stage holds its gradients whole (grad_bytes·Ψ_stage) while microbatches accumulate."""
    psi = parameter_count(DEBUG)
    for name in ("torchtitan", "megatron", "deepspeed"):
        for microbatches in (1, 4):
            lay = Layout(dp_shard=2, zero_stage=3, micro_batch=1, microbatches=microbatches)
            assert model(name).memory(lay)["gradients"] == 4 * psi / 2, (name, microbatches)
        piped = model(name, gpus=4)
        lay = Layout(pp=2, dp_shard=2, zero_stage=3, schedule="1f1b", micro_batch=1,
                     microbatches=4)
        stages = piped.ranks.end_rank_params(lay).values()  # the worst rank's is reported
        assert piped.memory(lay)["gradients"] in {4 * p for p in stages}, name


def test_another_stacks_fsdp_shards_over_the_cp_ranks_alone():
    """torchtitan's FSDP mesh is dp_shard x cp: "FSDP 1, CP 4" shards the model state over the
    4 cp ranks (fp32 parameters 4Ψ/4) and all-gathers over them. Loom's trainer shards over
    dp_shard x cp only with dp_shard > 1 (its config rules), so its profile keeps the state
    whole there."""
    psi = parameter_count(DEBUG)
    lay = Layout(cp=4, dp_shard=1, zero_stage=3, micro_batch=1, microbatches=1)
    titan, loom = model("torchtitan", gpus=4), model("loom", gpus=4)
    assert titan.zero_stage_of(lay) == 3 and loom.zero_stage_of(lay) == 0
    assert titan.memory(lay)["parameters"] == 4 * psi / 4
    assert loom.memory(lay)["parameters"] == 2 * psi  # bf16 (2-byte) parameters, unsharded
    assert titan.evaluate(lay).comm["dp"] > 0


def test_megatron_overlaps_tp_communication_with_the_gemms():
    """With SP, Megatron pipelines the TP collectives with the GEMMs in tp chunks; where the
    GEMMs are longer than the collective only its first chunk shows, so the forward is shorter
    than Loom's by tp_fwd·(1 - 1/tp); without SP nothing changes."""
    lay = Layout(tp=2, sequence_parallel=True, micro_batch=4, microbatches=1)
    mega = model("megatron")  # fused kernels: against Loom compiled, which fuses alike
    loom = CostModel(DEBUG, 32, 8, Cluster(UNIT, 2, 8, FAST, SLOW),
                     framework=LOOM.compiled_as(True))
    f_loom, f_mega = loom._layer_times(lay, False)[0], mega._layer_times(lay, False)[0]
    tp_fwd = 2 * allreduce_time(4 * 32 * 64 * 2, 2, FAST)
    mat, _ = loom.layer_flops(4 * 32, 2, False)
    assert mat / 1e12 > tp_fwd  # compute-bound: the hand formula below holds
    assert f_loom - f_mega == pytest.approx(tp_fwd * (1 - 1 / 2))
    plain = Layout(tp=2, micro_batch=4, microbatches=1)
    assert loom._layer_times(plain, False)[0] == mega._layer_times(plain, False)[0]


def test_tp_comm_overlap_runs_the_gemms_in_chunks_of_1_over_tp_rows():
    """Pipelining the GEMMs with the TP collectives cuts each GEMM into tp chunks of 1/tp
    of its rows; on a GPU whose GEMMs lose efficiency below 128 rows (half at the knee) a
    32-token microbatch at tp 2 runs its chunks at 16 rows where the whole GEMM ran at
    32 (the layer's narrowest width, h/tp = 32): the overlapped forward is the chunks'
    pipeline, chunked_overlap(GEMMs at 16 rows, tp_fwd, 2), in place of GEMMs + tp_fwd."""
    knee = replace(UNIT, matmul_knee=128.0)
    lay = Layout(tp=2, sequence_parallel=True, micro_batch=1, microbatches=1)
    cluster = Cluster(knee, 2, 8, FAST, SLOW)
    mega = CostModel(DEBUG, 32, 8, cluster, framework=FRAMEWORKS["megatron"])
    loom = CostModel(DEBUG, 32, 8, cluster, framework=LOOM.compiled_as(True))
    mat, _ = loom.layer_flops(32, 2, False)
    whole, chunk = mat / knee.matmul_rate(32), mat / knee.matmul_rate(16)
    tp_fwd = 2 * allreduce_time(32 * 64 * 2, 2, FAST)
    f_loom, f_mega = loom._layer_times(lay, False)[0], mega._layer_times(lay, False)[0]
    assert f_loom - f_mega == pytest.approx(tp_fwd + whole - chunked_overlap(chunk, tp_fwd, 2))
    assert chunk > whole


def test_transformer_engine_runs_the_overlapped_gemms_on_the_sms_its_communication_leaves():
    """TE's userbuffers give the reduce-scatter behind the forward's row-parallel GEMMs
    (out-projection, fc2) and the bulk overlaps beside the backward's column-parallel ones
    (qkv, fc1: dgrad in I, wgrad in W) 16 SMs each, and run those GEMMs on the rest: on a
    100-SM unit GPU (1 TFLOP/s) each takes 100/84 times as long. The debug model at tp 2, 4 x 32
    tokens: out-projection 2·T·64·64/2 and fc2 2·T·128·64/2 FLOPs forward; qkv
    2·T·64·16·(4 + 2·2)/2 and fc1 (SwiGLU's w1 and w3) 2·T·64·128·2/2 in I and again in W.
    Nothing changes without SP (no TP-comm overlap), without a known SM count, or for Loom."""
    lay = Layout(tp=2, sequence_parallel=True, micro_batch=4, microbatches=1)

    def passes(gpu, stack, layout=lay):
        cost = CostModel(DEBUG, 32, 8, Cluster(gpu, 2, 8, FAST, SLOW), framework=stack)
        return cost._layer_times(layout, False)[:3]

    mega, sms = FRAMEWORKS["megatron"], replace(UNIT, sms=100)
    tokens, longer = 4 * 32, 100 / 84 - 1
    forward = (2 * tokens * 64 * 64 / 2 + 2 * tokens * 128 * 64 / 2) / 1e12 * longer
    backward = (2 * tokens * 64 * 16 * 8 / 2 + 2 * tokens * 64 * 128 * 2 / 2) / 1e12 * longer
    extra = [a - b for a, b in zip(passes(sms, mega), passes(UNIT, mega))]
    assert extra == pytest.approx([forward, backward, backward], rel=1e-9)
    assert mega.tp_overlap_sms == 16 and LOOM.tp_overlap_sms == 0
    plain = Layout(tp=2, micro_batch=4, microbatches=1)
    assert passes(sms, mega, plain) == passes(UNIT, mega, plain)
    loom = LOOM.compiled_as(True)
    assert passes(sms, loom) == passes(UNIT, loom)


def test_megatron_gathers_parameters_in_bf16_behind_the_forward():
    """ZeRO-1: Loom's trainer gathers the updated parameters in their own dtype after the step,
    exposed (``loom.parallel.zero``: bf16 under ``train.dtype = bf16``, the cost model's 2-byte
    default; fp32 in fp32); Megatron bf16, behind the next forward (one piece per layer on the
    link, the first exposed)."""
    lay = Layout(dp_shard=2, zero_stage=1, micro_batch=4, microbatches=1)
    psi = parameter_count(DEBUG)
    loom, mega = model("loom", per_node=1), model("megatron", per_node=1)  # over SLOW
    c_loom, c_mega = loom.evaluate(lay), mega.evaluate(lay)
    assert loom.zero12_gather_bytes == mega.zero12_gather_bytes == 2
    assert c_loom.comm["dp"] == pytest.approx(c_mega.comm["dp"])  # the same bytes
    assert c_mega.dp_exposed < c_loom.dp_exposed  # Megatron's hide behind the forward
    fp32 = model("loom", per_node=1, dtype_bytes=4)
    assert fp32.zero12_gather_bytes == 4
    assert fp32.evaluate(lay).comm["dp"] - c_loom.comm["dp"] == pytest.approx(
        gather_time(4 * psi, 2, SLOW) - gather_time(2 * psi, 2, SLOW))


def test_megatron_reduces_gradients_across_the_pipeline_flush():
    """Rank r of p with v chunks: its v·layers pieces are spread over ((v-1)p + 1)·b, b = its
    backward / v, and it idles r·b after its last backward (hand: p 4, v 2, backward 8 s,
    4 layers: b 4, window 20 s, 5 s per slice, slack 12 s on rank 3)."""
    lay = Layout(pp=4, schedule="interleaved_1f1b", chunks=2, microbatches=8)
    assert flush_window(lay, 3, 8.0, 4) == (5.0, 12.0)
    assert flush_window(lay, 0, 8.0, 4) == (5.0, 0.0)
    # a reduction of 30 s behind 4 slices of 5 s on rank 3: 30 + 5 - 20 - 12 = 3 s exposed
    assert layer_overlap(4, 5.0, [Pieces("slow", 7.5)], slack=12.0) == pytest.approx(3.0)


def test_loom_profile_is_the_default():
    lay = Layout(dp_shard=2, zero_stage=3, micro_batch=2, microbatches=2)
    plain = CostModel(DEBUG, 32, 8, Cluster(UNIT, 2, 8, FAST, SLOW))
    assert plain.framework is LOOM
    assert plain.evaluate(lay).step_time == model("loom").evaluate(lay).step_time


def test_loom_plan_refuses_an_unknown_framework_and_a_config_for_another_stack(tmp_path, capsys):
    base = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "256",
            "--global-batch-tokens", "4096"]
    assert main(base + ["--framework", "nemo"]) == 2
    assert "--framework nemo: one of loom, megatron" in capsys.readouterr().err
    out = tmp_path / "plan.toml"
    assert main(base + ["--framework", "megatron", "-o", str(out)]) == 2
    assert "only with --framework loom" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("recompute, regathers", [("none", True), ("selective", True),
                                                  ("full", False)])
def test_loom_sp_pays_the_backward_regather_of_its_sharded_saved_inputs(recompute, regathers):
    """Loom's SP saves the q/k/v and w1/w3 inputs as the rank's slice and all-gathers them again
    in backward (``loom.parallel.sequence_saved``): one all-gather of b·s·h per block part, each
    half an all-reduce's time, so one all-reduce's time per layer, not overlapped. TorchTitan's
    DTensor SP keeps them whole and pays nothing; a block recomputed in full keeps no saved input.
    (torchtitan's selective is taken as Loom's here, the attention core: its own op-level
    policy recomputes more, ``test_torchtitan_selective_is_its_op_level_policy``.)"""
    lay = Layout(tp=2, sequence_parallel=True, micro_batch=4, microbatches=2, recompute=recompute)
    loom = model("loom")
    titan = CostModel(DEBUG, 32, 8, loom.cluster,
                      framework=replace(FRAMEWORKS["torchtitan"], selective="core"))
    _, loom_i, _, loom_comm = loom._layer_times(lay, moe=False)
    _, titan_i, _, titan_comm = titan._layer_times(lay, moe=False)
    regather = allreduce_time(4 * 32 * DEBUG.dim * loom.e, 2, loom.cluster.link_for(2, 1))
    assert loom_comm["tp"] - titan_comm["tp"] == pytest.approx(regather if regathers else 0.0)
    assert loom_i - titan_i == pytest.approx(regather if regathers else 0.0)


def test_torchtitan_selective_is_its_op_level_policy():
    """torchtitan's selective checkpointing keeps the block input and the outputs of wq, wv,
    the attention (and its fp32 logsumexp), w1 and w2, and recomputes the rest: debug shape
    (s 32, b 4, h 64, f 128, a 4, kv 2, e 2; x = s·b·h) at tp 1 that is
    e·x·(1 + 1 + 1/2 + 1 + 1) + e·s·b·f + 4·s·b·a bytes. Its backward runs the even matmuls
    (wk, wo, w3: 2·T·h·(h·kv/a + h + f) FLOPs) and the forward's element-wise work again."""
    lay = Layout(micro_batch=4, microbatches=2, recompute="selective")
    x, sb = 32 * 4 * 64, 32 * 4
    titan = model("torchtitan")
    assert _activation_bytes(titan, lay)[0] == 2 * x * 4.5 + 2 * sb * 128 + 4 * sb * 4
    f_none, i_none, _, _ = titan._layer_times(replace(lay, recompute="none"), False)
    _, i_sel, _, _ = titan._layer_times(lay, False)
    again = 2 * 128 * 64 * (64 * 2 / 4 + 64 + 128) / 1e12  # UNIT: 1 TFLOP/s, no knee
    mat, core = titan.layer_flops(128, 1, False)
    elementwise = f_none - (mat + core) / 1e12  # the forward less its matmuls and attention
    assert i_sel - i_none == pytest.approx(again + elementwise)
    core = CostModel(DEBUG, 32, 8, titan.cluster,
                     framework=replace(FRAMEWORKS["torchtitan"], selective="core"))
    assert _activation_bytes(core, lay)[0] > _activation_bytes(titan, lay)[0]


def _layer(stack, lay: Layout) -> tuple[float, float, float]:
    """(F, I, W) seconds of one dense layer of the debug model, seq 32, one GPU."""
    f, i, w, _ = CostModel(DEBUG, 32, 8, Cluster(UNIT, 1, 8, FAST, SLOW),
                           framework=stack)._layer_times(lay, False)
    return f, i, w


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_attention_kernels_are_priced_by_what_they_compute_and_move(recompute):
    """The debug model at seq 32, one sequence, on the unit GPU (1 TFLOP/s at any shape, 1 TB/s):
    FlashAttention-2's causal core is 4·T·s·a·d/2 = 4·32·32·4·16/2 FLOPs; v1 takes twice as
    long; a kernel that stores the scores computes the whole square (twice v2's FLOPs) and moves
    the a·s² = 4·32·32 two-byte scores 4 times forward and 7 backward (fused), 8 and 11 unfused;
    a flash kernel's backward is 2.5 times its forward (it recomputes the scores), a stored-score
    kernel's twice (so v2's I holds 2.5 cores, v1's 5, fused 4 of the square's 2-core forward);
    W (the weight gradients) never changes. Selective recompute repeats the core's forward."""
    lay = Layout(recompute=recompute)
    core = 4 * 32 * 32 * 4 * 16 / 2 / 1e12
    scores = 4 * 32 * 32 * 2 / 1e12
    base = _layer(replace(LOOM, attention_kernel="flash2"), lay)
    again = 1 if recompute == "selective" else 0  # the core's forward once more in I
    for kernel, extra_f, extra_i in [
            ("flash1", core, 2.5 * core + again * core),
            ("fused", core + 4 * scores, 1.5 * core + 7 * scores + again * (core + 4 * scores)),
            ("unfused", core + 8 * scores,
             1.5 * core + 11 * scores + again * (core + 8 * scores))]:
        f, i, w = _layer(replace(LOOM, attention_kernel=kernel), lay)
        assert f - base[0] == pytest.approx(extra_f, rel=1e-9)
        assert i - base[1] == pytest.approx(extra_i, rel=1e-9)
        assert w == base[2]


def test_an_unfused_rmsnorm_moves_64_more_bytes_per_element_forward_and_128_backward():
    """Eager fp32 RMSNorms (``fused_norm = False``): T·h·64 bytes more forward at 1 TB/s, twice
    that in I; split over tp under sequence parallelism."""
    lay = Layout()
    compiled = LOOM.compiled_as(True)  # eager prices Loom's own eager norms instead
    base = _layer(compiled, lay)
    f, i, w = _layer(replace(compiled, fused_norm=False), lay)
    extra = 32 * 64 * 64 / 1e12
    assert (f - base[0], i - base[1], w - base[2]) == pytest.approx((extra, 2 * extra, 0.0))


def test_an_unknown_attention_kernel_is_refused_by_name():
    with pytest.raises(ValueError, match="attention_kernel 'xformers': one of flash2, flash1"):
        replace(LOOM, attention_kernel="xformers")


def test_loom_plan_prices_another_stacks_attention_kernel_and_refuses_one_for_loom(capsys):
    """``--attention-kernel`` replaces the profile's kernel: the unfused kernel's step is longer
    at the same layout; Loom's own trainer runs SDPA's flash kernel, so it is refused there."""
    base = ["plan", "--model", "tiny", "--gpus", "2", "--gpu", "A100-80GB", "--seq", "2048",
            "--global-batch-tokens", "16384", "--layout", "dp_replicate=2", "--json"]
    steps = {}
    for kernel in ("flash2", "unfused"):
        assert main(base + ["--framework", "megatron", "--attention-kernel", kernel]) == 0
        steps[kernel] = json.loads(capsys.readouterr().out)
    step = {kernel: out["ranked"][0]["step_time_s"] for kernel, out in steps.items()}
    assert step["unfused"] > step["flash2"]
    assert main(base + ["--attention-kernel", "fused"]) == 2
    assert "--attention-kernel fused: Loom's trainer runs flash2" in capsys.readouterr().err


def test_loom_plan_prices_another_stacks_norm_kernel_and_refuses_one_for_loom(capsys):
    """``--norm-kernel``: Scaling's eager block with flash-attn's norm kernel is shorter than
    with its eager norm ops at the same layout, and it survives ``--compile false`` (which
    restores a profile's own norm); Loom's trainer runs its own norm, so a kernel is refused
    there, and a value other than true or false is refused by name."""
    base = ["plan", "--model", "llama3-8b", "--gpus", "2", "--gpu", "A100-80GB", "--seq",
            "2048", "--global-batch-tokens", "16384", "--layout", "tp=2", "--json"]
    step = {}  # (a model large enough that its passes are not the host's launches)
    for kernel in ("true", "false"):
        assert main(base + ["--framework", "scaling", "--compile", "false",
                            "--norm-kernel", kernel]) == 0
        step[kernel] = json.loads(capsys.readouterr().out)["ranked"][0]["step_time_s"]
    assert step["true"] < step["false"]
    assert main(base + ["--norm-kernel", "true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loom plan: --norm-kernel true: Loom's trainer")
    assert main(base + ["--framework", "scaling", "--norm-kernel", "maybe"]) == 2
    assert "--norm-kernel maybe: true or false" in capsys.readouterr().err
