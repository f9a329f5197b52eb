"""Specifications for Hugging Face interop (``loom.models.hf``, ``loom hf import | export``).

Done when the logits of an HF ``LlamaForCausalLM`` and of Loom's model agree within 1e-5 (fp32)
both ways. Those tests need the optional ``transformers`` package (``pip install -e .[hf]``) and
are skipped without it; the RoPE permutation, the config rules, the refusals and the file round
trip are checked with hand-written files and run everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loom.config import load_config
from loom.errors import ConfigError
from loom.generate import load_trained_model
from loom.hf_cli import export_hf, import_hf, main, read_run, write_run
from loom.models import TransformerArgs, build_model, reset_parameters
from loom.models.hf import (HFConversionError, args_from_hf_config, hf_config_from_args,
                            permute_from_hf, permute_to_hf, read_hf_checkpoint,
                            state_dict_from_hf, state_dict_to_hf, write_hf_checkpoint)
from loom.models.layers import apply_rope, rope_tables

torch.set_num_threads(1)

# The shape of the issue: 64 wide, 2 layers, 4 heads over 2 key/value heads (GQA), vocab 320.
SMALL = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=320,
                        max_seq_len=64, norm_eps=1e-6, rope_theta=10000.0)
B, S = 2, 24
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, the bound


def loom_model(args: TransformerArgs, state: dict[str, torch.Tensor] | None = None, seed: int = 0):
    """Loom's model with ``state`` loaded (or seeded weights), norms perturbed off their ones."""
    model = build_model(args, device="cpu")
    reset_parameters(model, seed)
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert set(missing) <= ({"output.weight"} if args.tie_embeddings else set()), missing
        assert not unexpected
    return model.eval()


def random_ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab, (B, S), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------
# The RoPE permutation (no transformers needed)


def rotate_half_rope(x_BSNH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor):
    """HF Llama's RoPE: x_i pairs with x_{i + Hd/2}, frequencies repeated over both halves."""
    cos = torch.cat((cos_SH, cos_SH), -1)[None, :, None, :]
    sin = torch.cat((sin_SH, sin_SH), -1)[None, :, None, :]
    first, second = x_BSNH.chunk(2, dim=-1)
    return x_BSNH * cos + torch.cat((-second, first), -1) * sin


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_permutation_round_trips_exactly(heads: int) -> None:
    w = torch.randn(heads * 16, 64)
    assert torch.equal(permute_from_hf(permute_to_hf(w, heads), heads), w)
    assert torch.equal(permute_to_hf(permute_from_hf(w, heads), heads), w)
    assert not torch.equal(permute_to_hf(w, heads), w)  # it does move rows


def test_permuted_projection_under_rotate_half_equals_interleaved_rope() -> None:
    heads, head_dim = 4, 16
    w, x = torch.randn(heads * head_dim, 64), torch.randn(B, S, 64)
    cos, sin = rope_tables(head_dim, S, 10000.0)
    loom_q = apply_rope((x @ w.T).view(B, S, heads, head_dim), cos, sin)
    hf_q = rotate_half_rope((x @ permute_to_hf(w, heads).T).view(B, S, heads, head_dim), cos, sin)
    # Same vectors up to the per-head reordering: even components first, then odd ones.
    reordered = loom_q.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    torch.testing.assert_close(hf_q, reordered, rtol=1e-6, atol=1e-6)
    # Hence the same attention scores: q.k within a head, over positions (values ~1e2: fp32 sums).
    hf_q, loom_q = hf_q.transpose(1, 2), loom_q.transpose(1, 2)
    torch.testing.assert_close(hf_q @ hf_q.transpose(-1, -2), loom_q @ loom_q.transpose(-1, -2),
                               rtol=1e-5, atol=1e-4)


# --------------------------------------------------------------------------------------------
# Config and files (no transformers needed)


def test_config_round_trips() -> None:
    for args in (SMALL, dataclasses.replace(SMALL, tie_embeddings=True, n_kv_heads=4)):
        assert args_from_hf_config(hf_config_from_args(args)) == args


