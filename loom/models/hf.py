"""Conversion between Loom's model and Hugging Face ``transformers``' ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``MistralForCausalLM``.

Three pieces, each a pure function of plain data (dicts and tensors; no ``transformers`` import,
nothing from the distributed package), so ``loom hf import/export`` (``loom/hf_cli.py``) and the
tests share them:

* the config: ``args_from_hf_config`` (``config.json`` -> ``TransformerArgs``; anything Loom's block
  cannot compute exactly is refused with the field named) and ``hf_config_from_args``, one table
  per family in ``loom.models.hf_config``;
* the parameter names and the rotary layout: ``state_dict_from_hf`` / ``state_dict_to_hf``;
* the files of a Hugging Face checkpoint: ``read_hf_checkpoint`` (one ``model.safetensors`` or a
  sharded ``model.safetensors.index.json``; never a pickled ``.bin``) and ``write_hf_checkpoint``.

The RoPE layout is the one subtle part. Loom (like Meta's original Llama) rotates interleaved
pairs (x0, x1), (x2, x3), ...; HF's Llama rotates halves, pairing x_i with x_{i + Hd/2}. The two
are the same function once the rows of ``wq`` and ``wk`` are permuted inside each head: HF row
``j * Hd/2 + i`` is Loom row ``2 i + j`` (even rows first, then odd rows). Attention scores only
see q.k inside a head, and v / wo are untouched, so the logits agree exactly. Everything else
that lives in that per-head basis moves with the rows: the q/k biases (Qwen2) are rows of the
same outputs, and the q/k norm weights (Qwen3, Hd elements) scale those outputs elementwise
before RoPE, so they are permuted as one head's rows too (the norm's mean of squares does not
depend on the order).

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

from loom.files import as_created
from loom.models import build_model
from loom.models.hf_config import (ARCHITECTURES, HFConversionError, architecture_of,
                                   args_from_hf_config, args_from_hf_file,
                                   hf_config_from_args, read_json)
from loom.models.args import TransformerArgs

__all__ = ["ARCHITECTURES", "HFConversionError", "architecture_of", "args_from_hf_config",
           "hf_config_from_args", "load_safetensors", "name_pairs", "permute_from_hf",
           "permute_to_hf", "read_hf_checkpoint", "read_hf_config", "rope_heads",
           "state_dict_from_hf", "state_dict_to_hf", "weight_map", "write_hf_checkpoint"]

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
_BIAS_NAMES = {"attention.wq.bias": "self_attn.q_proj.bias",
               "attention.wk.bias": "self_attn.k_proj.bias",
               "attention.wv.bias": "self_attn.v_proj.bias"}
_QK_NORM_NAMES = {"attention.q_norm.weight": "self_attn.q_norm.weight",
                  "attention.k_norm.weight": "self_attn.k_norm.weight"}
_END_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight",
              "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


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
# Parameters


def name_pairs(args: TransformerArgs) -> list[tuple[str, str]]:
    """(Loom name, HF name) of every stored tensor; the head is absent when tied."""
    pairs = [(loom, hf) for loom, hf in _END_NAMES.items()
             if not (args.tie_embeddings and loom == "output.weight")]
    layer_names = {**_LAYER_NAMES, **(_BIAS_NAMES if args.qkv_bias else {}),
                   **(_QK_NORM_NAMES if args.qk_norm else {})}
    for i in range(args.n_layers):
        pairs += [(f"layers.{i}.{loom}", f"model.layers.{i}.{hf}")
                  for loom, hf in layer_names.items()]
    return pairs


def rope_heads(loom_name: str, args: TransformerArgs) -> int:
    """How many heads' rows of RoPE'd outputs ``loom_name`` holds (0: not in the RoPE basis)."""
    if loom_name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if loom_name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.n_kv_heads
    if loom_name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1  # one head's Hd elements, shared by every head
    return 0


def _permute(tensor: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    """``permute_to_hf`` / ``permute_from_hf`` of a matrix's rows or a vector's elements."""
    permute = permute_to_hf if to_hf else permute_from_hf
    return permute(tensor[:, None], heads)[:, 0] if tensor.ndim == 1 else permute(tensor, heads)


def _convert(state: dict[str, torch.Tensor], args: TransformerArgs, *, to_hf: bool,
             source: str) -> dict[str, torch.Tensor]:
    """Rename (and permute what lives in the RoPE basis) every tensor; refuse missing, unknown
    or misshapen ones."""
    pairs = [(hf, loom) if to_hf else (loom, hf) for loom, hf in name_pairs(args)]
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
    # the names first: the meta model's modules cost seconds per 10,000 layers (a config.json of
    # 100,000 layers beside one tensor took 124 s and 4 GB to refuse)
    shapes = {k: v.shape for k, v in build_model(args, device="meta").state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for dst, src in pairs:
        loom_name = src if to_hf else dst
        tensor = state[src].float()  # Loom keeps fp32 weights; bf16 -> fp32 is exact
        if tensor.shape != shapes[loom_name]:
            raise HFConversionError(f"{source}: {src} has shape {tuple(tensor.shape)}, the config"
                                    f" says {tuple(shapes[loom_name])}")
        heads = rope_heads(loom_name, args)
        if heads:
            tensor = _permute(tensor, heads, to_hf)
        out[dst] = tensor.contiguous()
    return out


def state_dict_from_hf(state: dict[str, torch.Tensor], args: TransformerArgs,
                       source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Loom's state dict (fp32, no ``output.weight`` when tied) from an HF model's tensors."""
    return _convert(state, args, to_hf=False, source=source)


