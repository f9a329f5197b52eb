"""Conversion between Loom's Llama and Hugging Face ``transformers``' ``LlamaForCausalLM``.

Three pieces, each a pure function of plain data (dicts and tensors; no ``transformers`` import,
nothing from the distributed package), so ``loom hf import/export`` (``loom/hf_cli.py``) and the
tests share them:

* the config: ``args_from_hf_config`` (``config.json`` -> ``TransformerArgs``; anything Loom's block
  cannot compute exactly is refused with the field named) and ``hf_config_from_args``;
* the parameter names and the rotary layout: ``state_dict_from_hf`` / ``state_dict_to_hf``;
* the files of a Hugging Face checkpoint: ``read_hf_checkpoint`` (one ``model.safetensors`` or a
  sharded ``model.safetensors.index.json``; never a pickled ``.bin``) and ``write_hf_checkpoint``.

The RoPE layout is the one subtle part. Loom (like Meta's original Llama) rotates interleaved
pairs (x0, x1), (x2, x3), ...; HF's Llama rotates halves, pairing x_i with x_{i + Hd/2}. The two
are the same function once the rows of ``wq`` and ``wk`` are permuted inside each head: HF row
``j * Hd/2 + i`` is Loom row ``2 i + j`` (even rows first, then odd rows). Attention scores only
see q.k inside a head, and v / wo are untouched, so the logits agree exactly.

Why hand-written: ``transformers`` ships this conversion only as a script going the other way
(``convert_llama_weights_to_hf.py``, from Meta's release files), not as a library API, and
importing ``transformers`` for a renaming would make it a hard dependency.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from loom.models import build_model
from loom.models.layers import TransformerArgs

ARCHITECTURE = "LlamaForCausalLM"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Loom name inside layers.{i} -> HF name inside model.layers.{i}.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_END_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# LlamaConfig's defaults for the optional fields of config.json (the shape fields are required).
_HF_DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
                "tie_word_embeddings": False}


class HFConversionError(ValueError):
    """A checkpoint or config Loom cannot convert exactly; the message names the field or file."""


def permute_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a Loom ``wq``/``wk`` (interleaved RoPE pairs) in HF's rotate-half order.

    The permutation of HF's ``convert_llama_weights_to_hf.py``: per head, row ``2 i + j`` moves to
    ``j * Hd/2 + i``.
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``permute_to_hf``: HF rotate-half rows back to interleaved pairs."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


# --------------------------------------------------------------------------------------------
# Config


def _refuse(field: str, value: Any, rule: str) -> HFConversionError:
    return HFConversionError(f"config.json: {field}={value!r}: {rule}")


def _rope_theta(cfg: dict[str, Any]) -> float:
    """RoPE base from either generation of config.json, refusing any scaled RoPE.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling`` (null for plain RoPE); 5.x writes
    ``rope_parameters = {rope_type, rope_theta}``.
    """
    theta = cfg.get("rope_theta", _HF_DEFAULTS["rope_theta"])
    for field in ("rope_scaling", "rope_parameters"):
        params = cfg.get(field)
        if params is None:
            continue
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise _refuse(f"{field}.rope_type", kind, "scaled RoPE is not implemented in Loom's"
                          " model (only plain RoPE, rope_type 'default')")
        theta = params.get("rope_theta", theta)
    return float(theta)


def args_from_hf_config(cfg: dict[str, Any]) -> TransformerArgs:
    """Loom's model shape for an HF Llama ``config.json``; refuses what Loom cannot match."""
    architectures = cfg.get("architectures") or ([ARCHITECTURE] if cfg.get("model_type") == "llama"
                                                 else None)
    if architectures != [ARCHITECTURE]:
        raise _refuse("architectures", cfg.get("architectures"), f"only [{ARCHITECTURE!r}] is"
                      " supported")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size"):
        if not isinstance(cfg.get(field), int) or cfg[field] < 1:
            raise _refuse(field, cfg.get(field), "required, a positive integer")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field, False):
            raise _refuse(field, cfg[field], "biases are not implemented in Loom's model")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _refuse("hidden_act", cfg["hidden_act"], "Loom's MLP is SwiGLU (silu)")
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if dim % n_heads:
        raise _refuse("num_attention_heads", n_heads, f"must divide hidden_size {dim}")
    head_dim = cfg.get("head_dim") or dim // n_heads
    if head_dim != dim // n_heads:
        raise _refuse("head_dim", head_dim, f"Loom's head dim is hidden_size / num_attention_heads"
                      f" = {dim // n_heads}")
    n_kv_heads = cfg.get("num_key_value_heads") or n_heads
    if n_heads % n_kv_heads:
        raise _refuse("num_key_value_heads", n_kv_heads,
                      f"must divide num_attention_heads {n_heads}")
    opt = {**_HF_DEFAULTS, **{k: cfg[k] for k in _HF_DEFAULTS if cfg.get(k) is not None}}
    return TransformerArgs(
        dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        max_seq_len=int(opt["max_position_embeddings"]), norm_eps=float(opt["rms_norm_eps"]),
        rope_theta=_rope_theta(cfg), tie_embeddings=bool(opt["tie_word_embeddings"]))


