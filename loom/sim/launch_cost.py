"""The kernels one layer pass of Loom's block launches, and the host time that queues them.

A GPU runs what its host queues: eager PyTorch dispatches each op from Python through the
dispatcher (and autograd, forward) to one ``cudaLaunchKernel``, so every kernel costs the host a
fixed time (``Gpu.launch_overhead``) however small its tensors. The host runs ahead of the
device, whose queue absorbs the difference, so a layer pass takes the longer of the two:
``max(device time, kernels x launch_overhead)`` (``host_bound``). A pass of long kernels (matmuls
over thousands of tokens) is unchanged; a pass of short ones becomes host-bound. Per pass, not
per kernel: a pass's matmuls let the host build a lead that its short element-wise kernels use
up, and one pass follows another with no synchronisation between them (the step's ``.item()``
and the optimizer are outside the layer passes), so summing the per-pass maxima is the
queue's behaviour to within one pass's short kernels.

Kernels are ops the dispatcher runs that produce a tensor and are not views (``_unsafe_view``
and the reshapes move nothing); counted from the code, and pinned to the dispatcher's own count
of Loom's ``TransformerBlock`` forward and backward (``tests/unit/plan/test_launch_cost.py``).
Forward of the dense SwiGLU block with fp32 activations (``e = 4``): each RMSNorm pow, mean, add
eps, rsqrt, two products (6, two norms); the q, k, v, o projections and w1, w2, w3 (7 mm); RoPE
on q and on k: four products, a subtract, an add, a stack each (14); the two contiguous copies
ahead of attention and the attention kernel (3); SiLU and the gate product (2); two residual
adds (2): 12 + 7 + 14 + 3 + 2 + 2 = 40. bf16 activations add the casts
to and from fp32 around each norm and RoPE (8). Backward: 64, bf16 76 (12 casts), of which the
weight gradients (W under a split backward: the 7 weight matmuls and the two norm weights' row
sums) are 9. GELU's MLP: 38 / 59 (fp32), one weight matmul fewer. An MoE block loops over its
rank's experts (``loom.models.moe``: no grouped GEMM), each of the dense MLP's kind: a SwiGLU
expert 5 kernels forward, 16 backward (3 of them weight matmuls), the shared experts one wider
SwiGLU (6 and 11); a GELU expert 3 and 9 (2 weight matmuls), the shared GELU 4 and 6; and the
router. Each stacked expert weight's gradient sums its experts' slices (E - 1 adds, counted as
one per expert less one), so GELU's two stacked weights leave one more kernel in the base.

Compiled (``torch.compile`` of each block, inductor's default mode, no CUDA graphs): the matmuls
and the attention stay separate kernels (cuBLAS, flash), and each element-wise chain between them
becomes one fused kernel, as ``eager_cost`` assumes for its bytes: forward the first norm, RoPE,
the residual add with the second norm, SiLU times the gate (GELU: the GELU), the last residual
add (5), backward SwiGLU's (GELU's), RoPE's and the two norms' backward chains with their
accumulations (4); an MoE block one chain each way per expert (and for the shared experts).
The same per-kernel host time is charged (inductor's generated wrapper calls its launchers
without the dispatcher or autograd, so that over-prices compiled host time; a compiled pass is
far from host-bound anyway). Under CUDA graphs the host launches one graph per step: not priced
here.

Not counted: the collectives and DTensor redistributions of tensor, context or expert
parallelism (their own ops), the embedding, final norm, output head and loss (one pass per
microbatch, long kernels over the vocabulary), and the optimizer (fused AdamW launches one
multi-tensor kernel per 320 chunks of 65,536 elements, each over ~21M elements: device-bound).
Torch-free.
"""

from __future__ import annotations

from loom.models.args import TransformerArgs

# Dense block, fp32 activations: (forward, backward, weight-gradient share of backward)
SWIGLU_KERNELS = (40, 64, 9)
GELU_KERNELS = (38, 59, 8)
# bf16 (or any non-fp32) activations: casts to and from fp32 around the norms and RoPE
CASTS = (8, 12)
# MoE block with no experts: attention, norms, router and the routing bookkeeping (fp32), its
# casts, and per local expert / for the shared experts (forward, backward, weight matmuls), for
# SwiGLU experts and for GELU experts (the dense MLP's kind: ``TransformerArgs.mlp``)
MOE_BASE_KERNELS = (65, 72, 7)  # weight share: 4 projections, 2 norm weights, the router
MOE_CASTS = (10, 14)
MOE_PER_EXPERT = (5, 16, 3)
MOE_SHARED = (6, 11, 3)
GELU_MOE_BASE_KERNELS = (65, 73, 7)  # one stacked weight fewer: its E - 1 gradient adds' "- 1"
GELU_MOE_PER_EXPERT = (3, 9, 2)
GELU_MOE_SHARED = (4, 6, 2)
# Compiled: per matmul one kernel, the attention one each way, fused element-wise chains
COMPILED_FUSED = (5, 4)


def block_kernels(model: TransformerArgs, moe: bool, compiled: bool, e: int,
                  ep: int = 1, grouped: bool = False) -> tuple[int, int, int]:
    """(F, I, W) kernels one rank's pass of one block launches (the module docstring's counts):
    eager or compiled, with ``e``-byte activations; an MoE block runs its ``n_experts / ep``
    local experts, of the dense MLP's kind, one after another, or all at once as one grouped
    GEMM per matrix (``grouped``: counted as one expert). I and W split the backward as a split
    backward runs it (W the weight gradients); their sum is the whole backward's."""
    swiglu = model.mlp_matrices == 3
    if moe:
        experts = 1 if grouped else max(1, model.n_experts // ep)
        shared = 1 if model.n_shared_experts else 0
        if compiled:  # 4 projections, the router, each expert's and the shared experts' own
            matmuls = 5 + model.mlp_matrices * experts + model.mlp_matrices * shared
            fused = COMPILED_FUSED[0] + experts + shared, COMPILED_FUSED[1] + experts + shared
            return matmuls + 1 + fused[0], matmuls + 1 + fused[1], matmuls
        base, per_expert, per_shared = ((MOE_BASE_KERNELS, MOE_PER_EXPERT, MOE_SHARED) if swiglu
                                        else (GELU_MOE_BASE_KERNELS, GELU_MOE_PER_EXPERT,
                                              GELU_MOE_SHARED))
        cast = (0, 0) if e == 4 else MOE_CASTS
        f = base[0] + cast[0] + per_expert[0] * experts + per_shared[0] * shared
        b = (base[1] + cast[1] + per_expert[1] * experts
             + per_shared[1] * shared + (1 if model.top_k > 1 else 0))
        w = base[2] + per_expert[2] * experts + per_shared[2] * shared
        return f, b - w, w
    if compiled:
        matmuls = 4 + model.mlp_matrices
        return matmuls + 1 + COMPILED_FUSED[0], matmuls + 1 + COMPILED_FUSED[1], matmuls
    f, b, w = SWIGLU_KERNELS if swiglu else GELU_KERNELS
    if e != 4:
        f, b = f + CASTS[0], b + CASTS[1]
    return f, b - w, w


def host_bound(device: float, kernels: int, launch_overhead: float) -> float:
    """Seconds of a pass whose device work takes ``device`` seconds and whose ``kernels`` cost
    the host ``launch_overhead`` each: the host queues ahead, so the longer of the two."""
    return max(device, kernels * launch_overhead)


__all__ = ["block_kernels", "host_bound"]
