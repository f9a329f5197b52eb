"""What FP8 training costs the planner's cost model (``CostModel._layer_times``): which FLOPs of
a layer run at the accelerator's FP8 peak, how many elements each pass casts to FP8, and how
each recipe runs the weight gradient.

* **Converted FLOPs** (``converted_share``): Loom converts the attention projections and the
  dense or shared-expert MLP (``loom.parallel.fp8.converts``), not the attention core, the
  router or the routed experts (a stack's own routed experts: ``loom.sim.expert_cost``).
* **Casts**: each linear casts its own input (q, k and v each theirs) forward and its output
  gradient backward, about as many elements either way; a cast reads its tensor for the amax,
  reads it again and writes one byte (``cast_bytes``: unfused).
* **The weight gradient under each recipe** (``FP8_WEIGHT_GRADIENT``; torchao 0.18's, the
  version Loom trains with): whether its GEMM runs in FP8, and the casts it makes in units of a
  pass's casts, eager and compiled. torchao's backward (``matmul_with_hp_or_float8_args``)
  casts the output gradient for the input gradient, then the output gradient and the saved
  16-bit input again for the weight gradient: two more casts in eager. Compiled under
  tensorwise (one scale per tensor) the output gradient's second cast is the first
  (AOTAutograd's CSE merges them), the input's is not (it casts a reshaped view, another
  node): one, which the partitioner moves into the forward graph. Rowwise's two run along the
  other axis, compiled or not. Counted in the graphs ``torch.compile`` makes of a Float8Linear
  here (tests/unit/plan/test_fp8_compiled_casts.py). ``rowwise_with_gw_hp`` keeps the weight
  gradient in high precision from the saved inputs, uncast (``Float8LinearConfig
  .from_recipe_name``: both casts for it are ``ScalingType.DISABLED``). Rowwise is otherwise
  priced as tensorwise: its CUTLASS GEMM ran as fast as the cuBLAS tensorwise GEMM with a
  rescale after it (the workaround it replaced) in torchao's microbenchmark of Llama 70B's
  shapes (pytorch/ao#2185); the rescale's own cost is not priced. Transformer Engine's linears
  (Megatron) keep the forward's FP8 transposes for the weight gradient and would cast none; its
  rows are priced with torchao's counts.

Its own module because FP8 is a concept with its own source (torchao's code) beside the
block's 16-bit pricing; torch-free, communicates nothing.
"""

from __future__ import annotations

from typing import Any

from loom.layout import FP8_RECIPES
from loom.models.args import TransformerArgs

# recipe -> (the weight gradient's GEMM in FP8, its casts eager, its casts compiled)
FP8_WEIGHT_GRADIENT = {"tensorwise": (True, 2, 1), "rowwise": (True, 2, 2),
                       "rowwise_with_gw_hp": (False, 0, 0)}


def recipe_of(fp8: bool | str, gpu: Any, fp8_all_gather: bool = False) -> str:
    """The recipe ``fp8`` names (a name of ``FP8_RECIPES``, True for tensorwise, False for
    none), refused where ``gpu`` has no FP8 matmuls, or where FSDP2's float8 all-gather asks
    for another recipe than tensorwise (it casts each gathered weight with one scale:
    ``loom.parallel.fp8``)."""
    recipe = "tensorwise" if fp8 is True else "none" if fp8 is False else fp8
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 {fp8!r}: one of {', '.join(FP8_RECIPES)}, or a bool")
    if recipe != "none" and not gpu.fp8_flops:
        raise ValueError(f"{gpu.name} has no FP8 matmuls (fp8_flops = 0)")
    if fp8_all_gather and recipe != "tensorwise":
        raise ValueError(f"fp8_all_gather needs fp8 tensorwise (the gathered weights are the"
                         f" FP8 linears', one scale each), not {recipe!r}")
    return recipe


def converted_share(model: TransformerArgs, tokens: float, tp: int,
                    moe: bool) -> tuple[float, float]:
    """(the FLOPs of one layer's forward that run in FP8, the elements cast to FP8 per pass)
    on one rank of ``tp`` (the module docstring's counts)."""
    m = model
    proj = 2 * tokens * m.dim * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    width = m.expert_ffn_dim or m.ffn_dim
    matrices = m.mlp_matrices  # the shared experts are of the dense MLP's kind too
    mlp = 2 * matrices * tokens * m.dim * (width * m.n_shared_experts if moe else m.ffn_dim)
    ffn = width * m.n_shared_experts if moe else m.ffn_dim
    # each linear casts its own input: w1 (and SwiGLU's w3) D elements each, w2 F
    cast = tokens * (4 * m.dim + ((matrices - 1) * m.dim + ffn if ffn else 0))
    return (proj + mlp) / tp, cast / tp


def cast_bytes(elements: float, e: int) -> float:
    """Bytes ``elements`` cast to FP8 move with dynamic scaling from ``e``-byte values: read
    for the amax, read again and written as one byte (unfused; a compiler fuses some of it,
    not priced)."""
    return elements * (2 * e + 1)


def weight_gradient(recipe: str, compiled: bool) -> tuple[bool, int]:
    """(whether the weight gradient's GEMM runs in FP8, the passes of casts it makes) under
    ``recipe`` in an eager or a compiled stack (``FP8_WEIGHT_GRADIENT``)."""
    in_fp8, eager, compiled_casts = FP8_WEIGHT_GRADIENT[recipe]
    return in_fp8, compiled_casts if compiled else eager


__all__ = ["FP8_WEIGHT_GRADIENT", "cast_bytes", "converted_share", "recipe_of",
           "weight_gradient"]
