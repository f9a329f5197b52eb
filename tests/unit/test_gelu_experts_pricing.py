"""GELU experts (``model.mlp = "gelu"`` with ``model.n_experts > 0``) in every estimator.

The experts of an MoE layer, routed and shared, are of the dense MLP's kind: a SwiGLU expert
holds three D x F_e matrices (w1, w3, w2), a GELU expert two (w1, w2: w2(gelu_tanh(w1 x))),
c = ``TransformerArgs.mlp_matrices``. So, per MoE layer with E routed experts, S shared ones and
top_k = k, a GELU model holds (E + S)·D·F_e parameters fewer than the same SwiGLU model, passes
each token through (k + S)·D·F_e fewer multiply-adds, and saves two F-wide tensors per active
expert column fewer (2 for 4). Every expected value below is written out from those rules by
hand, never computed by the code under test. GELU experts in the model itself and their
parity under the parallelisms: tests/unit/test_gelu_formulas.py, tests/dist/test_gelu_mlp.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loom.config import load_config, resolve
from loom.formulas.flops import model_flops_per_token, training_flops_per_token
from loom.layout import Layout
from loom.models import Transformer
from loom.models.args import TransformerArgs
from loom.models.llama import TransformerBlock
from loom.models.presets import layer_parameter_count, parameter_count
from loom.models.rope import rope_tables
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_memory import _activation_bytes
from loom.sim.cost_model import CostModel
from loom.sim.eager_cost import eager_extra_bytes
from loom.sim.fp8_cost import converted_share
from loom.sim.launch_cost import block_kernels
from loom.train.memory import estimate_memory, memory_instants
from tests.unit.plan.test_launch_cost import _Kernels  # counts the kernels ops launch

D, F, FE, E, K, S = 64, 128, 96, 4, 2, 1  # dim, dense FFN, expert width, experts, top_k, shared
# three layers: layer 0 dense, layers 1 and 2 MoE; head size 16, 4 query and 2 KV heads
SWIGLU = TransformerArgs(dim=D, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=F, vocab_size=320,
                         max_seq_len=64, n_experts=E, top_k=K, expert_ffn_dim=FE,
                         n_shared_experts=S, n_dense_layers=1)
GELU = replace(SWIGLU, mlp="gelu")
KINDS = [(SWIGLU, 3), (GELU, 2)]  # (model, c: the D x F matrices of one MLP or expert)
MOE_LAYERS, DENSE_LAYERS = 2, 1
ATTENTION = 2 * D * 64 + 2 * D * 32 + 2 * D  # q and o, k and v, the two norms
ROUTER = D * E

UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)
LINK = Link("link", 100 * GB, 1e-6, efficiency=1.0)


def _cost_model(args: TransformerArgs, dtype_bytes: int = 2) -> CostModel:
    return CostModel(args, seq_len=32, global_batch=8, cluster=Cluster(UNIT, 1, 8, LINK, LINK),
                     dtype_bytes=dtype_bytes)


# ----- parameters ---------------------------------------------------------------------------

@pytest.mark.parametrize("args, c", KINDS)
def test_a_moe_layer_holds_c_matrices_per_expert_routed_and_shared(args, c):
    assert args.mlp_matrices == c
    assert layer_parameter_count(args, 0) == ATTENTION + c * D * F  # the dense layer
    assert layer_parameter_count(args, 1) == ATTENTION + ROUTER + (E + S) * c * D * FE
    assert layer_parameter_count(args, 1, active=True) == ATTENTION + ROUTER + (K + S) * c * D * FE


def test_gelu_holds_one_d_by_f_matrix_fewer_per_expert_and_dense_mlp():
    per_moe_layer = (E + S) * D * FE
    assert layer_parameter_count(SWIGLU, 1) - layer_parameter_count(GELU, 1) == per_moe_layer
    assert parameter_count(SWIGLU) - parameter_count(GELU) == \
        MOE_LAYERS * per_moe_layer + DENSE_LAYERS * D * F
    assert parameter_count(SWIGLU, active=True) - parameter_count(GELU, active=True) == \
        MOE_LAYERS * (K + S) * D * FE + DENSE_LAYERS * D * F


@pytest.mark.parametrize("args", [SWIGLU, GELU])
def test_parameter_count_is_the_real_models(args):
    assert parameter_count(args) == sum(p.numel() for p in Transformer(args).parameters())


@pytest.mark.parametrize("args, c", KINDS)
@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_the_planner_holds_the_experts_matrices_per_rank(args, c, tp, ep):
    ranks = _cost_model(args).ranks
    lay = Layout(tp=tp, ep=ep)
    attention = D * 16 * (2 * 4 + 2 * 2) / tp + 2 * D  # the norms replicated
    experts = c * D * FE * E / (ep * tp)
    shared = c * D * FE * S / tp
    assert ranks.layer_params(True, lay) == attention + experts + shared + ROUTER
    assert ranks.layer_params(False, lay) == attention + c * D * F / tp
    assert ranks.end_rank_expert_params(lay)[0] == MOE_LAYERS * experts
    if (tp, ep) == (1, 1):
        assert ranks.end_rank_params(lay)[0] == parameter_count(args)


# ----- FLOPs ---------------------------------------------------------------------------------

def _flops(c: int, top_k: int, shared: int) -> float:
    return training_flops_per_token(dim=D, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                                    ffn_dim=F, vocab_size=320, seq_len=32, moe_layers=MOE_LAYERS,
                                    n_experts=E, top_k=top_k, expert_ffn_dim=FE,
                                    n_shared_experts=shared, mlp_matrices=c)


def test_the_flops_moe_mlp_term_scales_two_to_three():
    """6 x the active expert parameters: 6·c·D·F_e·(k + S) per MoE layer (router apart)."""
    term = {c: _flops(c, K, S) - _flops(c, 0, 0) for c in (3, 2)}
    assert term == {c: 6 * MOE_LAYERS * c * D * FE * (K + S) for c in (3, 2)}
    assert term[2] * 3 == term[3] * 2
    assert model_flops_per_token(SWIGLU, 32) - model_flops_per_token(GELU, 32) == \
        6 * (MOE_LAYERS * (K + S) * D * FE + DENSE_LAYERS * D * F)


@pytest.mark.parametrize("args, c", KINDS)
@pytest.mark.parametrize("tp", [1, 2])
def test_cost_model_moe_layer_flops_by_hand(args, c, tp):
    """Projections 2T·h·d·(2a + 2k) and the active experts 2c·T·h·f_e·(k + S), split by tp; the
    router 2T·h·E replicated; FP8 converts the shared experts: their 2c·T·h·f_e·S, and casts
    the inputs of q, k, v, o (4h), w1 (and SwiGLU's w3: (c - 1)·h) and w2 (S·f_e)."""
    model, tokens = _cost_model(args), 64
    proj = 2 * tokens * D * 16 * (2 * 4 + 2 * 2)
    experts = 2 * c * tokens * D * FE * (K + S)
    core = 4 * tokens * 32 * 4 * 16 / 2
    assert model.layer_flops(tokens, tp, moe=True) == ((proj + experts) / tp
                                                       + 2 * tokens * D * E, core / tp)
    shared = 2 * c * tokens * D * FE * S
    assert converted_share(model.model, tokens, tp, moe=True) == (
        (proj + shared) / tp, tokens * (4 * D + (c - 1) * D + S * FE) / tp)


def test_gelu_experts_take_less_time_per_moe_layer():
    lay = Layout(micro_batch=2, microbatches=4)
    swiglu, gelu = _cost_model(SWIGLU)._layer_times(lay, True), _cost_model(GELU)._layer_times(
        lay, True)
    assert all(g < s for g, s in zip(gelu[:3], swiglu[:3]))  # F, I, W


# ----- kernels and eager traffic -------------------------------------------------------------

@pytest.mark.parametrize("e", [2, 4])
def test_gelu_experts_launch_fewer_kernels_by_the_counts(e):
    """Per expert, eager: SwiGLU 5 forward, 16 backward (3 weight matmuls), GELU 3, 9 (2); the
    shared experts 6, 11 (3) against 4, 6 (2); GELU's two stacked weights sum their experts'
    gradient slices with one add more in all (E - 1 each). Compiled: one matmul per matrix."""
    def kernels(args, compiled):
        f, i, w = block_kernels(args, True, compiled=compiled, e=e)
        return f, i + w, w

    swiglu, gelu = kernels(SWIGLU, False), kernels(GELU, False)
    assert tuple(a - b for a, b in zip(swiglu, gelu)) == (
        (5 - 3) * E + (6 - 4), (16 - 9) * E + (11 - 6) - 1, (3 - 2) * E + (3 - 2))
    swiglu, gelu = kernels(SWIGLU, True), kernels(GELU, True)
    assert tuple(a - b for a, b in zip(swiglu, gelu)) == (E + S, 2 * (E + S), E + S)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [{}, {"n_shared_experts": 0}, {"n_experts": 8, "top_k": 1}])
