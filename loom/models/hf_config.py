"""Hugging Face ``config.json`` <-> Loom's ``TransformerArgs``, for the decoder families Loom's
block computes exactly: ``LlamaForCausalLM`` (Llama 2 and 3.x), ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` and ``MistralForCausalLM``.

What tells the families apart, and the ``TransformerArgs`` field each maps to:

* Llama: a ``llama3`` (or ``linear``) ``rope_scaling`` / ``rope_parameters`` ->
  ``rope_scaling`` and its ``rope_scaling_*`` parameters;
* Qwen2: biases on the q/k/v projections (always) -> ``qkv_bias``;
* Qwen3: ``q_norm`` / ``k_norm`` over each head, an explicit ``head_dim`` -> ``qk_norm``,
  ``head_dim_override``;
* Mistral: ``sliding_window`` (null: full attention) -> ``sliding_window``.

Every family shares the rest (RMSNorm, SwiGLU, GQA, RoPE, optional tied embeddings), and any of
them may carry a ``linear`` or ``llama3`` RoPE schedule or an explicit ``head_dim``. Export
(``hf_config_from_args``) picks the family that holds the model's features: ``qk_norm`` ->
Qwen3, ``qkv_bias`` -> Qwen2, ``sliding_window`` -> Mistral, otherwise Llama; Qwen2/3 express a
window as every layer being a ``sliding_attention`` layer.

Anything Loom's block cannot compute exactly is refused with the config key named
(``HFConversionError``): other architectures, other RoPE types (``yarn``, ``dynamic``, ...),
biases Loom has no place for (``attention_bias`` on Llama/Qwen3 includes ``o_proj``;
``mlp_bias``), partial rotary embeddings, and Qwen's mixed full/sliding layer stacks.

Why hand-written: ``transformers`` has no API that maps its configs to another codebase's, and
importing it for a table of field names would make it a hard dependency of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.errors import InputFileError, finite_float, loads_json, read_input_text
from loom.models.args import MAX_LAYERS, TransformerArgs

LLAMA, QWEN2, QWEN3, MISTRAL = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                "MistralForCausalLM")
ARCHITECTURES = (LLAMA, QWEN2, QWEN3, MISTRAL)
_MODEL_TYPES = {LLAMA: "llama", QWEN2: "qwen2", QWEN3: "qwen3", MISTRAL: "mistral"}

# Each HF config class's defaults for the optional fields of config.json (transformers 5.x;
# the shape fields are required). A field missing from a file means the class default.
_COMMON = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "head_dim": None}
_QWEN = {**_COMMON, "max_position_embeddings": 32768, "use_sliding_window": False,
         "sliding_window": 4096, "max_window_layers": 28}
_DEFAULTS: dict[str, dict[str, Any]] = {
    LLAMA: {**_COMMON, "max_position_embeddings": 2048},
    QWEN2: _QWEN,
    QWEN3: {**_QWEN, "head_dim": 128},
    MISTRAL: {**_COMMON, "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
}
# The RoPE types Loom computes, in HF's names -> TransformerArgs.rope_scaling.
_ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}
_LLAMA3_KEYS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
                "high_freq_factor": "rope_scaling_high_freq_factor",
                "original_max_position_embeddings": "rope_scaling_original_max_len"}


class HFConversionError(ValueError):
    """A checkpoint or config Loom cannot convert exactly; the message names the field or file."""


# a context length no model has trained on (2^31 positions); a larger one is a typo or an attack
MAX_POSITIONS = 2**31


def _refuse(field: str, value: Any, rule: str) -> HFConversionError:
    return HFConversionError(f"config.json: {field}={value!r}: {rule}")


# --------------------------------------------------------------------------------------------
# Import


def _architecture(cfg: dict[str, Any]) -> str:
    """The one supported architecture ``cfg`` declares (or implies by ``model_type``)."""
    architectures = cfg.get("architectures")
    if not architectures:
        by_type = {t: a for a, t in _MODEL_TYPES.items()}
        model_type = cfg.get("model_type")
        architectures = [by_type[model_type]] if isinstance(model_type, str) and (
            model_type in by_type) else None
    if not (isinstance(architectures, list) and len(architectures) == 1
            and isinstance(architectures[0], str) and architectures[0] in ARCHITECTURES):
        raise _refuse("architectures", cfg.get("architectures"),
                      f"supported: one of {', '.join(ARCHITECTURES)}")
    return architectures[0]


@dataclass(frozen=True)
class _Reader:
    """Reads fields of one config.json, falling back on its family's class defaults where a
    field is missing or null (``sliding_window``: only where missing; null means no window)."""

    cfg: dict[str, Any]
    defaults: dict[str, Any]

    def get(self, field: str) -> Any:
        if field == "sliding_window" and field in self.cfg:
            return self.cfg[field]
        value = self.cfg.get(field)
        return self.defaults.get(field) if value is None else value


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _number(field: str, value: Any) -> float:
    """A finite JSON number (not a boolean, not a string), else refused by name. Python's JSON
    reader takes ``Infinity``, ``NaN`` and integers no float holds; none is a model's field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _refuse(field, value, "must be a number")
    number = finite_float(value)
    if number is None:
        raise _refuse(field, value, "must be a finite number")
    return number


