"""Specifications for the model-family fields of ``TransformerArgs`` (no ``transformers`` needed).

``qkv_bias`` (Qwen2), ``qk_norm`` and ``head_dim_override`` (Qwen3), ``sliding_window`` (Mistral)
and ``rope_scaling`` (Llama 3.x's ``llama3``, or ``linear``): what each computes, that the
defaults leave today's Llama untouched, how the config reads and refuses them, and which
parallel layouts refuse them. Parity with ``transformers`` itself is ``test_hf_families.py``.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from loom.config import ConfigError, load_config, model_args, resolve
from loom.models import TransformerArgs, build_model, parameter_count, reset_parameters
from loom.models.layers import sdpa_causal
from loom.models.rope import RopeScaling, inverse_frequencies, rope_tables

torch.set_num_threads(1)

SMALL = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96,
                        max_seq_len=64)
FAMILY_FIELDS = {
    "qwen2": dict(qkv_bias=True),
    "qwen3": dict(qk_norm=True, head_dim_override=32),
    "mistral": dict(sliding_window=8),
    "llama3": dict(rope_scaling="llama3", rope_scaling_factor=8.0,
                   rope_scaling_original_max_len=16),
}


def seeded(args: TransformerArgs, seed: int = 0) -> torch.nn.Module:
    model = build_model(args, device="cpu")
    reset_parameters(model, seed)
    return model.eval()


def ids(args: TransformerArgs, length: int = 32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(args.vocab_size, (2, length), generator=generator)


# --------------------------------------------------------------------------------------------
# Defaults: today's Llama, bit for bit


def test_default_fields_build_todays_llama_block() -> None:
    names = {n.split(".", 2)[-1] for n, _ in seeded(SMALL).named_parameters()
             if n.startswith("layers.0.")}
    assert names == {"attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
                     "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
                     "feed_forward.w1.weight", "feed_forward.w3.weight", "feed_forward.w2.weight"}


def test_plain_rope_tables_are_the_llama_formula_bit_for_bit() -> None:
    cos, sin = rope_tables(16, 40, 10000.0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    angles = torch.outer(torch.arange(40, dtype=torch.float64), inv_freq)
    assert torch.equal(cos, angles.cos().float()) and torch.equal(sin, angles.sin().float())


def test_a_window_as_long_as_the_sequence_is_full_attention_bit_for_bit() -> None:
    full = seeded(SMALL)(ids(SMALL))
    windowed = seeded(dataclasses.replace(SMALL, sliding_window=32))(ids(SMALL))
    assert torch.equal(full, windowed)


# --------------------------------------------------------------------------------------------
# What each field computes


@pytest.mark.parametrize("family", FAMILY_FIELDS)
def test_parameter_count_equals_the_real_count(family: str) -> None:
    args = dataclasses.replace(SMALL, **FAMILY_FIELDS[family])
    assert parameter_count(args) == sum(p.numel() for p in build_model(args).parameters())


def test_qkv_bias_and_qk_norm_parameters_and_their_initial_values() -> None:
    args = dataclasses.replace(SMALL, qkv_bias=True, qk_norm=True, head_dim_override=24)
    params = dict(seeded(args).named_parameters())
    # Biases start at zero, norm weights at one; q/k norms act on one head (Hd = 24 here).
    assert params["layers.1.attention.wq.bias"].shape == (4 * 24,)
    assert params["layers.1.attention.wk.bias"].shape == (2 * 24,)
    assert not params["layers.1.attention.wv.bias"].any()
    assert torch.equal(params["layers.1.attention.q_norm.weight"], torch.ones(24))
    assert params["layers.1.attention.wo.weight"].shape == (64, 4 * 24)


def test_qk_norm_normalises_each_head_before_rope() -> None:
    """Scaling a head's query projection does not change a q-normed model's output (up to the
    norm's epsilon, made negligible here)."""
    args = dataclasses.replace(SMALL, qk_norm=True, norm_eps=1e-12)
    model, tokens = seeded(args), ids(SMALL)
    before = model(tokens)
    with torch.no_grad():
        model.layers["0"].attention.wq.weight[:16] *= 3.0  # head 0's rows
    torch.testing.assert_close(model(tokens), before, rtol=1e-5, atol=1e-5)
    plain = seeded(SMALL)
    reference = plain(tokens)
    with torch.no_grad():
        plain.layers["0"].attention.wq.weight[:16] *= 3.0
    assert not torch.allclose(plain(tokens), reference, atol=1e-3)  # without the norm it would


def test_sliding_window_mask_is_hf_mistrals() -> None:
    """Query i attends keys i-W+1 .. i: the core equals softmax over exactly those keys."""
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    out = sdpa_causal(q, k, v, window=3)
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(12):
        keys = slice(max(0, i - 2), i + 1)
        weights = (q[:, :, i:i + 1] @ k4[:, :, keys].transpose(-1, -2) / math.sqrt(8)).softmax(-1)
        torch.testing.assert_close(out[:, :, i:i + 1], weights @ v4[:, :, keys], rtol=1e-5,
                                   atol=1e-6)


def test_a_token_reaches_only_the_next_window_of_positions() -> None:
    """One layer, window 5: changing token 10 changes logits at positions 10..14 only."""
    args = dataclasses.replace(SMALL, n_layers=1, sliding_window=5)
    model, tokens = seeded(args), ids(SMALL)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % args.vocab_size
    moved = (model(changed) - model(tokens)).abs().amax(dim=(0, 2)) > 1e-6
    assert moved.nonzero().flatten().tolist() == [10, 11, 12, 13, 14]


def test_llama3_keeps_high_frequencies_divides_low_ones_and_blends_between() -> None:
    """Meta's Llama 3.1 schedule, L = 64, factor 8, low 1, high 4 (wavelength bands 16 and 64)."""
    scaling = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_len=64)
    plain = inverse_frequencies(32, 10000.0)
    scaled = inverse_frequencies(32, 10000.0, scaling)
    wavelength = 2 * math.pi / plain
    high, low = wavelength < 16, wavelength > 64
    middle = ~high & ~low
    assert high.any() and low.any() and middle.any()  # every band is exercised
    assert torch.equal(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8, rtol=1e-15, atol=0)
    blend = (64 / wavelength[middle] - 1.0) / (4.0 - 1.0)
    torch.testing.assert_close(scaled[middle],
                               (1 - blend) * plain[middle] / 8 + blend * plain[middle])
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()


