"""The layers a Llama-style model is built from: its shape (``TransformerArgs``, kept torch-free
in ``loom.models.args`` for the planner), rotary position embeddings, grouped-query attention
and the SwiGLU (or GPT's GELU) feed-forward, in plain PyTorch.

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
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.args import TransformerArgs
from loom.models.rope import apply_rope, rope_tables
from loom.models.norm import RMSNorm

if TYPE_CHECKING:  # document_attention builds on sdpa_causal, so it imports this module
    from loom.models.document_attention import DocumentMask

__all__ = ["Attention", "FeedForward", "TransformerArgs", "apply_rope", "rope_tables",
           "rope_tables_for", "sdpa_causal"]


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
            self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps)
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
    """The dense MLP (``TransformerArgs.mlp``): SwiGLU w2(silu(w1 x) * w3 x), or GELU
    w2(gelu(w1 x)) with no ``w3`` (GPT-2/3 and Megatron's GPT, without their biases).

    GELU uses the tanh approximation: it is what GPT-2 was trained with (HF's ``gelu_new``) and
    what Megatron's fused bias-GELU kernel computes, so the published GPT runs this MLP stands
    for used it; it differs from the exact erf form by under 1e-3 and costs the same here.
    Saved for backward: SwiGLU's w1 and w3 outputs, silu's output and the product (four F-wide
    tensors); GELU's pre-activation and its output (two; ``loom.formulas.memory``).
    """

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.gated = args.mlp_matrices == 3  # refuses an unknown model.mlp by name
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        if self.gated:
            self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))
        return self.w2(F.gelu(self.w1(x_BSD), approximate="tanh"))
