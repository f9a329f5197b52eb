"""GELU MLPs (``model.mlp = "gelu"``, GPT-style): the module, and every formula that counts it.

Each expected value is counted from the real module (parameters, saved-for-backward bytes) or
written out by hand from the formula the docstrings state; none is computed by the code under
test. The parity of a GELU model under tp / SP / pp (and of GELU experts under ep, tp, ZeRO and
pp) with one process: tests/dist/test_gelu_mlp.py.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from loom.cli import main
from loom.config import load_config, resolve
from loom.formulas.flops import model_flops_per_token, training_flops_per_token
from loom.formulas.memory import block_activation_bytes, korthikanti_block_activation_bytes
from loom.layout import Layout
from loom.models import Transformer, reset_parameters
from loom.models.args import TransformerArgs
from loom.models.hf_config import HFConversionError, hf_config_from_args
from loom.models.layers import FeedForward
from loom.models.moe import MoEFeedForward
from loom.models.presets import PRESETS, layer_parameter_count, parameter_count
from loom.pipeline.partition import stage_costs
from loom.plan.hardware import GB, Cluster, Gpu, Link
from loom.sim.cost_model import CostModel
from loom.sim.fp8_cost import converted_share
from loom.train.memory import layer_activation_bytes

GELU = TransformerArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=320,
                       max_seq_len=64, mlp="gelu")
UNIT = Gpu("unit", peak_flops=1e12, memory_bytes=80 * 2**30, hbm_bandwidth=1e12,
           matmul_efficiency=1.0, matmul_knee=1e-9)
LINK = Link("link", 100 * GB, 1e-6, efficiency=1.0)


def test_the_module_is_w2_of_tanh_gelu_of_w1_with_no_w3():
    torch.manual_seed(0)
    mlp = FeedForward(GELU)
    assert sorted(n for n, _ in mlp.named_parameters()) == ["w1.weight", "w2.weight"]
    x = torch.randn(2, 5, 64)
    h = x @ mlp.w1.weight.T
    by_hand = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    torch.testing.assert_close(mlp(x), by_hand @ mlp.w2.weight.T)
    assert not torch.allclose(mlp(x), F.gelu(h) @ mlp.w2.weight.T, rtol=0, atol=1e-7)


def test_parameter_count_is_the_real_modules():
    model = Transformer(GELU)
    assert parameter_count(GELU) == sum(p.numel() for p in model.parameters())
    attention = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64
    assert layer_parameter_count(GELU, 0) == attention + 2 * 64 * 256


def test_gpt_presets_are_gelu_over_4h_with_eq2_parameters():
    """Narayanan et al. 2021 eq. 2: P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h)); Loom has no
    biases and no learned positions (RoPE), so P - l·(13h) - s·h: its 4h-GELU layers hold 12h²
    each, plus two norms, and the tied vocabulary V·h, as the published shape."""
    for name, f in (("gpt3-175b", 4 * 12288), ("gpt-1t", 4 * 25600)):
        m = PRESETS[name]
        assert (m.mlp, m.ffn_dim) == ("gelu", f)
        h, l, v = m.dim, m.n_layers, m.vocab_size
        assert parameter_count(m) == l * (12 * h * h + 2 * h) + h + v * h


def test_flops_per_token_by_hand():
    """6N + 12·l·s·H·d with N = l·(attention + 2·h·f) + h·V: two MLP matrices, not three."""
    s = 32
    n = 3 * (2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 256) + 64 * 320
    assert model_flops_per_token(GELU, s) == 6 * n + 12 * 3 * s * 64


def test_gpt3_flops_equal_korthikanti_eq7():
    """72·l·h² + 12·l·s·h + 6·h·V per token (Korthikanti et al. 2022 eq. 7 over B·s tokens),
    exactly, with GPT-3's own 4h GELU MLP."""
    m, s = PRESETS["gpt3-175b"], 2048
    h, l, v = m.dim, m.n_layers, m.vocab_size
    assert model_flops_per_token(m, s) == 72 * l * h * h + 12 * l * s * h + 6 * h * v


def test_flops_refuse_an_unknown_matrix_count():
    with pytest.raises(ValueError, match="mlp_matrices=4"):
        training_flops_per_token(dim=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4,
                                 ffn_dim=8, vocab_size=8, seq_len=4, mlp_matrices=4)


def test_cost_model_layer_flops_and_fp8_share_by_hand():
    """Forward: projections 2T·h·d·(2a + 2k) and GELU 4T·h·f (SwiGLU's 6 less w3); FP8 casts
    each converted linear's input: q, k, v, o (4h), w1 (h) and w2 (f)."""
    model = CostModel(GELU, seq_len=32, global_batch=8, cluster=Cluster(UNIT, 1, 8, LINK, LINK))
    tokens = 64
    proj = 2 * tokens * 64 * 16 * (2 * 4 + 2 * 2)
    mlp = 4 * tokens * 64 * 256
    core = 4 * tokens * 32 * 4 * 16 / 2
    assert model.layer_flops(tokens, 1, moe=False) == (proj + mlp, core)
    assert model.layer_flops(tokens, 2, moe=False) == ((proj + mlp) / 2, core / 2)
    assert converted_share(GELU, tokens, 1, moe=False) == (proj + mlp, tokens * (4 * 64 + 64 + 256))
    assert model.ranks.end_rank_params(Layout())[0] == parameter_count(GELU)