def _flag(field: str, value: Any) -> bool:
    """A JSON boolean: a string such as "false" would be truthy, so it is refused, not read."""
    if not isinstance(value, bool):
        raise _refuse(field, value, "must be true or false")
    return value


def _object(field: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _refuse(field, value, "must be a JSON object (or null)")
    return value


def _rope(cfg: dict[str, Any], theta: float) -> dict[str, Any]:
    """The RoPE fields of ``TransformerArgs`` from either generation of config.json.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling`` (null for plain RoPE); 5.x writes
    ``rope_parameters = {rope_type, rope_theta, ...}``. When both are present the latter wins.
    """
    out: dict[str, Any] = {"rope_theta": theta}
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse("partial_rotary_factor", cfg["partial_rotary_factor"],
                      "Loom rotates every channel of a head (1.0)")
    for field in ("rope_scaling", "rope_parameters"):
        params = cfg.get(field)
        if params is None:
            continue
        params = _object(field, params)
        kind = params.get("rope_type", params.get("type", "default"))
        if not isinstance(kind, str) or kind not in _ROPE_TYPES:
            raise _refuse(f"{field}.rope_type", kind, f"Loom computes RoPE types"
                          f" {', '.join(_ROPE_TYPES)} exactly, not this one")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise _refuse(f"{field}.partial_rotary_factor", params["partial_rotary_factor"],
                          "Loom rotates every channel of a head (1.0)")
        out = {"rope_theta": _number(f"{field}.rope_theta",
                                     params.get("rope_theta", out["rope_theta"])),
               "rope_scaling": _ROPE_TYPES[kind]}
        keys = {"linear": {"factor": "rope_scaling_factor"}, "llama3": _LLAMA3_KEYS}.get(kind, {})
        for key, loom_field in keys.items():
            value = params.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _refuse(f"{field}.{key}", value, f"rope_type {kind!r} needs it, a positive"
                              " number")
            number = _number(f"{field}.{key}", value)
            if loom_field.endswith("_len") and not (number.is_integer() and number < MAX_POSITIONS):
                raise _refuse(f"{field}.{key}", value, f"a whole number of positions below"
                              f" {MAX_POSITIONS:,}")
            out[loom_field] = int(number) if loom_field.endswith("_len") else number
        if kind == "llama3" and not out["rope_scaling_low_freq_factor"] < out[
                "rope_scaling_high_freq_factor"]:
            raise _refuse(f"{field}.low_freq_factor", params["low_freq_factor"],
                          "must be below high_freq_factor")
    return out


def _sliding_window(arch: str, read: _Reader, n_layers: int) -> int:
    """Loom's ``sliding_window`` (0: full attention) for a Mistral or Qwen config.

    Mistral applies ``sliding_window`` (null: none) to every layer. Qwen2/3 apply it only when
    ``use_sliding_window``, and then to the layers ``layer_types`` marks ``sliding_attention``
    (default: those from ``max_window_layers`` on); Loom's layers are all alike, so a stack
    mixing both kinds is refused.
    """
    if arch == LLAMA:
        return 0
    window = read.get("sliding_window")
    if arch in (QWEN2, QWEN3) and not _flag("use_sliding_window", read.get("use_sliding_window")):
        window = None
    if window is None:
        return 0
    if not _positive_int(window):
        raise _refuse("sliding_window", window, "a positive integer or null")
    if arch == MISTRAL:
        return window
    kinds = read.get("layer_types")
    if kinds:
        if not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
            raise _refuse("layer_types", kinds, "must be a list of layer kinds")
        kinds = set(kinds)
    else:  # the layers from max_window_layers on slide (a set: n_layers may be any size)
        first = read.get("max_window_layers")
        if isinstance(first, bool) or not isinstance(first, int):
            raise _refuse("max_window_layers", first, "must be an integer")
        kinds = {"sliding_attention" if i >= first else "full_attention"
                 for i in (0, n_layers - 1)}
    if kinds == {"full_attention"}:
        return 0
    if kinds != {"sliding_attention"}:
        raise _refuse("layer_types", sorted(kinds), "Loom's layers are all alike: every layer"
                      " full_attention or every layer sliding_attention (max_window_layers=0)")
    return window


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint, or ``HFConversionError`` naming the file and why not."""
    try:
        return loads_json(read_input_text(path))
    except InputFileError as err:
        raise HFConversionError(str(err)) from None
    except ValueError as err:  # json.JSONDecodeError
        raise HFConversionError(f"{path}: not JSON ({err})") from None


def args_from_hf_file(config_json: Path) -> TransformerArgs:
    """``args_from_hf_config`` of a ``config.json`` file (which must hold a JSON object)."""
    cfg = read_json(config_json)
    if not isinstance(cfg, dict):
        raise HFConversionError(f"{config_json}: must hold a JSON object, not"
                                f" {type(cfg).__name__}")
    return args_from_hf_config(cfg)


def args_from_hf_config(cfg: dict[str, Any]) -> TransformerArgs:
    """Loom's model shape for an HF ``config.json`` of a supported family; refuses, naming the
    key, whatever Loom cannot compute exactly."""
    arch = _architecture(cfg)
    read = _Reader(cfg, _DEFAULTS[arch])
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "vocab_size"):
        if not _positive_int(cfg.get(field)):
            raise _refuse(field, cfg.get(field), "required, a positive integer")
    if read.get("mlp_bias"):
        raise _refuse("mlp_bias", cfg["mlp_bias"], "biases in the MLP are not implemented in"
                      " Loom's model")
    if arch in (LLAMA, QWEN3, MISTRAL) and read.get("attention_bias"):
        raise _refuse("attention_bias", cfg["attention_bias"], f"{arch} then has biases on all of"
                      " q/k/v/o; Loom's model has q/k/v biases only (qkv_bias, as Qwen2)")
    if read.get("hidden_act") not in (None, "silu"):
        raise _refuse("hidden_act", cfg["hidden_act"], "Loom's MLP is SwiGLU (silu)")
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = read.get("head_dim")
    if head_dim is None:
        if dim % n_heads:
            raise _refuse("num_attention_heads", n_heads, f"must divide hidden_size {dim} (or"
                          " set head_dim)")
        head_dim = dim // n_heads
    if not _positive_int(head_dim) or head_dim % 2:
        raise _refuse("head_dim", head_dim, "a positive even integer (RoPE rotates pairs)")
    n_kv_heads = read.get("num_key_value_heads") or n_heads
    if not _positive_int(n_kv_heads):
        raise _refuse("num_key_value_heads", n_kv_heads, "a positive integer (or null)")
    if n_heads % n_kv_heads:
        raise _refuse("num_key_value_heads", n_kv_heads,
                      f"must divide num_attention_heads {n_heads}")
    n_layers = cfg["num_hidden_layers"]
    if n_layers > MAX_LAYERS:  # before any per-layer name is listed
        raise _refuse("num_hidden_layers", n_layers, f"at most {MAX_LAYERS:,}")
    max_seq_len = read.get("max_position_embeddings")
    if not _positive_int(max_seq_len):
        raise _refuse("max_position_embeddings", max_seq_len, "a positive integer")
    return TransformerArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
        max_seq_len=max_seq_len,
        norm_eps=_number("rms_norm_eps", read.get("rms_norm_eps")),
        tie_embeddings=_flag("tie_word_embeddings", read.get("tie_word_embeddings")),
        head_dim_override=0 if head_dim * n_heads == dim else head_dim,
        qkv_bias=arch == QWEN2, qk_norm=arch == QWEN3,
        sliding_window=_sliding_window(arch, read, n_layers),
        **_rope(cfg, _number("rope_theta", read.get("rope_theta"))))


# --------------------------------------------------------------------------------------------
# Export


def architecture_of(args: TransformerArgs) -> str:
    """The HF family that computes a Loom model exactly (module docstring); refuses the rest."""
    if args.n_experts:
        raise HFConversionError(f"model.n_experts={args.n_experts}: a mixture-of-experts model is"
                                " not one of the supported HF families; only dense models can be"
                                " exported")
    if args.mlp != "swiglu":
        raise HFConversionError(f"model.mlp={args.mlp!r}: a GELU-MLP (GPT-style) model is not one"
                                " of the HF families Loom converts (all are SwiGLU); only"
                                " mlp = 'swiglu' models can be exported")
    if args.qk_norm and args.qkv_bias:
        raise HFConversionError("model.qkv_bias=True with model.qk_norm=True: Qwen3 (the family"
                                " with q/k norms) has biases on all of q/k/v/o or on none")
    return QWEN3 if args.qk_norm else QWEN2 if args.qkv_bias else (
        MISTRAL if args.sliding_window else LLAMA)


def _rope_parameters(args: TransformerArgs) -> dict[str, Any]:
    kind = {v: k for k, v in _ROPE_TYPES.items()}[args.rope_scaling]
    params: dict[str, Any] = {"rope_type": kind}
    if kind == "linear":
        params["factor"] = args.rope_scaling_factor
    if kind == "llama3":
        params.update({key: getattr(args, loom) for key, loom in _LLAMA3_KEYS.items()})
    return params


def hf_config_from_args(args: TransformerArgs) -> dict[str, Any]:
    """HF ``config.json`` (a dict) for a dense Loom model, readable by transformers 4 and 5."""
    arch = architecture_of(args)
    rope = _rope_parameters(args)
    cfg: dict[str, Any] = {
        "architectures": [arch], "model_type": _MODEL_TYPES[arch],
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "hidden_act": "silu", "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        # Both spellings of RoPE: transformers 4 reads the first two, 5 the third.
        "rope_theta": args.rope_theta,
        "rope_scaling": None if args.rope_scaling == "none" else rope,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta},
        "attention_dropout": 0.0, "tie_word_embeddings": args.tie_embeddings,
        "torch_dtype": "float32",
    }
    if arch in (LLAMA, QWEN3, MISTRAL):
        cfg["attention_bias"] = False
    if arch == LLAMA:
        cfg["mlp_bias"] = False
    if arch == MISTRAL:
        cfg["sliding_window"] = args.sliding_window
    if arch in (QWEN2, QWEN3):  # a window is every layer sliding, from layer 0
        window = args.sliding_window or None
        cfg.update(use_sliding_window=window is not None, sliding_window=window,
                   max_window_layers=0 if window else args.n_layers,
                   layer_types=[("sliding" if window else "full") + "_attention"] * args.n_layers)
    return cfg
