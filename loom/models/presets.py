"""Named model shapes, from a CPU-sized ``tiny`` to the published 405B and 1T shapes.

The large presets exist for planning and simulation (parameter, FLOP and memory formulas); they are
never instantiated on this machine. Published shapes:

* Llama 3 8B / 70B / 405B: Llama 3 paper, Table 3 (dims, layers, heads, 8 KV heads, FFN sizes,
  vocabulary 128,256, RoPE theta 500,000).
* GPT-3 175B: Brown et al. 2020, Table 2.1 (h = 12,288, 96 layers, 96 heads, context 2,048,
  vocabulary 50,257 padded to 51,200 as Megatron does). Loom's block is SwiGLU, so the MLP hidden
  size is F = 8h/3 = 32,768: three h x F matrices then hold 8h^2 parameters, the same as GPT-3's
  two h x 4h matrices, so parameter count and FLOPs match the published shape.
* GPT 1T: the largest configuration of Narayanan et al. 2021, Table 1 (h = 25,600, 128 layers,
  160 heads), MLP chosen the same way (F = 8h/3 rounded to a multiple of 256).
"""

from __future__ import annotations

import dataclasses

from loom.models.llama import TransformerArgs

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
    "gpt3-175b": TransformerArgs(dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_dim=32768,
                                 vocab_size=51200, max_seq_len=2048, tie_embeddings=True),
    "gpt-1t": TransformerArgs(dim=25600, n_layers=128, n_heads=160, n_kv_heads=160,
                              ffn_dim=68352, vocab_size=51200, max_seq_len=2048,
                              tie_embeddings=True),
}


def preset(name: str) -> TransformerArgs:
    """A fresh copy of the named preset; ``KeyError`` lists the known names."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name])


def parameter_count(args: TransformerArgs, *, include_embedding: bool = True) -> int:
    """Exact number of parameters of ``Transformer(args)``.

    Per layer: attention D*(N*Hd) + 2*D*(K*Hd) + (N*Hd)*D, MLP 3*D*F, two norms 2*D. Ends: the
    embedding V*D, the final norm D and the head V*D (counted once when tied).
    """
    q_width = args.n_heads * args.head_dim
    kv_width = args.n_kv_heads * args.head_dim
    per_layer = 2 * args.dim * q_width + 2 * args.dim * kv_width + 3 * args.dim * args.ffn_dim
    per_layer += 2 * args.dim
    total = args.n_layers * per_layer + args.dim
    head = args.vocab_size * args.dim
    total += head if args.tie_embeddings else 2 * head
    if not include_embedding:
        total -= head  # the embedding is a lookup, not a matmul
    return total