def _saved_bytes(args: TransformerArgs) -> int:
    """Bytes saved for backward inside layer 1 during one forward (each storage once;
    parameters and buffers are not activations), as bench/activation_memory.py measures."""
    model = Transformer(args)
    reset_parameters(model, 0)
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    inside: list[bool] = []
    seen: set[int] = set()
    total: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside and ptr not in skip | seen:
            seen.add(ptr)
            total["bytes"] += t.untyped_storage().nbytes()
        return t

    def enter(*_: object) -> None:
        inside.append(True)

    def leave(*_: object) -> None:
        inside.pop()

    block = model.layers["1"]
    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, args.vocab_size, (2, 32)))
    return total["bytes"]


@pytest.mark.parametrize("mlp, ffn", [("gelu", 256), ("swiglu", 192)])
def test_block_activation_bytes_are_the_measured_saved_tensors(mlp, ffn):
    """The formula (GELU: 2 F-wide tensors, its input and output; SwiGLU: 4) against what
    autograd really saves for one block, s = 32, b = 2, fp32."""
    args = TransformerArgs(**{**GELU.__dict__, "mlp": mlp, "ffn_dim": ffn})
    expected = block_activation_bytes(s=32, b=2, h=64, f=ffn, a=4, kv=2, gated=mlp == "swiglu")
    assert _saved_bytes(args) == expected


def test_activation_formulas_by_hand():
    x = 32 * 2 * 64  # s·b·h
    # Loom, no tp: x·e·(8 + 2f/h) + 4sb(2 + a); tp 2: x·e·(4 + (4 + 2f/h)/t) + 4sb(2 + a/t)
    assert block_activation_bytes(s=32, b=2, h=64, f=256, a=4, kv=2, gated=False) == \
        x * 4 * (8 + 8) + 4 * 64 * 6
    assert block_activation_bytes(s=32, b=2, h=64, f=256, a=4, kv=4, t=2, gated=False) == \
        x * 4 * (4 + 12 / 2) + 4 * 64 * (2 + 2)
    # Korthikanti et al. 2022 §4.1: 34·s·b·h for a GPT block (f = 4h, e = 2, with dropout's
    # masks, no flash); its 5·a·s²·b attention core aside
    gpt = korthikanti_block_activation_bytes(s=32, b=2, h=64, f=256, a=4, kv=4, e=2,
                                             flash=False, dropout=True, gated=False)
    assert gpt == 34 * x + 5 * 4 * 32 * 32 * 2


def test_the_estimator_and_the_planner_price_the_gelu_block():
    config = resolve(load_config(None, {"model.preset": "debug", "model.mlp": "gelu",
                                        "model.ffn_dim": "256", "data.seq_len": "32",
                                        "train.micro_batch_size": "2",
                                        "train.global_batch_size": "8"}), 1)
    assert layer_activation_bytes(config) == 4096 * 4 * (8 + 8) + 4 * 64 * 6
    model = CostModel(config.model, seq_len=32, global_batch=8,
                      cluster=Cluster(UNIT, 1, 8, LINK, LINK), dtype_bytes=4)
    from loom.sim.cost_memory import _activation_bytes
    assert _activation_bytes(model, Layout(micro_batch=2, microbatches=4))[0] == \
        layer_activation_bytes(config)


def test_pipeline_partition_weighs_two_matrices():
    block = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 * 256 + 2 * 64 * 64
    assert stage_costs(GELU, 64)["head"] == pytest.approx(64 * 320 / block)


def test_gelu_experts_are_w2_gelu_w1_with_no_w3():
    """An MoE model with ``mlp = "gelu"`` has GELU experts (and GELU shared experts): each
    routed expert computes w2(gelu_tanh(w1 x)), as the dense GELU MLP does."""
    config = resolve(load_config(None, {"model.preset": "tiny-moe", "model.mlp": "gelu"}), 1)
    assert config.model.mlp == "gelu" and config.model.n_experts > 0
    args = TransformerArgs(**{**PRESETS["tiny-moe"].__dict__, "mlp": "gelu"})
    moe = MoEFeedForward(args)
    assert sorted(n for n, _ in moe.experts.named_parameters()) == ["w1", "w2"]
    torch.manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, args.dim)
    routing = moe.route_tokens(x)
    want = torch.zeros(10, args.dim)
    for token, expert, weight in zip(routing.token_A.tolist(), routing.expert_A.tolist(),
                                     routing.weight_A.tolist()):
        x_t = x.reshape(10, -1)[token]
        hidden = F.gelu(x_t @ moe.experts.w1[expert], approximate="tanh")
        want[token] += weight * (hidden @ moe.experts.w2[expert])
    if moe.shared is not None:
        want += moe.shared(x).reshape(10, -1)
        assert not hasattr(moe.shared, "w3")
    torch.testing.assert_close(moe.experts_output(x, routing).reshape(10, -1), want)


def test_an_unknown_mlp_is_refused_with_the_choices(capsys):
    assert main(["estimate-memory", "--model.mlp=relu"]) == 2
    line = capsys.readouterr().err.strip()
    assert "model.mlp" in line and "swiglu, gelu" in line and "\n" not in line


def test_a_model_built_outside_the_config_refuses_an_unknown_mlp():
    with pytest.raises(ValueError, match="model.mlp='relu'"):
        FeedForward(TransformerArgs(mlp="relu"))  # type: ignore[arg-type]


def test_hugging_face_export_refuses_gelu_by_name():
    with pytest.raises(HFConversionError, match="model.mlp='gelu'"):
        hf_config_from_args(GELU)
