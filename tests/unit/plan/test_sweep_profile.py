"""Aleph Alpha's Scaling as a planner profile (``--framework scaling``, ``loom.sim.frameworks``):
the memory terms it adds (``loom.formulas.memory``) against values written out by hand, and what
selecting the profile changes in the cost model's memory, and what it leaves alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom.formulas.memory import (bucket_allreduce_bytes, gathered_logits_bytes,
                                  head_activation_bytes, korthikanti_block_activation_bytes,
                                  unfused_scores_bytes)
from loom.layout import Layout
from loom.models.presets import PRESETS, parameter_count
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.plan.cli import main
from loom.plan.search import plan
from loom.plan.space import Workload
from loom.sim.cost_memory import _activation_bytes
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS, framework
from tests.conftest import load_bench

DEBUG = PRESETS["debug"]  # h 64, 4 layers, 4 heads, 2 KV heads, FFN 128, vocab 320
FAST = Link("fast", 100 * GB, 1e-6, efficiency=1.0)
UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)
SMALL = dict(s=4, b=1, h=8, f=16, a=2, kv=2, e=2)  # x = s·b·h = 32 elements


def test_written_out_attention_saves_probabilities_and_the_fp32_softmax_per_head():
    """Per s x s element of each head, bf16: the probabilities (2); the fp32 softmax's output
    (4) with ``softmax_in_fp32``; dropout's mask and output (1 + 2). The boolean mask is the
    block's, once for all the heads."""
    assert unfused_scores_bytes(e=2) == 2
    assert unfused_scores_bytes(e=2, softmax_in_fp32=True) == 6
    assert unfused_scores_bytes(e=2, softmax_in_fp32=True, dropout=True) == 9
    assert unfused_scores_bytes(e=4) == 4


def test_gathered_logits_and_the_fp32_bucket_by_hand():
    # 10 tokens x 100 logits: the bf16 logits (2) and the loss's backward (8 per logit)
    assert gathered_logits_bytes(tokens=10, vocab=100, e=2) == 10 * 10 * 100
    # a bucket of at most 5e8 elements, flattened in bf16 and copied to fp32: 6 bytes each
    assert bucket_allreduce_bytes(1e9) == 6 * 5e8
    assert bucket_allreduce_bytes(1e6) == 6e6
    assert bucket_allreduce_bytes(1e6, grad_bytes=4) == 8e6


def test_korthikanti_block_defaults_unchanged_and_the_new_knobs_by_hand():
    """SwiGLU block, flash, no dropout, e = 2, t = 1: norms' inputs 2·2·32 = 128, QKV and MLP
    inputs 128, Q + K + V + projection input 2·32·4 = 256, the MLP's three 2·4·16 = 384, the
    fp32 log-sum-exp 4·4·2 = 32: 928 bytes."""
    assert korthikanti_block_activation_bytes(**SMALL) == 928
    # each eager norm (Llama's reference: ``_norm(x.float()).type_as(x) * weight``) saves the
    # fp32 copy of its input (4·32) and its bf16 output (2·32) in place of its bf16 input
    # (2·32): one more 4·32 per norm, replicated without SP
    assert korthikanti_block_activation_bytes(**SMALL, norm_outputs=True) == 928 + 256
    # in fp32 the copy is the input itself: only the output more (4·32 per norm)
    fp32 = dict(SMALL, e=4)
    assert korthikanti_block_activation_bytes(**fp32, norm_outputs=True) == \
        korthikanti_block_activation_bytes(**fp32) + 256
    # eager SwiGLU's silu(x) (2·4·16 = 128) and the flash output's reshaped copy (2·32 = 64)
    assert korthikanti_block_activation_bytes(**SMALL, eager_copies=True) == 928 + 192
    # tp 2 splits the copies; with SP the norms' outputs too
    base_t2 = korthikanti_block_activation_bytes(**SMALL, t=2)
    assert korthikanti_block_activation_bytes(**SMALL, t=2, eager_copies=True) == base_t2 + 96
    sp = dict(SMALL, t=2, sequence_parallel=True)
    assert korthikanti_block_activation_bytes(**sp, norm_outputs=True) == \
        korthikanti_block_activation_bytes(**sp) + 128
    # a written-out core: 6 bytes per s x s element of each head instead of e = 2 (a·s²·b = 32
    # elements), and the boolean [b, 1, s, s] mask once (s²·b = 16 bytes), whole on each tp rank
    no_flash = dict(SMALL, flash=False)
    assert korthikanti_block_activation_bytes(**no_flash, scores_bytes=6) == \
        korthikanti_block_activation_bytes(**no_flash) + 4 * 32 + 16
    for sp in (False, True):
        split = dict(no_flash, t=2, sequence_parallel=sp)
        assert korthikanti_block_activation_bytes(**split, scores_bytes=6) == \
            korthikanti_block_activation_bytes(**split) + 4 * 32 / 2 + 16
    # full recomputation keeps the block's input whatever the knobs
    assert korthikanti_block_activation_bytes(**no_flash, recompute="full", scores_bytes=6,
                                              norm_outputs=True, eager_copies=True) == 2 * 32


