"""Specifications for the Hugging Face model families: Llama 3.x (``llama3`` RoPE scaling),
Qwen2 / Qwen2.5 (q/k/v biases, tied embeddings), Qwen3 (per-head q/k RMSNorm, explicit
``head_dim``) and Mistral (sliding-window attention).

Done when, for a tiny random model of each family (and a ``linear``-scaled Llama) built with
``transformers``' own config class (fp32, GQA, every weight moved off its initial value), Loom's
logits equal transformers' within 1e-5 after ``loom hf import``, and again after ``loom hf export`` and ``from_pretrained``; when
each family's feature visibly matters (so the parity could fail); when Loom's greedy decoding,
on the model ``loom generate`` loads, picks transformers' greedy tokens; and when what Loom
cannot compute exactly is refused naming the config key. The sequence (48) is longer than the
llama3 model's original context (32) and than the sliding windows (8).

The config round trip and the refusals run without ``transformers``; the rest needs it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.data.tokenizer import ByteTokenizer
from loom.generate import generate_tokens, load_trained_model
from loom.hf_cli import export_hf, import_hf, read_run, write_run
from loom.models import TransformerArgs, build_model, reset_parameters
from loom.models.hf import (HFConversionError, architecture_of, args_from_hf_config,
                            hf_config_from_args)

torch.set_num_threads(1)

B, S = 2, 48
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, the bound
HF_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=320, max_position_embeddings=128,
                rms_norm_eps=1e-6)
LOOM_SHAPE = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                             vocab_size=320, max_seq_len=128, norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@dataclasses.dataclass(frozen=True)
class Family:
    architecture: str
    hf_config: dict[str, Any]  # keyword arguments of transformers' config class
    loom: dict[str, Any]  # the TransformerArgs fields (beyond LOOM_SHAPE) it imports as

    @property
    def args(self) -> TransformerArgs:
        return dataclasses.replace(LOOM_SHAPE, **self.loom)


FAMILIES = {
    "llama3": Family("LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE},
                     dict(rope_scaling="llama3", rope_scaling_factor=8.0,
                          rope_scaling_original_max_len=32)),
    "llama-linear": Family("LlamaForCausalLM",
                           {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                "factor": 2.0}},
                           dict(rope_scaling="linear", rope_scaling_factor=2.0)),
    "qwen2": Family("Qwen2ForCausalLM", {}, dict(qkv_bias=True)),
    "qwen2.5-tied": Family("Qwen2ForCausalLM",
                           {"tie_word_embeddings": True,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                           dict(qkv_bias=True, tie_embeddings=True, rope_theta=1e6)),
    "qwen3": Family("Qwen3ForCausalLM", {"head_dim": 32},
                    dict(qk_norm=True, head_dim_override=32)),
    "qwen3-sliding": Family("Qwen3ForCausalLM", {"head_dim": 16, "use_sliding_window": True,
                                                 "sliding_window": 8, "max_window_layers": 0},
                            dict(qk_norm=True, sliding_window=8)),
    "mistral": Family("MistralForCausalLM", {"sliding_window": 8}, dict(sliding_window=8)),
}


def random_ids(vocab: int, length: int = S, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab, (B, length), generator=torch.Generator().manual_seed(seed))


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every weight off its initial value (norms start at one, biases at zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def loom_model(args: TransformerArgs, state: dict[str, torch.Tensor] | None = None,
               seed: int = 0) -> torch.nn.Module:
    model = build_model(args, device="cpu")
    reset_parameters(model, seed)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert set(missing) <= ({"output.weight"} if args.tie_embeddings else set()), missing
        assert not unexpected
    return model.eval()


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def hf_model(transformers, family: Family, seed: int = 1):
    config_class = getattr(transformers, family.architecture.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, family.architecture)(config_class(**HF_SHAPE,
                                                                    **family.hf_config))
    model = model.float().eval()
    perturb(model, seed)
    return model


def imported(transformers, tmp_path: Path, name: str):
    """(HF model, Loom model) of family ``name``: HF built, saved, ``loom hf import``ed."""
    family = FAMILIES[name]
    model = hf_model(transformers, family)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert import_hf(tmp_path / "hf", tmp_path / "run") == family.args
    return model, loom_model(*read_run(tmp_path / "run"))


# --------------------------------------------------------------------------------------------
# Logit parity, both ways


@pytest.mark.parametrize("name", FAMILIES)
def test_hf_to_loom_logits_match(transformers, tmp_path: Path, name: str) -> None:
    hf, loom = imported(transformers, tmp_path, name)
    tokens = random_ids(320)
    with torch.no_grad():
        torch.testing.assert_close(loom(tokens), hf(tokens).logits, **TOL)


@pytest.mark.parametrize("name", FAMILIES)
def test_loom_to_hf_logits_match(transformers, tmp_path: Path, name: str) -> None:
    family = FAMILIES[name]
    model = loom_model(family.args, seed=7)
    perturb(model, 2)
    state = {k: v for k, v in model.state_dict().items()
             if not (family.args.tie_embeddings and k == "output.weight")}
    write_run(tmp_path / "run", family.args, state)
    export_hf(tmp_path / "run", tmp_path / "hf")
    assert json.loads((tmp_path / "hf/config.json").read_text())["architectures"] == [
        family.architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == family.architecture and hf.dtype == torch.float32
    tokens = random_ids(320, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), **TOL)


# --------------------------------------------------------------------------------------------
# Each feature matters, so the parity above can fail


def test_without_llama3_scaling_the_logits_differ(transformers, tmp_path: Path) -> None:
    """The same weights with plain RoPE miss transformers' logits (checked past the original
    context of 32 positions; the scaled low frequencies move every position but the first)."""
    hf, loom = imported(transformers, tmp_path, "llama3")
    unscaled = loom_model(dataclasses.replace(loom.args, rope_scaling="none"), loom.state_dict())
    tokens = random_ids(320)
    with torch.no_grad():
        assert (unscaled(tokens) - hf(tokens).logits)[:, 32:].abs().max() > 1e-3


def test_mistral_window_matters_past_w_tokens(transformers, tmp_path: Path) -> None:
    hf, loom = imported(transformers, tmp_path, "mistral")
    full = loom_model(dataclasses.replace(loom.args, sliding_window=0), loom.state_dict())
    tokens = random_ids(320)
    with torch.no_grad():
        gap = (full(tokens) - hf(tokens).logits).abs().amax(dim=(0, 2))
    assert gap[:8].max() < 1e-5 < 1e-3 < gap[8:].min()  # identical until the window is full


@pytest.mark.parametrize("name, tensors", [
    ("qwen2", ("attention.wq.bias", "attention.wk.bias")),
    ("qwen3", ("attention.q_norm.weight", "attention.k_norm.weight")),
])
def test_biases_and_qk_norm_weights_follow_the_rope_permutation(transformers, tmp_path: Path,
                                                                name: str, tensors) -> None:
    """HF's vectors copied without the per-head rotate-half -> interleaved permutation give other
    logits: biases are rows of the permuted q/k outputs, and the q/k norm weight scales them
    elementwise before RoPE."""
    hf, loom = imported(transformers, tmp_path, name)
    hf_state = hf.state_dict()
    hf_names = {"attention.wq.bias": "self_attn.q_proj.bias",
                "attention.wk.bias": "self_attn.k_proj.bias",
                "attention.q_norm.weight": "self_attn.q_norm.weight",
                "attention.k_norm.weight": "self_attn.k_norm.weight"}
    tokens = random_ids(320)
    with torch.no_grad():
        torch.testing.assert_close(loom(tokens), hf(tokens).logits, **TOL)
        for i in range(2):
            for tensor in tensors:
                loom.get_parameter(f"layers.{i}.{tensor}").copy_(
                    hf_state[f"model.layers.{i}.{hf_names[tensor]}"])
        assert (loom(tokens) - hf(tokens).logits).abs().max() > 1e-4


# --------------------------------------------------------------------------------------------
# Generation: `loom generate`'s model and greedy loop pick transformers' greedy tokens


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "mistral"])
def test_greedy_generation_matches_transformers(transformers, tmp_path: Path, name: str) -> None:
    hf, _ = imported(transformers, tmp_path, name)
    ByteTokenizer().save(tmp_path / "run" / "data")  # import converts no tokenizer
    model, _, _ = load_trained_model(tmp_path / "run", torch.device("cpu"))
    prompt = random_ids(320, length=6, seed=3)[:1]
    new = 14  # 20 tokens in all: past the sliding windows (8)
    hf.generation_config.eos_token_id = None  # run all steps, as Loom without an eos_id
    hf.generation_config.pad_token_id = 0
    expected = hf.generate(prompt, do_sample=False, max_new_tokens=new)
    got = generate_tokens(model, prompt, max_new_tokens=new, temperature=0)
    assert got == expected[0, prompt.shape[1]:].tolist()
    assert len(set(got)) > 3  # a real continuation, not one token repeated


# --------------------------------------------------------------------------------------------
# Config round trip and refusals (no transformers needed)


@pytest.mark.parametrize("name", FAMILIES)
def test_config_round_trips_to_the_family(name: str) -> None:
    family = FAMILIES[name]
    config = hf_config_from_args(family.args)
    assert config["architectures"] == [architecture_of(family.args)] == [family.architecture]
    assert args_from_hf_config(config) == family.args


def test_transformers_4_spelling_of_llama3_rope_is_read() -> None:
    config = hf_config_from_args(FAMILIES["llama3"].args)
    del config["rope_parameters"]  # transformers 4: rope_theta + rope_scaling
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert args_from_hf_config(config) == FAMILIES["llama3"].args


def test_class_defaults_fill_missing_keys() -> None:
    """A Mistral config without ``sliding_window`` has MistralConfig's 4096; ``null`` has none."""
    config = hf_config_from_args(FAMILIES["mistral"].args)
    del config["sliding_window"]
    assert args_from_hf_config(config).sliding_window == 4096
    assert args_from_hf_config({**config, "sliding_window": None}).sliding_window == 0