def state_dict_to_hf(state: dict[str, torch.Tensor], args: TransformerArgs,
                     source: str = "model") -> dict[str, torch.Tensor]:
    """An HF model's tensors (fp32, no ``lm_head.weight`` when tied) from Loom's state dict."""
    return _convert(state, args, to_hf=True, source=source)


# --------------------------------------------------------------------------------------------
# Files


# The stored types read as weights (safetensors' names): each converts to fp32 exactly. Integer,
# boolean and complex tensors are no weights of these families (casting would drop a sign, a
# range or the imaginary part), and 8- and 4-bit floats are quantized checkpoints whose scales
# live in other tensors: reading those alone would give silently wrong weights.
WEIGHT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                 "BF16": torch.bfloat16}


def weight_dtype_rule() -> str:
    return (f"Loom reads weights stored as {', '.join(WEIGHT_DTYPES)} (a quantized or"
            " non-float tensor is not converted)")


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a missing or corrupt one is named (never a pickle),
    as is a tensor of a type ``WEIGHT_DTYPES`` lacks."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (named by the checkpoint)")
    try:
        state = load_file(str(path))
    except SafetensorError as err:  # a truncated or corrupt file: its header names the problem
        raise HFConversionError(f"{path}: not a readable safetensors file ({err})") from None
    weight_types = set(WEIGHT_DTYPES.values())
    for name, tensor in state.items():
        if tensor.dtype not in weight_types:
            raise HFConversionError(f"{path}: {name} is stored as {tensor.dtype};"
                                    f" {weight_dtype_rule()}")
    return state


def read_hf_config(hf_dir: str | Path) -> TransformerArgs:
    """Loom's model shape for the ``config.json`` of an HF directory (refused by name where Loom
    cannot compute the model exactly)."""
    config_path = Path(hf_dir) / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: not a Hugging Face model directory")
    return args_from_hf_file(config_path)


def weight_map(index_path: Path) -> dict[str, str]:
    """A sharded checkpoint's index: tensor name -> shard file, each a plain file name in the
    checkpoint directory (a name is data from the checkpoint: it must not point outside it)."""
    index = read_json(index_path)
    mapping = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
        raise HFConversionError(f"{index_path}: weight_map must be an object of tensor name ->"
                                " shard file name")
    for shard in mapping.values():
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise HFConversionError(f"{index_path.name}: shard name {shard!r} is not a plain file"
                                    " name in the checkpoint directory")
    return mapping


def read_hf_checkpoint(hf_dir: str | Path, args: TransformerArgs | None = None,
                       ) -> tuple[TransformerArgs, dict[str, torch.Tensor]]:
    """``config.json`` and the safetensors weights (single file or sharded) of an HF directory,
    converted to Loom's model shape and state dict. ``args``: the shape ``read_hf_config`` gave,
    when the caller has checked it before any weight is read."""
    hf_dir = Path(hf_dir)
    if args is None:
        args = read_hf_config(hf_dir)
    if (hf_dir / SINGLE_FILE).is_file():
        state = load_safetensors(hf_dir / SINGLE_FILE)
    elif (hf_dir / INDEX_FILE).is_file():
        state = {}
        for shard in sorted(set(weight_map(hf_dir / INDEX_FILE).values())):
            state.update(load_safetensors(hf_dir / shard))
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
    as_created(tmp)  # safetensors writes 0600
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
