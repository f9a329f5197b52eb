"""What a mixture-of-experts layer's routed experts cost beyond a dense MLP, for the planner's
cost model (``CostModel._layer_times``): their FLOPs, the elements FP8 casts where a stack
converts them, the share of the rows each expert's GEMM gets, and the tokens' moves into
expert order and back.

* **FLOPs**: each token's top_k assignments pass through an expert of the dense MLP's kind
  (3 matrices SwiGLU, 2 GELU), its width split by tp.
* **Rows per expert**: under balanced routing a rank's E / ep experts take the top_k
  assignments of the tokens every ep rank sends it, so each expert's GEMM has
  rows x top_k x ep / E rows, which sets its efficiency (``Gpu.matmul_rate``).
* **FP8 casts** (``Framework.fp8_experts``): each assignment's input to w1 (and SwiGLU's w3),
  D elements each, and to w2, F_e.
* **Token moves** (``permute_passes``): the dispatch copies each token's row top_k times into
  expert order; with ep > 1 the received rows are copied into the order of the rank's own
  experts and the experts' outputs back into arrival order for the combine's all-to-all
  (Megatron's permute and its two chunk sorts; Loom's gather and ``loom.parallel.expert``'s
  ``x_in[order]`` and ``y[argsort(order)]``), each copy a read and a write of top_k rows per
  token; the combine reads the top_k weighted rows and writes one. The backward moves the
  gradients back the same way: twice the forward's traffic, as every element-wise pass.

Its own module because the experts are a concept of their own beside the block's dense
pricing; torch-free, communicates nothing.
"""

from __future__ import annotations

from loom.models.args import TransformerArgs


def routed_flops(model: TransformerArgs, tokens: float, tp: int) -> float:
    """Forward FLOPs of one MoE layer's routed experts on one rank."""
    width = model.expert_ffn_dim or model.ffn_dim
    return 2 * model.mlp_matrices * tokens * model.top_k * model.dim * width / tp


def rows_per_expert(model: TransformerArgs, rows: float, ep: int) -> float:
    """Rows of each routed expert's GEMM when the layer runs ``rows`` tokens, balanced."""
    return rows * model.top_k * ep / model.n_experts


def routed_cast_elements(model: TransformerArgs, tokens: float, tp: int) -> float:
    """Elements the routed experts' linears cast to FP8 per pass where the stack converts
    them."""
    width = model.expert_ffn_dim or model.ffn_dim
    return tokens * model.top_k * ((model.mlp_matrices - 1) * model.dim + width) / tp


def permute_passes(top_k: int, ep: int) -> int:
    """Reads and writes of T·h elements an MoE layer's forward spends moving tokens."""
    copies = 3 if ep > 1 else 1
    return top_k * (2 * copies + 1) + 1


__all__ = ["permute_passes", "routed_cast_elements", "routed_flops", "rows_per_expert"]
