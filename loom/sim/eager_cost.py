"""The element-wise traffic an eager block moves beyond a compiled one (``Framework.compiled``).

The cost model prices a block's element-wise work (norms, residual adds, RoPE, SwiGLU) as a
fixed number of activation-sized passes, what a stack with fused kernels moves (Megatron-LM's
fused norm, RoPE and bias-SwiGLU; ``torch.compile``'s inductor). Eager PyTorch runs every op
of Loom's block (``loom.models.llama``, ``layers``, ``norm``, ``rope``) as its own kernel, each
reading its inputs from and writing its output to HBM, and in fp32 where the block upcasts.
This module counts those kernels and their bytes per element, from the code, for bf16
activations (``e`` bytes; intermediates the code makes fp32 are 4), and prices what eager moves
beyond compiled at the HBM bandwidth. Nothing here is fitted to a measurement. A cast c moves
e + 4 bytes per element, none in fp32 (``.float()`` of an fp32 tensor is the tensor itself).

Per token, per element of the width it runs over (D the model dim, Q + KV the query and key
widths RoPE rotates, F the MLP width); forward, eager:

* each RMSNorm (``_RMSNormFunction``): upcast (c), square (8), mean (4), times rstd (8),
  times the weight (8), downcast (c): 28 + 2c, two per block;
* two residual adds, 3e each;
* RoPE on q and on k (``apply_rope``): upcast (c), four half-width products (4 each),
  a subtract and an add (6 each, over halves), the stack (8), downcast (c): 36 + 2c;
* SwiGLU: SiLU (2e), the gate product (3e): 5e (GELU, dense or experts: one kernel, 2e).

Compiled (inductor fuses each chain into one kernel; the matmuls stay cuBLAS calls, so nothing
fuses across them): the first norm 2e, the residual add fused with the second norm 4e, the last
residual add 3e, RoPE 2e, SiLU times the gate 3e (GELU 2e: as eager).

Backward, eager: each norm's hand-written backward (76 + 3c: two upcasts, a downcast, eight
fp32 products and differences, a mean and the weight's row sum), five gradient accumulations
on D (the residual stream twice, the inputs shared by wq/wk/wv and by w1/w3: two and one), 3e
each; RoPE's autograd (60 + 2c: the downcast's backward, a negation, four products, two
accumulations, the two halves scattered into zeroed fp32 tensors and summed, the upcast's
backward); SwiGLU's three kernels (9e). Compiled: each norm's backward with the accumulations
read in (about 9e per norm: x, the incoming gradients, dx, and the weight's reduction), RoPE
2e, SwiGLU one kernel reading the gradient and both inputs and writing two gradients (5e).

Eager minus compiled, per element: forward D 56 + 4c - 3e, Q + KV 36 + 2c - 2e, F 2e;
backward D 152 + 6c - 3e, Q + KV 60 + 2c - 2e, F 4e (bf16: 74, 44, 4; 182, 68, 8); a GELU
MLP's F 0 both ways (its backward one kernel, eager or compiled).

An eager stack with a norm kernel (``Framework.fused_norm``: Aleph Alpha's Scaling with
flash-attn's fused RMSNorm, the sweep's "+ RMS kernel" cells) runs each norm as one kernel each
way: forward it reads x and writes y (2e), backward it reads x and the incoming gradient and
writes dx (3e, the weight's row sum read in the same pass), beside the five eager gradient
accumulations (15e). Its D-wide eager traffic is then 2·2e + 6e = 10e forward and 2·3e + 15e =
21e backward, e and 3e beyond compiled: the norms' eager ops (56 + 4c - 4e forward, 152 + 6c -
6e backward) are what the kernel saves. The host time of launching
these kernels is ``loom.sim.launch_cost``'s (the same counts, pinned to the dispatcher's).
FP8's casts (``loom.sim.fp8_cost``) are priced the same either way.
Torch-free.
"""

from __future__ import annotations

from loom.models.args import TransformerArgs


def eager_extra_bytes(model: TransformerArgs, tokens: float, tp: int, sequence_parallel: bool,
                      moe: bool, e: int, norm_kernel: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes one rank's layer pass over ``tokens`` tokens moves in eager
    mode beyond a compiled block (the module docstring's counts). The D-wide work is split by
    ``tp`` under sequence parallelism only (replicated otherwise); RoPE's and the MLP's run
    over the rank's heads and MLP columns, split by ``tp`` always; an MoE layer's SwiGLU runs
    over its ``top_k`` routed and its shared experts' columns for every token. A GELU MLP, dense
    or experts (the experts are of the dense MLP's kind), is one eager kernel each way, as
    compiled, so it moves nothing more. ``norm_kernel``: each RMSNorm one kernel each way
    (an eager stack with a norm kernel), its eager ops left out."""
    d = model.dim / (tp if sequence_parallel and tp > 1 else 1)
    heads = model.head_dim * (model.n_heads + model.n_kv_heads) / tp
    if model.mlp_matrices != 3:  # GELU
        ffn = 0.0
    elif moe:
        width = model.expert_ffn_dim or model.ffn_dim
        ffn = width * (model.top_k + model.n_shared_experts) / tp
    else:
        ffn = model.ffn_dim / tp
    c = 0 if e == 4 else e + 4  # one cast to or from fp32
    d_forward, d_backward = (e, 3 * e) if norm_kernel \
        else (56 + 4 * c - 3 * e, 152 + 6 * c - 3 * e)
    forward = d * d_forward + heads * (36 + 2 * c - 2 * e) + ffn * 2 * e
    backward = d * d_backward + heads * (60 + 2 * c - 2 * e) + ffn * 4 * e
    return tokens * forward, tokens * backward


__all__ = ["eager_extra_bytes"]
