"""The layers a Llama-style model is built from: its shape (``TransformerArgs``), rotary position
embeddings, grouped-query attention and the SwiGLU feed-forward, in plain PyTorch.

``loom.models.llama`` assembles them into blocks and the model, and ``loom.models.moe`` builds
its experts on ``FeedForward``; both import this module, so neither imports the other's
internals (the MoE layer used to import the model's module that imported it back). The seams
for parallelism are described in ``loom.models.llama``.

Model families (``loom.models.hf`` converts each to and from its Hugging Face twin): the defaults
are Llama (2 and, with ``rope_scaling = "llama3"``, 3.x); ``qkv_bias`` adds Qwen2's biases on the
q/k/v projections; ``qk_norm`` adds Qwen3's RMSNorm of each query and key head (over Hd, before
RoPE); ``sliding_window`` restricts each query to the last W keys, as Mistral does;
``head_dim_override`` decouples Hd from D / N (Qwen3, Mistral Nemo). RoPE is ``loom.models.rope``.

Shape legend: B batch, S sequence, D model dim, N query heads, K key/value heads, Hd head dim,
F MLP hidden dim, V vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.rope import RopeScaling, apply_rope, rope_tables

if TYPE_CHECKING:  # document_attention builds on sdpa_causal, so it imports this module
    from loom.models.document_attention import DocumentMask

__all__ = ["Attention", "FeedForward", "TransformerArgs", "apply_rope", "rope_tables",
           "rope_tables_for", "sdpa_causal"]


@dataclass
class TransformerArgs:
    """Shape of a decoder. ``ffn_dim`` is the SwiGLU hidden size (three D x F matrices).

    Mixture of experts (``loom.models.moe``; ``n_experts=0`` is a dense model): ``n_experts``
    routed SwiGLU experts of hidden size ``expert_ffn_dim`` (0: ``ffn_dim``), ``top_k`` per token
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
    ffn_dim: int = 768  # SwiGLU hidden size of the dense MLP
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

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    @property
    def rope(self) -> RopeScaling:
        """The RoPE frequency schedule the ``rope_scaling*`` fields describe."""
        return RopeScaling(self.rope_scaling, self.rope_scaling_factor,
                           self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor,
                           self.rope_scaling_original_max_len)

    def moe_layer(self, layer_id: int) -> bool:
        """Whether global layer ``layer_id`` has a mixture-of-experts feed-forward."""
        return (self.n_experts > 0 and layer_id >= self.n_dense_layers
                and (layer_id + 1) % self.moe_every == 0)


def sdpa_causal(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
                window: int = 0) -> torch.Tensor:
    """Causal attention on one device; each of the K key/value heads serves N/K query heads.

    ``window`` W > 0 (sliding-window attention) lets query i see keys i-W+1 .. i only, the mask
    of HF's Mistral (``kv_idx > q_idx - sliding_window``). A window at least as long as the
    sequence is plain causal attention, which then takes the unmasked ``is_causal`` kernel.
    """
    group = q_BNSH.shape[1] // k_BKSH.shape[1]  # query heads per key/value head
    k_BNSH = k_BKSH.repeat_interleave(group, dim=1)
    v_BNSH = v_BKSH.repeat_interleave(group, dim=1)
    S = q_BNSH.shape[2]
    if 0 < window < S:
        i = torch.arange(S, device=q_BNSH.device)[:, None]
        j = torch.arange(S, device=q_BNSH.device)[None, :]
        allowed_SS = (j <= i) & (j > i - window)
        return F.scaled_dot_product_attention(q_BNSH, k_BNSH, v_BNSH, attn_mask=allowed_SS)
    return F.scaled_dot_product_attention(q_BNSH, k_BNSH, v_BNSH, is_causal=True)


def rope_tables_for(args: TransformerArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE cos/sin tables of a model: its head dim, length, base and scaling."""
    return rope_tables(args.head_dim, args.max_seq_len, args.rope_theta, args.rope)


class Attention(nn.Module):
    """Grouped-query self-attention. Head counts are inferred from weight shapes at run time.

    Optional, per ``TransformerArgs``: biases on q/k/v (``qkv_bias``), an RMSNorm over each query
    and key head before RoPE (``qk_norm``; one weight of Hd elements shared by all heads), and a
    sliding window in the core (``sliding_window``). With ``documents`` (packed rows), attention
    stays inside each document (``loom.models.document_attention``) instead of ``core``, unless
    the core says it ``takes_documents`` (context parallelism): then it gets them.
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        bias = args.qkv_bias
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
            self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # The seam for context parallelism: any callable with sdpa_causal's signature
        # (queries [B, N, S, Hd], un-repeated keys/values [B, K, S, Hd], causal over S).
        self.core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
            functools.partial(sdpa_causal, window=args.sliding_window) if args.sliding_window
            else sdpa_causal)
        self.sliding_window = args.sliding_window
        # Document-masked attention is local: it refuses a core swapped from outside.
        self._local_core = self.core

    def forward(self, x_BSD: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor,
                documents: DocumentMask | None = None) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None:  # Qwen3: normalise each head's vector, then rotate it
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos_SH, sin_SH), apply_rope(k, cos_SH, sin_SH)
        # Key/value heads go to the core un-repeated (GQA): context parallelism then moves K heads.
        if documents is None:
            out_BNSH = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        elif getattr(self.core, "takes_documents", False):  # a cp core: its own document path
            out_BNSH = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 documents=documents)
        else:
            if self.core is not self._local_core:
                raise ValueError("document-masked attention (document_ids) runs on one device"
                                 " only; this layer's attention core was replaced from outside"
                                 " (a context-parallel core without a document path)")
            out_BNSH = documents.attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), self.sliding_window)
        return self.wo(out_BNSH.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))
