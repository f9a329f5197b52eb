"""A decoder's shape (``TransformerArgs``) and its RoPE schedule (``RopeScaling``): plain data.

Kept apart from the layers (``loom.models.layers``, ``loom.models.rope``) so that what only needs
shapes (the config, the formulas, the simulator and the planner) does not import torch: ``loom
plan`` prices a trillion-parameter model in about a second, where importing torch alone takes
more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# RoPE schedules Loom computes exactly (``TransformerArgs.rope_scaling``).
ROPE_SCALINGS = ("none", "linear", "llama3")
# Dense MLP kinds (``TransformerArgs.mlp``) and their D x F weight matrices.
MLP_MATRICES = {"swiglu": 3, "gelu": 2}
# Far beyond any real model; what walks the layers one by one (weight names, the memory
# estimators) refuses more, so a hostile config never hangs or exhausts memory.
MAX_LAYERS = 100_000
# Every rank builds RoPE tables of max_seq_len x head_dim / 2 angles (fp64, then fp32 cos and
# sin), so the length bounds that memory: 2^24 positions (above the longest published context,
# ~10^7) is already 8 GiB of tables at head_dim 128; 10^12 asked for petabytes in every worker.
MAX_SEQ_LEN = 2**24


@dataclass(frozen=True)
class RopeScaling:
    """How the plain frequencies are rescaled; the fields a kind does not use are ignored."""

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 0


@dataclass
class TransformerArgs:
    """Shape of a decoder. ``ffn_dim`` is the dense MLP's hidden size F: ``mlp = "swiglu"``
    (Llama: w2(silu(w1 x) * w3 x), three D x F matrices) or ``"gelu"`` (GPT-2/3, Megatron's GPT:
    w2(gelu(w1 x)), two, tanh approximation; no biases, as everywhere in Loom's block).

    Mixture of experts (``loom.models.moe``; ``n_experts=0`` is a dense model): ``n_experts``
    routed experts of the dense MLP's kind (SwiGLU or GELU: ``mlp``) of hidden size
    ``expert_ffn_dim`` (0: ``ffn_dim``), ``top_k`` per token
    (weights renormalised over the top k when ``renormalize_top_k``, as Mixtral), plus
    ``n_shared_experts`` always-active experts (DeepSeekMoE). ``capacity_factor`` 0 is dropless;
    otherwise each expert takes at most ``ceil(capacity_factor * S * top_k / n_experts)``
    assignments per sequence. Layer i is MoE when ``i >= n_dense_layers`` and
    ``(i + 1) % moe_every == 0``. ``aux_loss_coef`` weighs the load-balancing loss the trainer adds.

    Attention variants (module docstring; every default keeps the Llama block bit-identical):
    ``head_dim_override``, ``qkv_bias``, ``qk_norm``, ``sliding_window`` and the RoPE schedule
    ``rope_scaling`` with its ``rope_scaling_*`` parameters (``loom.models.rope``).
    """

    dim: int = 256  # model width h (the residual stream)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # query heads (head size dim / n_heads)
    n_kv_heads: int = 4  # key/value heads (grouped-query attention; n_heads for plain MHA)
    ffn_dim: int = 768  # hidden size F of the dense MLP
    vocab_size: int = 320  # embedding and output rows
    max_seq_len: int = 1024  # longest sequence the RoPE tables cover
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency
    tie_embeddings: bool = False  # the output head shares the embedding matrix
    n_experts: int = 0  # routed MoE experts per MoE layer; 0: a dense model
    top_k: int = 2  # experts each token is routed to
    expert_ffn_dim: int = 0  # hidden size of each expert; 0: ffn_dim
    n_shared_experts: int = 0  # always-active experts beside the routed ones (DeepSeekMoE)
    capacity_factor: float = 0.0  # 0: dropless; else assignments per expert per sequence cap
    moe_every: int = 1  # layer i is MoE when (i + 1) % moe_every == 0 (and i >= n_dense_layers)
    n_dense_layers: int = 0  # the first layers that stay dense
    renormalize_top_k: bool = True  # renormalize the top-k routing weights to sum to 1 (Mixtral)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss the trainer adds
    head_dim_override: int = 0  # head size Hd when not dim / n_heads (Qwen3); 0: dim / n_heads
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    sliding_window: int = 0  # query i sees keys i-W+1 .. i (Mistral); 0: full causal attention
    rope_scaling: Literal["none", "linear", "llama3"] = "none"  # RoPE frequency schedule
    rope_scaling_factor: float = 1.0  # linear, llama3: low frequencies divided by this
    rope_scaling_low_freq_factor: float = 1.0  # llama3: wavelengths > L / this are divided
    rope_scaling_high_freq_factor: float = 4.0  # llama3: wavelengths < L / this are kept
    rope_scaling_original_max_len: int = 0  # llama3: L, the original training context
    mlp: Literal["swiglu", "gelu"] = "swiglu"  # dense MLP: SwiGLU (3 D x F) or GELU (2 D x F)

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def rope(self) -> RopeScaling:
        """The RoPE frequency schedule the ``rope_scaling*`` fields describe."""
        return RopeScaling(self.rope_scaling, self.rope_scaling_factor,
                           self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor,
                           self.rope_scaling_original_max_len)

    @property
    def mlp_matrices(self) -> int:
        """D x F weight matrices of the dense MLP: 3 (SwiGLU: w1, w3, w2) or 2 (GELU: w1, w2)."""
        if self.mlp not in MLP_MATRICES:
            raise ValueError(f"model.mlp={self.mlp!r}: must be one of {', '.join(MLP_MATRICES)}")
        return MLP_MATRICES[self.mlp]

    def moe_layer(self, layer_id: int) -> bool:
        """Whether global layer ``layer_id`` has a mixture-of-experts feed-forward."""
        return (self.n_experts > 0 and layer_id >= self.n_dense_layers
                and (layer_id + 1) % self.moe_every == 0)


__all__ = ["MLP_MATRICES", "ROPE_SCALINGS", "RopeScaling", "TransformerArgs"]
