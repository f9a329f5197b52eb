"""How the cost model prices a mixture-of-experts layer's routed experts (``CostModel``,
``Framework.grouped_experts`` / ``fp8_experts``, ``loom.sim.launch_cost.block_kernels``).

* Each routed expert's GEMM has only its share of the rows: with balanced routing a rank's
  E / ep experts split the tokens x top_k assignments every ep rank sends it, so an expert
  sees tokens x top_k x ep / E rows, and that (not the whole microbatch) sets its efficiency.
* A stack with grouped GEMMs (Megatron's ``--moe-grouped-gemm``, torchtitan's GroupedExperts)
  launches one kernel per expert matrix for all local experts; Loom's trainer loops over them.
* Megatron's FP8 runs the routed experts in FP8 too; Loom's converts only ``nn.Linear``.

Every expected time is written out from those rules on a unit accelerator (1 TFLOP/s, a knee
of 128 rows, no launch or framework overhead), never read back from the code under test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import FRAMEWORKS, LOOM
from loom.sim.launch_cost import block_kernels

D, FE, E, K, SEQ = 256, 128, 32, 2, 512  # dim, expert width, experts, top_k, tokens
HEADS, KV = 4, 2  # head size 64
MODEL = TransformerArgs(dim=D, n_layers=2, n_heads=HEADS, n_kv_heads=KV, ffn_dim=512,
                        vocab_size=64, max_seq_len=SEQ, n_experts=E, top_k=K,
                        expert_ffn_dim=FE)
KNEE = 128.0
UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * GB, hbm_bandwidth=1e30,
           matmul_efficiency=1.0, matmul_knee=KNEE, fp8_flops=2e12)
FAST = Link("fast", bandwidth=1e30, latency=0.0, efficiency=1.0)


def _rate(smallest: float) -> float:
    return 1e12 * smallest / (smallest + KNEE)


def _weight_pass(stack, ep: int = 1, fp8: bool = False) -> float:
    """W of one MoE layer for one 512-token microbatch: its GEMMs' time (W has no attention
    core, no element-wise work and no communication)."""
    cluster = Cluster(UNIT, ep, ep, FAST, FAST)
    cost = CostModel(MODEL, SEQ, ep, cluster, framework=stack, fp8=fp8)
    return cost._layer_times(Layout(dp_shard=1, ep=ep), True)[2]


PROJ = 2 * SEQ * D * 64 * (2 * HEADS + 2 * KV)  # q, k, v, o
ROUTER = 2 * SEQ * D * E
ROUTED = 2 * 3 * SEQ * K * D * FE  # SwiGLU experts, top_k assignments per token


@pytest.mark.parametrize("ep", [1, 4])
def test_each_routed_expert_gemm_runs_at_the_efficiency_of_its_share_of_the_rows(ep):
    rows_per_expert = SEQ * K * ep / E  # 32 rows at ep 1, 128 at ep 4
    expected = (PROJ + ROUTER) / _rate(min(SEQ, D)) + ROUTED / _rate(min(rows_per_expert, FE))
    assert _weight_pass(LOOM, ep) == pytest.approx(expected, rel=1e-12)
    # at ep 1 each expert sees 32 rows, fewer than its width: slower than the microbatch's
    whole_rows = (PROJ + ROUTER) / _rate(min(SEQ, D)) + ROUTED / _rate(min(SEQ, FE))
    assert (expected > whole_rows) == (rows_per_expert < FE)


def test_megatron_runs_the_routed_experts_in_fp8_and_loom_does_not():
    rows = SEQ * K / E
    gain = 1 - 1e12 / 2e12
    # the attention projections are converted under both; the router never
    loom_fp8 = (PROJ * (1 - gain) + ROUTER) / _rate(min(SEQ, D)) + ROUTED / _rate(min(rows, FE))
    megatron = replace(FRAMEWORKS["megatron"], compiled=True)
    megatron_fp8 = (PROJ * (1 - gain) + ROUTER) / _rate(min(SEQ, D)) \
        + ROUTED * (1 - gain) / _rate(min(rows, FE))
    assert _weight_pass(LOOM, fp8=True) == pytest.approx(loom_fp8, rel=1e-12)
    assert _weight_pass(megatron, fp8=True) == pytest.approx(megatron_fp8, rel=1e-12)


def test_a_grouped_gemm_stack_launches_the_experts_as_one():
    """Loom's loop launches each local expert's kernels; a grouped GEMM launches them once,
    whatever the number of experts or the ep degree."""
    looped = block_kernels(MODEL, True, compiled=False, e=2)
    one_expert = block_kernels(replace(MODEL, n_experts=1, top_k=1), True, compiled=False, e=2)
    for ep in (1, 4, 32):
        grouped = block_kernels(MODEL, True, compiled=False, e=2, ep=ep, grouped=True)
        # one expert's kernels, plus the combine's weighting that top_k > 1 adds in backward
        assert grouped == (one_expert[0], one_expert[1] + 1, one_expert[2])
    assert all(g < k for g, k in zip(block_kernels(MODEL, True, False, 2, grouped=True), looped))
    assert FRAMEWORKS["megatron"].grouped_experts and FRAMEWORKS["torchtitan"].grouped_experts
    assert not LOOM.grouped_experts and not FRAMEWORKS["deepspeed"].grouped_experts


def test_a_launch_bound_moe_pass_is_shorter_with_grouped_experts():
    slow_host = replace(UNIT, peak_flops=1e18, fp8_flops=0.0, launch_overhead=1e-5)
    cluster = Cluster(slow_host, 1, 1, FAST, FAST)
    passes = {}
    for grouped in (False, True):
        stack = replace(LOOM, grouped_experts=grouped)
        passes[grouped] = CostModel(MODEL, SEQ, 1, cluster, framework=stack)._layer_times(
            Layout(), True)[:3]
        kernels = block_kernels(MODEL, True, compiled=False, e=2, grouped=grouped)
        assert passes[grouped] == pytest.approx(tuple(k * 1e-5 for k in kernels))
    assert all(g < loop for g, loop in zip(passes[True], passes[False]))


@pytest.mark.parametrize("ep, copies", [(1, 1), (4, 3)])
def test_moving_the_tokens_into_expert_order_and_back_costs_hbm_traffic(ep, copies):
    """On an accelerator of unbounded FLOPs and links, an MoE layer's forward is longer than a
    dense one's by its token moves: each copy reads and writes top_k rows of h per token (one
    into expert order; with ep two more around the experts), the combine reads top_k and
    writes one; backward moves the gradients the same way, twice the traffic."""
    bandwidth = 1e11
    hbm_only = replace(UNIT, peak_flops=1e30, fp8_flops=0.0, hbm_bandwidth=bandwidth)
    cluster = Cluster(hbm_only, ep, ep, FAST, FAST)
    stack = LOOM.compiled_as(True)  # no per-op eager traffic, which differs by MLP
    cost = CostModel(MODEL, SEQ, ep, cluster, framework=stack)
    layout = Layout(dp_shard=1, ep=ep)
    moe, dense = cost._layer_times(layout, True), cost._layer_times(layout, False)
    moved = SEQ * D * 2 * (K * (2 * copies + 1) + 1) / bandwidth
    assert moe[0] - dense[0] == pytest.approx(moved, rel=1e-9)
    assert moe[1] - dense[1] == pytest.approx(2 * moved, rel=1e-9)