def test_linear_scaling_divides_every_frequency() -> None:
    torch.testing.assert_close(inverse_frequencies(16, 500.0, RopeScaling("linear", factor=4.0)),
                               inverse_frequencies(16, 500.0) / 4, rtol=1e-15, atol=0)


def test_rope_scaling_changes_the_model() -> None:
    args = dataclasses.replace(SMALL, **FAMILY_FIELDS["llama3"])
    assert not torch.allclose(seeded(args)(ids(SMALL)), seeded(SMALL)(ids(SMALL)), atol=1e-4)


# --------------------------------------------------------------------------------------------
# Config: TOML / command line, and the rules


def test_fields_are_config_keys() -> None:
    config = resolve(load_config(None, {
        "model.qkv_bias": "true", "model.qk_norm": "true", "model.head_dim_override": "64",
        "model.sliding_window": "128", "model.rope_scaling": "llama3",
        "model.rope_scaling_factor": "8", "model.rope_scaling_original_max_len": "256"}), 1)
    args = model_args(config)
    assert (args.qkv_bias, args.qk_norm, args.head_dim, args.sliding_window) == (True, True, 64,
                                                                                 128)
    assert args.rope == RopeScaling("llama3", 8.0, 1.0, 4.0, 256)
    build_model(args)  # the shape is buildable


@pytest.mark.parametrize("overrides, world, field, words", [
    ({"model.sliding_window": "-1"}, 1, "model.sliding_window", "must be >= 0"),
    ({"model.head_dim_override": "33"}, 1, "model.head_dim_override", "must be even"),
    ({"model.rope_scaling": "yarn"}, 1, "model.rope_scaling", "must be one of none, linear"),
    ({"model.rope_scaling": "llama3"}, 1, "model.rope_scaling_original_max_len", "must be >= 1"),
    ({"model.rope_scaling": "llama3", "model.rope_scaling_original_max_len": "256",
      "model.rope_scaling_low_freq_factor": "4"}, 1, "model.rope_scaling_low_freq_factor",
     "< model.rope_scaling_high_freq_factor"),
    ({"model.rope_scaling": "linear", "model.rope_scaling_factor": "0"}, 1,
     "model.rope_scaling_factor", "must be > 0"),
])
def test_rules_refuse_naming_the_field(overrides, world: int, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(load_config(None, overrides), world)
    assert f"{field}=" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("mode, cp", [("ulysses", 2), ("ring", 2), ("hybrid", 4),
                                      ("allgather", 2)])
def test_a_window_is_allowed_in_every_context_parallel_mode(mode: str, cp: int) -> None:
    # every mode applies the window (tests/dist/test_context_window.py holds them to one process)
    overrides = {"model.sliding_window": "64", "parallel.cp": str(cp), "parallel.cp_mode": mode}
    assert resolve(load_config(None, overrides), cp).model.sliding_window == 64
