"""Named model shapes, from a CPU-sized ``tiny`` to the published 405B and 1T shapes.

The large presets exist for planning and simulation (parameter, FLOP and memory formulas); they are
never instantiated on this machine. Published shapes:

* Llama 3 8B / 70B / 405B: Llama 3 paper, Table 3 (dims, layers, heads, 8 KV heads, FFN sizes,
  vocabulary 128,256, RoPE theta 500,000).
* GPT-3 175B: Brown et al. 2020, Table 2.1 (h = 12,288, 96 layers, 96 heads, context 2,048,
  vocabulary 50,257 padded to 51,200 as Megatron does), with GPT's own MLP: GELU over
  F = 4h = 49,152 (``mlp = "gelu"``, two h x F matrices, 8h^2 parameters). Until 26 Nov 2026
  this preset stood in a SwiGLU MLP of F = 8h/3 (the same parameters and FLOPs, but not the
  same activations or GEMM shapes).
* GPT 1T: the largest configuration of Narayanan et al. 2021, Table 1 (h = 25,600, 128 layers,
  160 heads), GELU over F = 4h = 102,400 (eq. 2's shape).
* Mixtral 8x7B: Jiang et al. 2024 ("Mixtral of Experts"), Table 1 (dim 4,096, 32 layers, 32
  heads, 8 KV heads, 8 experts top-2 of hidden 14,336, vocabulary 32,000, context 32,768, RoPE
  theta 1e6). 46.7B parameters, 12.9B active per token.
* DeepSeekMoE 16B: Dai et al. 2024 (arXiv 2401.06066) §5 and the released ``config.json`` of
  deepseek-moe-16b-base (hidden 2,048, 28 layers, 16 heads without GQA, vocabulary 102,400, first
  layer dense with FFN 10,944, then 64 routed experts top-6 plus 2 shared experts of hidden 1,408,
  top-k weights not renormalised). 16.4B parameters, 2.8B active.
"""

from __future__ import annotations

import dataclasses

from loom.models.args import TransformerArgs

PRESETS: dict[str, TransformerArgs] = {
    # A few million parameters: trains visibly on two CPU cores in minutes.
    "tiny": TransformerArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768,
                            vocab_size=320, max_seq_len=1024),
    # Smallest shape that still has every feature (GQA, >1 layer): for parity tests.
    "debug": TransformerArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
                             vocab_size=320, max_seq_len=256),
    "llama3-8b": TransformerArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                                 vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": TransformerArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                                  vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": TransformerArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                   ffn_dim=53248, vocab_size=128256, max_seq_len=8192,
                                   rope_theta=500000.0),
    "gpt3-175b": TransformerArgs(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_dim=49152,
                                 vocab_size=51200, max_seq_len=2048, tie_embeddings=True,
                                 mlp="gelu"),
    "gpt-1t": TransformerArgs(dim=25600, n_layers=128, n_heads=160, n_kv_heads=160,
                              ffn_dim=102400, vocab_size=51200, max_seq_len=2048,
                              tie_embeddings=True, mlp="gelu"),
    # Mixture of experts, every feature on (shared expert, a dense first layer): tests and CPU.
    "tiny-moe": TransformerArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128,
                                vocab_size=320, max_seq_len=256, n_experts=4, top_k=2,
                                expert_ffn_dim=64, n_shared_experts=1, n_dense_layers=1),
    "mixtral-8x7b": TransformerArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                    ffn_dim=14336, vocab_size=32000, max_seq_len=32768,
                                    rope_theta=1e6, n_experts=8, top_k=2, expert_ffn_dim=14336),
    "deepseek-moe-16b": TransformerArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=16,
                                        ffn_dim=10944, vocab_size=102400, max_seq_len=4096,
                                        n_experts=64, top_k=6, expert_ffn_dim=1408,
                                        n_shared_experts=2, n_dense_layers=1,
                                        renormalize_top_k=False, aux_loss_coef=0.001),
}


def preset(name: str) -> TransformerArgs:
    """A fresh copy of the named preset; ``KeyError`` lists the known names."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


def layer_parameter_count(args: TransformerArgs, layer_id: int, *, active: bool = False) -> int:
    """Parameters of global layer ``layer_id`` (``active``: those one token uses, which is also
    its matmul multiply-adds per token, attention scores aside).

    Attention D*(N*Hd) + 2*D*(K*Hd) + (N*Hd)*D and two norms 2*D, with ``qkv_bias`` the biases
    N*Hd + 2*K*Hd and with ``qk_norm`` two Hd-sized norms, plus the feed-forward: dense 3*D*F
    (SwiGLU) or 2*D*F (GELU, ``mlp_matrices``); MoE
    a router D*E and c*D*F_e per routed expert (E of them, or top_k when ``active``) and per
    shared expert, with the dense MLP's c (the experts are of its kind: 3 SwiGLU, 2 GELU).
    """
    q_width = args.n_heads * args.head_dim
    kv_width = args.n_kv_heads * args.head_dim
    count = 2 * args.dim * q_width + 2 * args.dim * kv_width + 2 * args.dim
    count += (q_width + 2 * kv_width if args.qkv_bias else 0) + (2 * args.head_dim
                                                                 if args.qk_norm else 0)
    if not args.moe_layer(layer_id):
        return count + args.mlp_matrices * args.dim * args.ffn_dim
    routed = args.top_k if active else args.n_experts
    expert = args.mlp_matrices * args.dim * (args.expert_ffn_dim or args.ffn_dim)
    return count + args.dim * args.n_experts + (routed + args.n_shared_experts) * expert


def parameter_count(args: TransformerArgs, *, include_embedding: bool = True,
                    active: bool = False) -> int:
    """Exact number of parameters of ``Transformer(args)`` (``active``: those one token uses).

    The layers (``layer_parameter_count``), then the ends: the embedding V*D, the final norm D
    and the head V*D (counted once when tied).
    """
    total = sum(layer_parameter_count(args, i, active=active) for i in range(args.n_layers))
    total += args.dim
    head = args.vocab_size * args.dim
    total += head if args.tie_embeddings else 2 * head
    if not include_embedding:
        total -= head  # the embedding is a lookup, not a matmul
    return total


def active_parameter_count(args: TransformerArgs, *, include_embedding: bool = True) -> int:
    """Parameters one token passes through: ``top_k`` routed experts per MoE layer, not all E
    (Mixtral 8x7B: 12.9B of 46.7B). Equals ``parameter_count`` for a dense model."""
    return parameter_count(args, include_embedding=include_embedding, active=True)