def edited(name: str, **changes: Any) -> dict[str, Any]:
    return {**hf_config_from_args(FAMILIES[name].args), **changes}


@pytest.mark.parametrize("config, key", [
    (edited("llama3", rope_scaling={"rope_type": "yarn", "factor": 4.0}, rope_parameters=None),
     "rope_scaling.rope_type"),
    (edited("llama3", rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
     "rope_parameters.rope_type"),
    (edited("llama3", rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": None}),
     "rope_parameters.original_max_position_embeddings"),
    (edited("llama3", partial_rotary_factor=0.5), "partial_rotary_factor"),
    # Qwen2 with only its upper layer sliding: Loom's layers are all alike.
    (edited("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1,
            layer_types=None), "layer_types"),
    (edited("qwen3", attention_bias=True), "attention_bias"),  # o_proj would have a bias too
    (edited("mistral", architectures=["MixtralForCausalLM"]), "architectures"),
])
def test_what_loom_cannot_compute_is_refused_naming_the_key(config: dict, key: str) -> None:
    with pytest.raises(HFConversionError, match=f"{key}="):
        args_from_hf_config(config)


def test_export_refuses_qkv_bias_with_qk_norm() -> None:
    """No supported family has q/k norms with q/k/v biases but no o_proj bias."""
    with pytest.raises(HFConversionError, match="model.qkv_bias=True"):
        hf_config_from_args(dataclasses.replace(FAMILIES["qwen3"].args, qkv_bias=True))
