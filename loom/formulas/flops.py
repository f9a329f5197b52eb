"""Model FLOPs per trained token: the one count the trainer's MFU and the planner both use.

Pure arithmetic over the architecture (no torch, no other Loom package). ``loom.train.flops``
divides it by the device's peak for MFU; the planner's cost model (``loom.sim.cost_model``)
multiplies it by the tokens of a step for the same numerator, so the two cannot disagree (they
did on MoE models, where the trainer counted every layer dense).
"""

from __future__ import annotations

from typing import Any


def training_flops_per_token(
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    ffn_dim: int,
    vocab_size: int,
    seq_len: int,
    causal: bool = True,
    halve_causal: bool = False,
    moe_layers: int = 0,
    n_experts: int = 0,
    top_k: int = 0,
    expert_ffn_dim: int = 0,
    n_shared_experts: int = 0,
    mlp_matrices: int = 3,
) -> float:
    """Model FLOPs to train on one token (forward + backward, no activation recompute).

    Counting rule: a matmul of (m x k) by (k x n) is m·k·n multiply-adds = 2·m·k·n FLOPs, and the
    backward of every matmul costs twice its forward (one matmul for the input gradient, one for
    the weight gradient), so training = 3 x forward. Only matmuls are counted; norms, softmax,
    activations, RoPE, the embedding lookup (a gather) and the optimizer are ignored, as in every
    published MFU convention. With h = dim, l = n_layers, H = n_heads, K = n_kv_heads,
    d = head_dim, f = ffn_dim, V = vocab_size, s = seq_len, the forward pass for one token is

        per layer   q:  2·h·(H·d)        k, v: 2 · 2·h·(K·d)   (grouped-query: K <= H)
                    o:  2·(H·d)·h        SwiGLU gate, up, down: 3 · 2·h·f
                                         (GELU: up, down: 2 · 2·h·f)
                    scores Q·Kᵀ and probs·V: 2 · 2·s·(H·d)
        head        2·h·V

    so, writing N = l·(2·h·H·d + 2·h·K·d + c·h·f) + h·V for the matmul parameter count (c =
    ``mlp_matrices``: 3 for SwiGLU, 2 for GELU; ``TransformerArgs.mlp_matrices``)
    (embedding excluded, head included even when tied, since the head matmul is executed),

        F_token = 6·N + 12·l·s·H·d                                           (x 1/2 on the
                                                                              attention term
                                                                              if halved)

    Relation to the published forms (tested in tests/unit/train/test_metrics.py):

    * PaLM (Chowdhery et al. 2022, App. B): 6N + 12·l·h·s. Identical when H·d = h.
    * Megatron (Korthikanti et al. 2022, eq. 7), model FLOPs per iteration of B sequences:
      72·B·s·l·h²·(1 + s/(6h) + V/(12·h·l)), i.e. per token 72·l·h² + 12·l·s·h + 6·h·V. That is
      the GPT case K = H, H·d = h, MLP of two h x 4h matrices (8h² weights per layer). Our
      SwiGLU has 3·h·f weights, which equals 8h² exactly when f = 8h/3; then 6N = 6·l·(4h² + 8h²)
      + 6·h·V and the two formulas agree term by term. A GELU MLP (``mlp = "gelu"``) with
      f = 4h is GPT's own: 2·h·4h = 8h², the same terms with no stand-in.
    * Megatron eq. 3 (Narayanan et al. 2021, 96·B·s·l·h²·...) includes the recompute forward; it
      is a *hardware* FLOP count, not model FLOPs, so it is deliberately not what we compute.

    Mixture of experts: ``moe_layers`` of the ``n_layers`` replace the MLP by a router (h x E,
    ``n_experts``) and the ``top_k`` routed plus ``n_shared_experts`` always-active experts a token
    passes through, each an MLP of the dense one's kind (c = ``mlp_matrices`` matrices: SwiGLU
    or GELU) of width ``expert_ffn_dim`` (0: ``ffn_dim``): the *active* parameters count,
    c·h·f_e·(top_k + shared) + h·E per MoE layer (Switch, DeepSeekMoE convention); experts a
    token skips are not model FLOPs.

    Causal mask: with a causal mask only about half of the s x s score matrix is needed, but
    PaLM and TorchTitan (``get_num_flop_per_token``) count the full 12·l·s·H·d and we follow them
    by default so our MFU is comparable with theirs. ``causal`` says whether the model's attention
    is causal; only with ``causal and halve_causal`` is the attention term halved (the FLOPs a
    mask-skipping kernel such as FlashAttention actually performs).
    """
    for name, value in (("dim", dim), ("n_layers", n_layers), ("n_heads", n_heads),
                        ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                        ("ffn_dim", ffn_dim), ("vocab_size", vocab_size), ("seq_len", seq_len)):
        if value <= 0:
            raise ValueError(f"training_flops_per_token: {name}={value} must be positive")
    if n_heads % n_kv_heads:
        raise ValueError(f"training_flops_per_token: n_kv_heads={n_kv_heads} must divide "
                         f"n_heads={n_heads} (grouped-query attention)")
    attn_proj = 2 * dim * n_heads * head_dim + 2 * dim * n_kv_heads * head_dim  # q+o, k+v
    if not 0 <= moe_layers <= n_layers:
        raise ValueError(f"training_flops_per_token: moe_layers={moe_layers} must be in"
                         f" [0, n_layers={n_layers}]")
    if mlp_matrices not in (2, 3):
        raise ValueError(f"training_flops_per_token: mlp_matrices={mlp_matrices} must be 3"
                         " (SwiGLU) or 2 (GELU)")
    mlp_params = mlp_matrices * dim * ffn_dim
    moe_mlp = (mlp_matrices * dim * (expert_ffn_dim or ffn_dim) * (top_k + n_shared_experts)
               + dim * n_experts)
    n_matmul_params = ((n_layers - moe_layers) * (attn_proj + mlp_params)
                       + moe_layers * (attn_proj + moe_mlp) + dim * vocab_size)
    attention = 12 * n_layers * seq_len * n_heads * head_dim
    if causal and halve_causal:
        attention /= 2
    return float(6 * n_matmul_params + attention)


def attended_keys(seq_len: int, window: int = 0) -> float:
    """The mean number of keys a query of a causal ``seq_len``-token sequence attends to: half
    the sequence (the convention of the causal-halved core, ``seq_len / 2``), or with a sliding
    window W < seq_len (Mistral's: query i sees keys i-W+1 .. i) the visible pairs
    ``W·S - W·(W-1)/2`` over the S queries. What a kernel that skips masked blocks computes,
    up to its block size; a window at least as long as the sequence changes nothing."""
    if not window or window >= seq_len:
        return seq_len / 2
    return (window * seq_len - window * (window - 1) / 2) / seq_len


def model_flops_per_token(args: Any, seq_len: int, *, halve_causal: bool = False) -> float:
    """``training_flops_per_token`` of a model shape (``loom.models.layers.TransformerArgs`` or
    anything with its fields and ``moe_layer(i)``), its MoE layers counted by their experts."""
    moe_layers = sum(1 for i in range(args.n_layers) if args.moe_layer(i))
    return training_flops_per_token(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim, ffn_dim=args.ffn_dim, vocab_size=args.vocab_size,
        seq_len=seq_len, halve_causal=halve_causal, moe_layers=moe_layers,
        n_experts=args.n_experts if moe_layers else 0, top_k=args.top_k if moe_layers else 0,
        expert_ffn_dim=args.expert_ffn_dim, n_shared_experts=args.n_shared_experts,
        mlp_matrices=getattr(args, "mlp_matrices", 3))
