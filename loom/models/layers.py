"""The layers a Llama-style model is built from: its shape (``TransformerArgs``), rotary position
embeddings, grouped-query attention and the SwiGLU feed-forward, in plain PyTorch.

``loom.models.llama`` assembles them into blocks and the model, and ``loom.models.moe`` builds
its experts on ``FeedForward``; both import this module, so neither imports the other's
internals (the MoE layer used to import the model's module that imported it back). The seams
for parallelism are described in ``loom.models.llama``.

Shape legend: B batch, S sequence, D model dim, N query heads, K key/value heads, Hd head dim,
F MLP hidden dim, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


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
    """

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    ffn_dim: int = 768
    vocab_size: int = 320
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    n_experts: int = 0
    top_k: int = 2
    expert_ffn_dim: int = 0
    n_shared_experts: int = 0
    capacity_factor: float = 0.0
    moe_every: int = 1
    n_dense_layers: int = 0
    renormalize_top_k: bool = True
    aux_loss_coef: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def moe_layer(self, layer_id: int) -> bool:
        """Whether global layer ``layer_id`` has a mixture-of-experts feed-forward."""
        return (self.n_experts > 0 and layer_id >= self.n_dense_layers
                and (layer_id + 1) % self.moe_every == 0)


def sdpa_causal(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor) -> torch.Tensor:
    """Causal attention on one device; each of the K key/value heads serves N/K query heads."""
    group = q_BNSH.shape[1] // k_BKSH.shape[1]  # query heads per key/value head
    k_BNSH = k_BKSH.repeat_interleave(group, dim=1)
    v_BNSH = v_BKSH.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q_BNSH, k_BNSH, v_BNSH, is_causal=True)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE angles, ``[max_seq_len, head_dim // 2]``, computed in fp64 then fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x_BSNH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... as Llama does (complex multiplication)."""
    x = x_BSNH.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x[..., 0], x[..., 1]
    cos, sin = cos_SH[None, :, None, :], sin_SH[None, :, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x_BSNH)


class Attention(nn.Module):
    """Grouped-query self-attention. Head counts are inferred from weight shapes at run time."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # The seam for context parallelism: any callable with sdpa_causal's signature
        # (queries [B, N, S, Hd], un-repeated keys/values [B, K, S, Hd], causal over S).
        self.core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = sdpa_causal

    def forward(self, x_BSD: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        q, k = apply_rope(q, cos_SH, sin_SH), apply_rope(k, cos_SH, sin_SH)
        # Key/value heads go to the core un-repeated (GQA): context parallelism then moves K heads.
        out_BNSH = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
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