def hf_config_from_args(args: TransformerArgs) -> dict[str, Any]:
    """HF ``config.json`` (a dict) for a dense Loom model, readable by transformers 4 and 5."""
    if args.n_experts:
        raise HFConversionError(f"model.n_experts={args.n_experts}: a mixture-of-experts model is"
                                f" not a {ARCHITECTURE}; only dense models can be exported")
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "hidden_act": "silu", "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        # Both spellings of plain RoPE: transformers 4 reads the first two, 5 the third.
        "rope_theta": args.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings, "torch_dtype": "float32",
    }


# --------------------------------------------------------------------------------------------
# Parameters


def _name_pairs(args: TransformerArgs) -> list[tuple[str, str]]:
    """(Loom name, HF name) of every stored tensor; the head is absent when tied."""
    pairs = [(loom, hf) for loom, hf in _END_NAMES.items()
             if not (args.tie_embeddings and loom == "output.weight")]
    for i in range(args.n_layers):
        pairs += [(f"layers.{i}.{loom}", f"model.layers.{i}.{hf}")
                  for loom, hf in _LAYER_NAMES.items()]
    return pairs


def _expected_shapes(args: TransformerArgs) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in build_model(args, device="meta").state_dict().items()}


def _convert(state: dict[str, torch.Tensor], args: TransformerArgs, *, to_hf: bool,
             source: str) -> dict[str, torch.Tensor]:
    """Rename (and permute q/k) every tensor; refuse missing, unknown or misshapen ones."""
    shapes = _expected_shapes(args)
    pairs = [(hf, loom) if to_hf else (loom, hf) for loom, hf in _name_pairs(args)]
    head = "output.weight" if to_hf else "lm_head.weight"
    # What may be present and is dropped: a tied head stored anyway (the embedding wins, as
    # transformers does), and the RoPE frequencies older transformers saved as a buffer.
    ignored = {k for k in state if k.endswith("rotary_emb.inv_freq")
               or (args.tie_embeddings and k == head)}
    wanted = {src for _, src in pairs}
    missing, unknown = sorted(wanted - set(state)), sorted(set(state) - wanted - ignored)
    if missing or unknown:
        raise HFConversionError(f"{source} does not match the model in its config: missing"
                                f" {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected"
                                f" {unknown[:4]}{'...' if len(unknown) > 4 else ''}")
    out: dict[str, torch.Tensor] = {}
    for dst, src in pairs:
        loom_name = src if to_hf else dst
        tensor = state[src].float()  # Loom keeps fp32 weights; bf16 -> fp32 is exact
        if tensor.shape != shapes[loom_name]:
            raise HFConversionError(f"{source}: {src} has shape {tuple(tensor.shape)}, the config"
                                    f" says {tuple(shapes[loom_name])}")
        if loom_name.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = args.n_heads if loom_name.endswith("wq.weight") else args.n_kv_heads
            tensor = (permute_to_hf if to_hf else permute_from_hf)(tensor, heads)
        out[dst] = tensor.contiguous()
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], args: TransformerArgs,
                       source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Loom's state dict (fp32, no ``output.weight`` when tied) from an HF Llama's tensors."""
    return _convert(state, args, to_hf=False, source=source)


def state_dict_to_hf(state: dict[str, torch.Tensor], args: TransformerArgs,
                     source: str = "model") -> dict[str, torch.Tensor]:
    """An HF Llama's tensors (fp32, no ``lm_head.weight`` when tied) from Loom's state dict."""
    return _convert(state, args, to_hf=True, source=source)


# --------------------------------------------------------------------------------------------
# Files


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def read_hf_checkpoint(hf_dir: str | Path) -> tuple[TransformerArgs, dict[str, torch.Tensor]]:
    """``config.json`` and the safetensors weights (single file or sharded) of an HF directory,
    converted to Loom's model shape and state dict."""
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    args = args_from_hf_config(json.loads(config_path.read_text()))
    if (hf_dir / SINGLE_FILE).is_file():
        state = _load_safetensors(hf_dir / SINGLE_FILE)
    elif (hf_dir / INDEX_FILE).is_file():
        weight_map: dict[str, str] = json.loads((hf_dir / INDEX_FILE).read_text())["weight_map"]
        state = {}
        for shard in sorted(set(weight_map.values())):
            # A shard name is data from the checkpoint: it must not point outside the directory.
            if Path(shard).name != shard:
                raise HFConversionError(f"{INDEX_FILE}: shard name {shard!r} is not a plain file"
                                        " name in the checkpoint directory")
            state.update(_load_safetensors(hf_dir / shard))
    elif any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise HFConversionError(
            f"{hf_dir} holds only pickled weights (.bin/.pt); Loom reads safetensors only, because"
            " unpickling can run arbitrary code. In a trusted environment, convert with"
            " transformers: from_pretrained(dir).save_pretrained(out, safe_serialization=True)")
    else:
        raise FileNotFoundError(f"{hf_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    return args, state_dict_from_hf(state, args, source=str(hf_dir))


def atomic_save_safetensors(state: dict[str, torch.Tensor], path: Path,
                            metadata: dict[str, str] | None = None) -> None:
    """``save_file`` to a temporary name, then rename: a crash never leaves half a file."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", **(metadata or {})})
    os.replace(tmp, path)


def write_hf_checkpoint(out_dir: str | Path, args: TransformerArgs,
                        state: dict[str, torch.Tensor],
                        extra_config: dict[str, Any] | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (HF names, fp32) for a Loom state dict."""
    out_dir = Path(out_dir)
    config = {**hf_config_from_args(args), **(extra_config or {})}
    hf_state = state_dict_to_hf(state, args)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(hf_state, out_dir / SINGLE_FILE)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