def test_gelu_expert_kernel_counts_are_the_dispatchers(dtype, shape):
    args = replace(GELU, **shape)
    torch.manual_seed(0)
    block = TransformerBlock(args, layer_id=1).to(dtype)
    x = torch.randn(2, 16, D, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(args.head_dim, 16, args.rope_theta)
    grad = torch.ones(2, 16, D, dtype=dtype)
    with _Kernels() as forward:
        y = block(x, cos, sin)
    with _Kernels() as backward:
        y.backward(grad)
    f, i, w = block_kernels(args, True, compiled=False, e=4 if dtype == torch.float32 else 2)
    assert (f, i + w) == (forward.count, backward.count)


@pytest.mark.parametrize("e", [2, 4])
def test_eager_gelu_experts_move_nothing_more_than_compiled_on_f(e):
    """SwiGLU's eager SiLU and gate product move 2e (forward) and 4e (backward) per F-wide
    element beyond compiled, over the k routed and the S shared experts' columns; GELU's one
    kernel each way moves what compiled moves."""
    tokens = 64
    swiglu = eager_extra_bytes(SWIGLU, tokens, 1, False, True, e)
    gelu = eager_extra_bytes(GELU, tokens, 1, False, True, e)
    columns = tokens * FE * (K + S)
    assert (swiglu[0] - gelu[0], swiglu[1] - gelu[1]) == (columns * 2 * e, columns * 4 * e)
    assert gelu == eager_extra_bytes(replace(GELU, n_experts=0), tokens, 1, False, False, e)


# ----- memory --------------------------------------------------------------------------------

@pytest.mark.parametrize("args, wide", [(SWIGLU, 4), (GELU, 2)])
def test_the_planners_moe_block_saves_its_kinds_f_wide_tensors(args, wide):
    """Loom's block, no tp, fp32, s = 32, b = 2: x·e·(8 + w·f/h) + 4sb(2 + a) with w F-wide
    tensors (SwiGLU 4, GELU 2); the MoE block's f the active experts' columns f_e·(k + S) plus
    the experts' input gathered once per assignment, k - 1 more D-wide rows either way."""
    x, e = 32 * 2 * D, 4
    dense, moe, _, _ = _activation_bytes(_cost_model(args, dtype_bytes=e),
                                         Layout(micro_batch=2, microbatches=4))
    assert dense == x * e * (8 + wide * F / D) + 4 * 32 * 2 * (2 + 4)
    assert moe == x * e * (8 + (wide * FE * (K + S) + (K - 1) * D) / D) + 4 * 32 * 2 * (2 + 4)


@pytest.mark.parametrize("ep", [1, 2])
def test_the_planners_memory_is_smaller_by_the_matrices_and_tensors(ep):
    """fp32 state (4 bytes a parameter, 4 a gradient, 8 of AdamW's state) of the parameters
    GELU drops, the routed experts' split over ep; and 2 F-wide tensors per MoE block column
    and dense MLP column of the one microbatch in flight."""
    lay = Layout(micro_batch=2, microbatches=4, ep=ep, dp_shard=ep)
    swiglu = _cost_model(SWIGLU, dtype_bytes=4).memory(lay)
    gelu = _cost_model(GELU, dtype_bytes=4).memory(lay)
    params = MOE_LAYERS * (E / ep + S) * D * FE + DENSE_LAYERS * D * F
    columns = MOE_LAYERS * FE * (K + S) + DENSE_LAYERS * F
    assert {k: swiglu[k] - gelu[k] for k in swiglu} == {
        "parameters": 4 * params, "gradients": 4 * params, "optimizer": 8 * params,
        "activations": 32 * 2 * 4 * 2 * columns, "transient": 0.0}


MOE_CONFIG = {"model.preset": "debug", "data.seq_len": "32", "train.micro_batch_size": "2",
              "train.global_batch_size": "8", "model.n_experts": str(E), "model.top_k": str(K),
              "model.expert_ffn_dim": str(FE), "model.n_shared_experts": str(S),
              "model.n_dense_layers": "1"}


@pytest.mark.parametrize("ep", [1, 2])
def test_the_estimators_state_is_smaller_by_the_gelu_experts_matrices(ep):
    """The debug preset (4 layers, D 64, F 128) with layers 1-3 MoE, fp32, at the optimizer
    step: parameters, gradients and AdamW's two moments of (E / ep + S)·D·F_e fewer per MoE
    layer (the routed experts split over ep) and D·F fewer in the dense one. The GELU config
    is the SwiGLU one with ``mlp`` replaced (no config rule in between)."""
    config = resolve(load_config(None, {**MOE_CONFIG, "parallel.ep": str(ep)}), ep)
    gelu = replace(config, model=replace(config.model, mlp="gelu"))
    assert (config.model.mlp_matrices, gelu.model.mlp_matrices) == (3, 2)
    swiglu_rest, gelu_rest = memory_instants(config)[-1], memory_instants(gelu)[-1]
    params = 3 * (E / ep + S) * D * FE + 1 * D * F
    assert swiglu_rest.parameters - gelu_rest.parameters == 4 * params
    assert swiglu_rest.gradients - gelu_rest.gradients == 4 * params
    assert swiglu_rest.optimizer - gelu_rest.optimizer == 8 * params
    assert estimate_memory(gelu).total < estimate_memory(config).total