def test_the_profile_is_selected_by_name_and_the_others_keep_their_memory():
    stack = framework("scaling")
    assert (stack.param_bytes, stack.grad_bytes, stack.optimizer_bytes) == (2, 2, 12)
    assert stack.overlap.grad_reduce == "none" and not stack.compiled
    assert stack.softmax_in_fp32 and stack.norm_saves_output and stack.eager_copies
    assert stack.gathered_logits and stack.bucket_allreduce and stack.fp32_grad_slice
    for name in ("loom", "megatron", "torchtitan", "deepspeed"):
        other = FRAMEWORKS[name]
        assert not (other.softmax_in_fp32 or other.norm_saves_output or other.eager_copies
                    or other.gathered_logits or other.bucket_allreduce
                    or other.fp32_grad_slice), name
    with pytest.raises(ValueError, match="scaling"):
        framework("aa-scaling")


def _model(stack, gpus: int = 2) -> CostModel:
    return CostModel(DEBUG, 32, 8, Cluster(UNIT, gpus, 8, FAST, FAST), framework=stack)


def test_scaling_model_state_is_bf16_parameters_and_gradients():
    """ZeRO-1 over 2 ranks: bf16 parameters 2Ψ and gradients 2Ψ at the passes (Megatron's are
    fp32, 4Ψ), master + moments 12Ψ/2; the step keeps its own slice, 2Ψ/2, beside its fp32 copy
    4Ψ/2 and foreach AdamW's two temporaries 8Ψ/2."""
    lay = Layout(dp_shard=2, zero_stage=1, micro_batch=4, microbatches=1)
    psi = parameter_count(DEBUG)
    model = _model(framework("scaling"))
    memory = model.memory(lay)  # the passes' instant: every activation, the full gradients
    assert (memory["parameters"], memory["gradients"], memory["optimizer"]) == \
        (2 * psi, 2 * psi, 6 * psi)
    entries = [e for states in model._memory_cache.values() for rank in states.values()
               for e in rank]
    step = [e for e in entries if e["_acts"] == "none" and e["gradients"] == psi]
    assert len(step) == 1 and step[0]["transient"] == 8 * psi / 2 + 4 * psi / 2
    reduce = [e for e in entries if e["_acts"] == "none" and e["gradients"] == 2 * psi]
    assert len(reduce) == 1 and reduce[0]["transient"] == 6 * psi  # Ψ < one bucket


def test_gathered_logits_keep_the_whole_vocabulary_on_every_tensor_rank():
    """At tp 2 the head holds the whole vocabulary's fp32 log-probabilities plus the bf16
    logits and the loss's backward (10 bytes per logit), where Megatron's vocab-parallel head
    holds its half's log-probabilities (the head's term of the cost model's activations)."""
    lay = Layout(tp=2, micro_batch=4, microbatches=1)
    scaling, plain = framework("scaling"), replace(framework("scaling"), gathered_logits=False)
    tokens, vocab, h = 4 * 32, DEBUG.vocab_size, DEBUG.dim
    gap = _activation_bytes(_model(scaling), lay)[2] - _activation_bytes(_model(plain), lay)[2]
    whole = head_activation_bytes(s=32, b=4, h=h, vocab=vocab, e=2) + \
        gathered_logits_bytes(tokens=tokens, vocab=vocab, e=2)
    half = head_activation_bytes(s=32, b=4, h=h, vocab=vocab // 2, e=2)
    assert gap == pytest.approx(whole - half)


def test_a_reserve_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="allocator_reserve"):
        replace(framework("scaling"), allocator_reserve=1.0)
    assert framework("scaling").allocator_reserve == 0.15  # GMLake's average fragmentation
    assert all(FRAMEWORKS[name].allocator_reserve == 0.0
               for name in ("loom", "megatron", "torchtitan", "deepspeed"))


