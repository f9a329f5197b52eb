"""Specifications for loom.models: the single-device Llama-style transformer and its presets.

The model must be pipeline-friendly (any contiguous slice, global parameter names), deterministic
to initialise whatever the layout, constructible on the meta device, and free of any
``torch.distributed`` import. Everything runs on the ``debug`` shape (64 wide, 4 layers).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import loom.models
from loom.models import (PRESETS, Transformer, TransformerArgs, build_model, parameter_count,
                         preset, reset_parameters)

torch.set_num_threads(1)

B, S = 2, 16


def args_for(**changes) -> TransformerArgs:
    return dataclasses.replace(preset("debug"), **changes)


def make(args: TransformerArgs | None = None, seed: int = 0, **kw) -> Transformer:
    """A model (or slice) built on the CPU and initialised with ``seed``."""
    model = build_model(args or args_for(), device="cpu", **kw)
    reset_parameters(model, seed)
    return model


def tokens(args: TransformerArgs, seed: int = 0) -> torch.Tensor:
    return torch.randint(args.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------
# Shapes and slices


def test_full_model_maps_token_ids_to_logits() -> None:
    args = args_for()
    logits = make(args)(tokens(args))
    assert logits.shape == (B, S, args.vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_slice_without_embedding_takes_hidden_states() -> None:
    args = args_for()
    stage = make(args, layer_ids=[2, 3], with_embedding=False)
    assert stage.tok_embeddings is None
    assert stage(torch.randn(B, S, args.dim)).shape == (B, S, args.vocab_size)


def test_slice_without_head_returns_hidden_states() -> None:
    args = args_for()
    stage = make(args, layer_ids=[0, 1], with_head=False)
    assert stage.norm is None and stage.output is None
    assert stage(tokens(args)).shape == (B, S, args.dim)


def test_slices_keep_global_layer_names() -> None:
    stage = build_model(args_for(), layer_ids=[2, 3], with_embedding=False, with_head=False)
    names = [name for name, _ in stage.named_parameters()]
    assert "layers.3.attention.wq.weight" in names
    assert {name.split(".")[1] for name in names} == {"2", "3"}
    assert not any(n.startswith(("tok_embeddings", "norm", "output")) for n in names)


def test_pipeline_of_slices_equals_the_full_model() -> None:
    args = args_for()
    x = tokens(args)
    full = make(args)(x)
    first = make(args, layer_ids=[0, 1], with_head=False)
    last = make(args, layer_ids=[2, 3], with_embedding=False)
    torch.testing.assert_close(last(first(x)), full, rtol=0, atol=0)


def test_layer_count_of_full_model() -> None:
    model = build_model(args_for(n_layers=3))
    assert list(model.layers.keys()) == ["0", "1", "2"]


# --------------------------------------------------------------------------------------------
# Attention: causality, RoPE positions, grouped-query attention


def test_causal_mask_changing_token_t_changes_only_positions_from_t_on() -> None:
    args = args_for()
    model = make(args)
    x = tokens(args)
    t = 9
    changed = x.clone()
    changed[:, t] = (x[:, t] + 1) % args.vocab_size
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert torch.equal(before[:, :t], after[:, :t])  # bit-identical: the past cannot see t
    for position in range(t, S):
        assert not torch.equal(before[:, position], after[:, position])


def test_explicit_positions_arange_equals_the_default() -> None:
    args = args_for()
    model = make(args)
    x = tokens(args)
    with torch.no_grad():
        assert torch.equal(model(x, positions=torch.arange(S)), model(x))


def test_positions_are_honoured() -> None:
    args = args_for()
    model = make(args)
    x = tokens(args)
    with torch.no_grad():
        default = model(x)
        spread = model(x, positions=torch.arange(S) * 7)
    # Position 0 is position 0 either way; later ones see keys at other distances.
    torch.testing.assert_close(spread[:, 0], default[:, 0], rtol=0, atol=0)
    assert (spread[:, 1:] - default[:, 1:]).abs().max() > 1e-3


def test_shifted_slice_with_global_positions_matches_relative_rope() -> None:
    # RoPE scores depend only on the distance between positions, so a slice that attends only to
    # itself gives the same output whether it is numbered from 0 or from its global offset (up to
    # rounding: the rotation angles differ).
    args = args_for()
    model = make(args)
    x = tokens(args)[:, 8:]
    with torch.no_grad():
        local = model(x)
        shifted = model(x, positions=torch.arange(8, 16))
        far = model(x, positions=torch.arange(200, 208))
    torch.testing.assert_close(shifted, local, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(far, local, rtol=1e-4, atol=1e-4)


def test_rope_positions_of_a_hidden_state_slice() -> None:
    # A middle stage (no embedding, no head) fed hidden states also honours positions.
    args = args_for()
    stage = make(args, layer_ids=[1], with_embedding=False, with_head=False)
    h = torch.randn(B, 8, args.dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(stage(h, positions=torch.arange(100, 108)), stage(h),
                                   rtol=1e-4, atol=1e-4)
        assert not torch.allclose(stage(h, positions=torch.arange(8) * 3), stage(h), atol=1e-4)


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_grouped_query_attention_shapes(n_kv_heads: int) -> None:
    args = args_for(n_heads=4, n_kv_heads=n_kv_heads)
    model = make(args)
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (4 * args.head_dim, args.dim)
    assert attention.wk.weight.shape == (n_kv_heads * args.head_dim, args.dim)
    assert attention.wv.weight.shape == (n_kv_heads * args.head_dim, args.dim)
    assert model(tokens(args)).shape == (B, S, args.vocab_size)


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads() -> None:
    # GQA with K key/value heads is multi-head attention whose k/v projections repeat each of
    # the K heads n_heads / K times (consecutive query heads share one key/value head).
    gqa_args = args_for(n_heads=4, n_kv_heads=2)
    mha_args = args_for(n_heads=4, n_kv_heads=4)
    gqa, mha = make(gqa_args), make(mha_args)
    state = gqa.state_dict()
    hd = gqa_args.head_dim
    for name, value in list(state.items()):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            state[name] = value.view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(state)
    x = tokens(gqa_args)
    with torch.no_grad():
        torch.testing.assert_close(mha(x), gqa(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Tied embeddings


def test_tied_embeddings_share_one_tensor() -> None:
    args = args_for(tie_embeddings=True)
    model = make(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert [n for n, _ in model.named_parameters()].count("output.weight") == 0
    with torch.no_grad():
        model.tok_embeddings.weight[0, 0] = 5.0
    assert model.output.weight[0, 0] == 5.0


def test_untied_embeddings_are_separate() -> None:
    model = make(args_for())
    assert model.output.weight is not model.tok_embeddings.weight
    assert not torch.equal(model.output.weight, model.tok_embeddings.weight)


def test_tied_embeddings_survive_meta_construction() -> None:
    model = build_model(args_for(tie_embeddings=True))
    model.to_empty(device="cpu")
    reset_parameters(model, seed=0)
    assert model.output.weight is model.tok_embeddings.weight


# --------------------------------------------------------------------------------------------
# Deterministic, layout-independent initialisation


def test_same_seed_gives_bit_identical_weights() -> None:
    a, b = weights(make(seed=7)), weights(make(seed=7))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_different_seed_gives_different_weights() -> None:
    a, b = weights(make(seed=7)), weights(make(seed=8))
    for name in a:
        if name.endswith("norm.weight"):
            assert torch.equal(a[name], torch.ones_like(a[name]))  # norms start at one
            assert torch.equal(a[name], b[name])
        else:
            assert not torch.equal(a[name], b[name]), name


def test_parameters_are_initialised_independently_of_each_other() -> None:
    w = weights(make(seed=7))
    assert not torch.equal(w["layers.0.attention.wq.weight"], w["layers.1.attention.wq.weight"])
    assert not torch.equal(w["layers.0.feed_forward.w1.weight"],
                           w["layers.0.feed_forward.w3.weight"])


@pytest.mark.parametrize("layer_ids, with_embedding, with_head", [
    ([2, 3], False, True),   # last pipeline stage
    ([1, 2], False, False),  # middle stage
    ([0], True, False),      # first stage
])
def test_pipeline_slice_gets_the_full_models_weights(layer_ids, with_embedding, with_head) -> None:
    full = weights(make(seed=3))
    part = weights(make(seed=3, layer_ids=layer_ids, with_embedding=with_embedding,
                        with_head=with_head))
    assert part  # not empty
    for name, value in part.items():
        assert torch.equal(value, full[name]), name


def test_initial_value_statistics() -> None:
    args = args_for()
    w = weights(make(args, seed=0))
    assert abs(w["tok_embeddings.weight"].std().item() - 0.02) < 0.002
    residual_std = 0.02 / (2 * args.n_layers) ** 0.5  # wo and w2 write into the residual stream
    assert abs(w["layers.0.attention.wo.weight"].std().item() - residual_std) < 0.1 * residual_std
    assert abs(w["layers.0.feed_forward.w2.weight"].std().item() - residual_std) < (
        0.1 * residual_std)


# --------------------------------------------------------------------------------------------
# Meta-device construction


def test_meta_construction_allocates_nothing() -> None:
    model = build_model(PRESETS["llama3-8b"])  # 8e9 parameters: only possible on meta
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert sum(p.numel() for p in model.parameters()) == parameter_count(PRESETS["llama3-8b"])


def test_meta_then_to_empty_and_reset_equals_a_cpu_build() -> None:
    args = args_for()
    model = build_model(args)
    model.to_empty(device="cpu")
    reset_parameters(model, seed=5)
    reference = make(args, seed=5)
    assert not any(p.is_meta for p in model.parameters())
    for name, value in weights(reference).items():
        assert torch.equal(dict(model.named_parameters())[name], value), name
    assert torch.equal(model.rope_cos, reference.rope_cos)  # derived buffers rebuilt
    x = tokens(args)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_rope_tables_are_not_in_the_state_dict() -> None:
    assert not any("rope" in k for k in build_model(args_for()).state_dict())


# --------------------------------------------------------------------------------------------
# Parameter counts


@pytest.mark.parametrize("args", [
    PRESETS["tiny"], PRESETS["debug"], args_for(tie_embeddings=True),
    args_for(n_heads=8, n_kv_heads=1), args_for(n_layers=1, ffn_dim=96),
], ids=["tiny", "debug", "debug-tied", "debug-mqa", "one-layer"])
def test_parameter_count_equals_the_real_count(args: TransformerArgs) -> None:
    model = build_model(args)  # the meta device knows the shapes; nothing is allocated
    assert parameter_count(args) == sum(p.numel() for p in model.parameters())
    embedding = args.vocab_size * args.dim
    assert parameter_count(args, include_embedding=False) == parameter_count(args) - embedding


@pytest.mark.parametrize("name, published", [
    ("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9), ("llama3-405b", 405.9e9),
    ("gpt3-175b", 174.6e9),
])
def test_large_presets_match_published_sizes(name: str, published: float) -> None:
    count = parameter_count(PRESETS[name])
    assert abs(count - published) / published < 0.01, f"{name}: {count:.4g}"


def test_preset_returns_a_fresh_copy() -> None:
    args = preset("tiny")
    args.dim = 1
    assert PRESETS["tiny"].dim == 256
    with pytest.raises(KeyError, match="unknown model preset 'tiny2'; known: tiny, debug"):
        preset("tiny2")


def test_every_preset_has_a_valid_shape() -> None:
    for name, args in PRESETS.items():
        assert args.dim % args.n_heads == 0, name
        assert args.head_dim % 2 == 0, name
        assert args.n_heads % args.n_kv_heads == 0, name


# --------------------------------------------------------------------------------------------
# No torch.distributed in the model


def test_model_sources_do_not_import_torch_distributed() -> None:
    # Read the code, not the prose: docstrings may say that torch.distributed is not used.
    package = Path(loom.models.__file__).parent
    sources = sorted(package.glob("*.py"))
    assert sources
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Attribute):
                names = [ast.unparse(node)]
            else:
                continue
            assert not any(n.startswith("torch.distributed") for n in names), (source, names)