def test_transformers_4_config_spelling_is_read() -> None:
    cfg = {**hf_config_from_args(SMALL), "rope_theta": 500000.0}
    del cfg["rope_parameters"]
    assert args_from_hf_config(cfg).rope_theta == 500000.0


def test_files_round_trip_bit_exactly(tmp_path: Path) -> None:
    for tied in (False, True):
        args = dataclasses.replace(SMALL, tie_embeddings=tied)
        state = {k: v for k, v in loom_model(args, seed=3).state_dict().items()
                 if not (tied and k == "output.weight")}
        write_run(tmp_path / f"run{tied}", args, state)
        export_hf(tmp_path / f"run{tied}", tmp_path / f"hf{tied}")
        hf_names = load_file(str(tmp_path / f"hf{tied}/model.safetensors"))
        assert ("lm_head.weight" in hf_names) != tied  # a tied head is not stored
        assert import_hf(tmp_path / f"hf{tied}", tmp_path / f"back{tied}") == args
        back_args, back = read_run(tmp_path / f"back{tied}")
        assert back_args == args and back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def hf_dir_with(tmp_path: Path, **config_changes) -> Path:
    """An HF directory exported from Loom, then its config.json edited by hand."""
    state = loom_model(SMALL).state_dict()
    write_hf_checkpoint(tmp_path / "hf", SMALL, state)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_changes}))
    return tmp_path / "hf"


@pytest.mark.parametrize("change, field", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 15}, "head_dim"),  # odd: RoPE rotates pairs
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path: Path, change, field) -> None:
    with pytest.raises(HFConversionError, match=f"{field}="):
        read_hf_checkpoint(hf_dir_with(tmp_path, **change))


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    hf = hf_dir_with(tmp_path)
    (hf / "model.safetensors").rename(hf / "pytorch_model.bin")
    with pytest.raises(HFConversionError, match="safetensors only.*arbitrary code"):
        read_hf_checkpoint(hf)