@pytest.mark.parametrize("stack,usable", [("scaling", 0.85), ("megatron", 1.0)])
def test_the_sweep_judges_a_cell_against_the_memory_left_by_the_allocator(stack, usable):
    """bench/planner_sweep.py: a 13B cell (64 GPUs, data parallel, microbatch 1, FlashAttention-2
    without the RMSNorm kernel; published: OOM) is judged out of memory when its bytes pass
    (1 - reserve) of 80 GiB; Scaling's profile puts it between 68 and 80 GiB, so only the
    reserve makes it OOM. Its spreadsheet is in the tune half, an 8k one in the holdout half."""
    sweep = load_bench("planner_sweep")
    cell = {"World Size": "64", "model_parallel_size": "1", "pipe_parallel_size": "1",
            "micro_batch_size": "1", "activation_checkpointing_type": "disabled",
            "kernel": "flash_attention2", "Average Step Time": "OOM Error"}
    row = sweep.price(cell, "13B", 2048, 2048, 1, stack)
    assert row["oom"] == (row["memory_gib"] > usable * 80) and row["published_oom"]
    scaling = sweep.price(cell, "13B", 2048, 2048, 1, "scaling")
    assert 0.85 * 80 < scaling["memory_gib"] < 80 and scaling["oom"]
    assert "llama_13B_bfloat16_64_GPUs_all_runs.xlsx" in sweep.TUNE
    assert "llama_13B_bfloat16_8k_seq_length_128_GPUs_all_runs.xlsx" not in sweep.TUNE


def test_the_block_follows_the_profile_and_megatron_keeps_its_own():
    """One debug block (s 32, b 2, h 64, f 128, 4 heads, 2 KV heads) with the written-out core:
    Scaling's eager block saves 6 bytes per score (fp32 softmax) and its mask, silu(x), the
    output copy and (its own norm, not a norm kernel) each norm's fp32 input and output;
    Megatron's profile keeps Korthikanti's block (its fused softmax's e bytes, its masks)."""
    lay = Layout(micro_batch=2, microbatches=1)
    shape = dict(s=32, b=2, h=64, f=128, a=4, kv=2, t=1, e=2, flash=False, gated=True)
    scaling = replace(framework("scaling"), attention_kernel="unfused")
    assert _activation_bytes(_model(scaling), lay)[0] == korthikanti_block_activation_bytes(
        **shape, scores_bytes=6, eager_copies=True, norm_outputs=True)
    norm_kernel = replace(scaling, fused_norm=True)
    assert _activation_bytes(_model(norm_kernel), lay)[0] == korthikanti_block_activation_bytes(
        **shape, scores_bytes=6, eager_copies=True)
    megatron = replace(framework("megatron"), attention_kernel="unfused", fused_norm=False)
    assert _activation_bytes(_model(megatron), lay)[0] == korthikanti_block_activation_bytes(
        **shape, dropout=True)


def test_the_planners_budget_leaves_out_the_allocators_reserve():
    """``plan`` keeps ``memory_fraction`` of the device for a stack without a reserve and
    ``1 - allocator_reserve`` where that is smaller (Scaling: 0.85 of 80 GiB)."""
    cluster = Cluster(UNIT, 8, 8, intra=FAST, inter=FAST)
    work = Workload("debug", DEBUG, 64, 8)
    budgets = {}
    for name in ("megatron", "scaling"):
        model = CostModel(DEBUG, 64, 8, cluster, framework=framework(name))
        budgets[name] = plan(work, cluster, top=1, cost_model=model,
                             runnable_only=False).memory_budget
    assert budgets["megatron"] == pytest.approx(0.9 * UNIT.memory_bytes)
    assert budgets["scaling"] == pytest.approx(0.85 * UNIT.memory_bytes)


def test_the_search_proposes_only_the_zero_stages_the_stack_has():
    """Scaling shards only its optimizer (ZeRO-1): its plan holds no ZeRO-2/3 layout, where
    Megatron's profile, on the same problem, ranks ZeRO-3 ones too."""
    cluster = Cluster(UNIT, 8, 8, intra=FAST, inter=FAST)
    work = Workload("debug", DEBUG, 64, 8)
    stages = {}
    for name in ("megatron", "scaling"):
        model = CostModel(DEBUG, 64, 8, cluster, framework=framework(name))
        ranked = plan(work, cluster, top=200, cost_model=model, runnable_only=False).ranked
        stages[name] = {cost.layout.zero_stage for cost in ranked}
    assert stages["scaling"] <= {0, 1} and 1 in stages["scaling"]
    assert 3 in stages["megatron"]


def test_an_explicit_layout_with_a_zero_stage_the_stack_lacks_is_refused(capsys):
    base = ["plan", "--model", "tiny", "--gpus", "2", "--seq", "256",
            "--global-batch-tokens", "4096", "--framework", "scaling", "--layout"]
    assert main(base + ["dp_shard=2,zero_stage=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zero_stage=3" in err[0] and "scaling" in err[0]
    assert main(base + ["dp_shard=2,zero_stage=1"]) == 0