def test_mismatched_tensors_are_refused(tmp_path: Path) -> None:
    hf = hf_dir_with(tmp_path)
    state = load_file(str(hf / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(HFConversionError, match="missing.*up_proj"):
        state_dict_from_hf(state, SMALL)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(HFConversionError, match="up_proj.weight has shape"):
        state_dict_from_hf(state, SMALL)


@pytest.mark.timeout(60)
def test_missing_tensors_are_refused_before_the_model_of_the_config_is_built() -> None:
    """A config of 100,000 layers (the most a config may have) beside one tensor: the names are
    compared first; building the meta model for the shapes first took 124 s and 4 GB."""
    deep = dataclasses.replace(SMALL, n_layers=100_000)
    with pytest.raises(HFConversionError, match="missing"):
        state_dict_from_hf({"model.embed_tokens.weight": torch.zeros(SMALL.vocab_size,
                                                                     SMALL.dim)}, deep)


def test_sharded_checkpoint_and_unsafe_shard_names(tmp_path: Path) -> None:
    hf = hf_dir_with(tmp_path)
    state = load_file(str(hf / "model.safetensors"))
    (hf / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(hf / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    args, loom_state = read_hf_checkpoint(hf)
    assert all(torch.equal(v, loom_state[k]) for k, v in state_dict_from_hf(state, args).items())
    index["weight_map"][names[0]] = "../a.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFConversionError, match="not a plain file name"):
        read_hf_checkpoint(hf)


def test_moe_export_is_refused() -> None:
    with pytest.raises(HFConversionError, match="model.n_experts=4"):
        hf_config_from_args(dataclasses.replace(SMALL, n_experts=4))


def test_imported_run_generates_once_it_has_a_tokenizer(tmp_path: Path) -> None:
    from loom.data.tokenizer import ByteTokenizer
    from loom.generate import generate

    import_hf(hf_dir_with(tmp_path), tmp_path / "run")
    ByteTokenizer().save(tmp_path / "run" / "data")  # import converts no tokenizer
    text = generate(tmp_path / "run", "ab", max_new_tokens=3, temperature=0)
    assert text.startswith("ab")


def test_cli(tmp_path: Path, capsys) -> None:
    hf = hf_dir_with(tmp_path)
    assert main(["hf", "import", str(hf), "--run", str(tmp_path / "run")]) == 0
    assert "2 layers, dim 64" in capsys.readouterr().out
    assert main(["hf", "import", str(hf), "--run", str(tmp_path / "run")]) == 2  # exists
    assert main(["hf", "import", str(tmp_path / "nowhere"), "--run", str(tmp_path / "r0")]) == 2
    assert main(["hf", "export", str(tmp_path / "nowhere"), str(tmp_path / "o0")]) == 2
    assert not (tmp_path / "r0").exists() and not (tmp_path / "o0").exists()
    assert main(["hf", "import", str(hf), "--run", str(tmp_path / "run"), "--overwrite"]) == 0
    assert main(["hf", "export", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    (hf / "config.json").write_text(json.dumps({**hf_config_from_args(SMALL), "mlp_bias": True}))
    assert main(["hf", "import", str(hf), "--run", str(tmp_path / "r2")]) == 2
    assert "mlp_bias=True" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    # sizes no run could train are refused before a layer name is listed (10**12 layers once
    # ran the importer out of memory)
    ({"num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000: at most 100,000"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps=nan: must be a finite number"),
    ({"rms_norm_eps": -1.0}, "model.norm_eps=-1.0: must be a finite number > 0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0: a positive integer"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
     "model.rope_theta=0.0: must be > 0"),
    # JSON of the wrong type is named, never coerced ("false" would be truthy)
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false': must be true or false"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5': must be a number"),
    ({"num_key_value_heads": "4"}, "num_key_value_heads='4'"),
    ({"rope_parameters": [1, 2]}, "rope_parameters=\\[1, 2\\]: must be a JSON object"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
     "rope_parameters.rope_theta='x': must be a number"),
    ({"architectures": None, "model_type": ["llama"]}, "architectures=None"),
    # Python's JSON reader takes Infinity and integers no float holds (int(inf) overflowed)
    ({"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": float("inf")}},
     "original_max_position_embeddings=inf: must be a finite number"),
    ({"rope_parameters": {**LLAMA3_ROPE, "original_max_position_embeddings": 1e300}},
     "original_max_position_embeddings=1e\\+300: a whole number of positions below"),
    ({"rope_parameters": {**LLAMA3_ROPE, "factor": 10**400}}, "factor=1000.*: must be a finite"),
    ({"rope_theta": float("inf"), "rope_parameters": None}, "rope_theta=inf: must be a finite"),
])
def test_hostile_configs_exit_2_with_one_line(tmp_path: Path, capsys, change: dict,
                                              message: str) -> None:
    hf = hf_dir_with(tmp_path, **change)
    assert main(["hf", "import", str(hf), "--run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64, torch.int32])
def test_weights_of_a_type_that_is_no_exact_weight_are_refused_by_name(tmp_path: Path, capsys,
                                                                       dtype) -> None:
    """8-bit floats are a quantized checkpoint's (its scales live elsewhere), complex ones lose
    their imaginary part in fp32, integers are no weights: each is named, never converted."""
    hf = hf_dir_with(tmp_path)
    state = load_file(str(hf / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"].to(dtype)
    save_file(state, str(hf / "model.safetensors"))
    assert main(["hf", "import", str(hf), "--run", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"model.norm.weight is stored as {dtype}" in err, err
    assert not (tmp_path / "run").exists()


def test_hostile_files_exit_2_naming_the_file(tmp_path: Path, capsys) -> None:
    hf = hf_dir_with(tmp_path)
    weights = (hf / "model.safetensors").read_bytes()
    cases = [
        ("config.json", "{not json", "config.json: not JSON"),
        ("config.json", "[1, 2]", "config.json: must hold a JSON object, not list"),
        ("model.safetensors", weights[:300], "model.safetensors: not a readable safetensors"),
    ]
    for name, content, message in cases:
        original = (hf / name).read_bytes()
        (hf / name).write_bytes(content.encode() if isinstance(content, str) else content)
        assert main(["hf", "import", str(hf), "--run", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, err
        (hf / name).write_bytes(original)
    (hf / "model.safetensors").rename(hf / "a.safetensors")
    index = hf / "model.safetensors.index.json"
    for weight_map, message in [([1], "weight_map must be an object"),
                                ({"x": "b.safetensors"}, "b.safetensors not found")]:
        index.write_text(json.dumps({"weight_map": weight_map}))
        assert main(["hf", "import", str(hf), "--run", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000: at most 100,000"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "x"}}, "must be a number"),
    ({"tie_word_embeddings": "false"}, "must be true or false"),
])
def test_init_from_a_hostile_hf_directory_is_a_config_error(tmp_path: Path, change: dict,
                                                             message: str) -> None:
    """``model.init_from`` opens the directory while the config loads (``PretrainedSource``):
    the same refusals as ``hf import``, before a layer name is listed."""
    hf = hf_dir_with(tmp_path, **change)
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"model.init_from": str(hf)})


def test_init_from_a_malformed_shard_index_is_a_config_error(tmp_path: Path) -> None:
    hf = hf_dir_with(tmp_path)
    (hf / "model.safetensors").rename(hf / "a.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(ConfigError, match="weight_map must be an object"):
        load_config(None, {"model.init_from": str(hf)})


def test_a_run_edited_to_another_size_is_refused_before_allocating(tmp_path: Path) -> None:
    """``hf export`` and ``generate`` read a run's config.toml: a shape the weights do not have
    is named (once ``dim = 100000000`` tried to allocate 128 GB; 10**12 layers never ended)."""
    write_run(tmp_path / "run", SMALL, loom_model(SMALL).state_dict())
    config = tmp_path / "run" / "config.toml"
    original = config.read_text()
    config.write_text(re.sub(r"(?m)^n_layers = .*$", "n_layers = 1000000000000", original))
    with pytest.raises(ConfigError, match="model.n_layers"):
        read_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="model.n_layers"):
        load_trained_model(tmp_path / "run", torch.device("cpu"))
    config.write_text(re.sub(r"(?m)^dim = .*$", "dim = 100000000", original))
    with pytest.raises(ValueError, match="has shape .* the run's config.toml says"):
        load_trained_model(tmp_path / "run", torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# Logit parity with transformers itself (optional dependency)


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


def hf_config(transformers, args: TransformerArgs):
    return transformers.LlamaConfig(
        hidden_size=args.dim, num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads, intermediate_size=args.ffn_dim,
        vocab_size=args.vocab_size, max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_embeddings)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every weight (norms included, which both sides initialise to ones) off its init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


VARIANTS = {"gqa": SMALL, "mha": dataclasses.replace(SMALL, n_kv_heads=4),
            "tied": dataclasses.replace(SMALL, tie_embeddings=True, rope_theta=500000.0)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_to_loom_logits_match(transformers, tmp_path: Path, variant: str) -> None:
    args = VARIANTS[variant]
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config(transformers, args)).float().eval()
    perturb(hf_model, 1)
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert import_hf(tmp_path / "hf", tmp_path / "run") == args
    ids = random_ids(args.vocab_size)
    with torch.no_grad():
        expected = hf_model(ids).logits
        actual = loom_model(*read_run(tmp_path / "run"))(ids)
    torch.testing.assert_close(actual, expected, **TOL)


@pytest.mark.parametrize("variant", VARIANTS)
def test_loom_to_hf_logits_match(transformers, tmp_path: Path, variant: str) -> None:
    args = VARIANTS[variant]
    model = loom_model(args, seed=7)
    perturb(model, 2)
    state = {k: v for k, v in model.state_dict().items()
             if not (args.tie_embeddings and k == "output.weight")}
    write_run(tmp_path / "run", args, state)
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf_model.dtype == torch.float32
    ids = random_ids(args.vocab_size, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), **TOL)


def test_sharded_hf_checkpoint_imports(transformers, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config(transformers, SMALL)).eval()
    hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    args, state = read_hf_checkpoint(tmp_path / "hf")
    ids = random_ids(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(loom_model(args, state)(ids), hf_model(ids).logits, **TOL)
