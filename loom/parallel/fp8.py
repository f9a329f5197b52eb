"""FP8 linear layers (``train.fp8``): the transformer blocks' matmuls in float8, through torchao.

Which layers: every ``nn.Linear`` inside the transformer blocks (attention's q, k, v, o and the
MLP's w1, w2, w3, the shared experts' too) whose two dimensions are multiples of 16 (what the
FP8 GEMM kernels take). Not converted, as TorchTitan and Megatron leave them: the embedding, the
output head (its logits feed the loss, where FP8's error shows most), the MoE router (its top-k
decisions are discontinuous in its scores), and the routed experts (grouped weights, not
``nn.Linear``). The parameters stay what they were (fp32, or bf16 under ``train.dtype = bf16``):
FP8 is a cast inside each matmul, forward and backward, so optimizers, ZeRO, checkpoints and
post-validation see the same tensors as without it, and a checkpoint moves freely between FP8
and non-FP8 runs.

Recipes (``train.fp8``, torchao's names): ``tensorwise`` (one dynamic scale per tensor: e4m3
inputs and weights, e5m2 gradients), ``rowwise`` (a scale per row, e4m3 throughout; more
accurate, slower) and ``rowwise_with_gw_hp`` (rowwise, the weight gradient's matmul in high
precision). Scales are recomputed from each tensor's amax at every matmul (dynamic scaling), so
a microbatch's FP8 result depends only on that microbatch: a data-parallel run equals one process
accumulating the same microbatches.

The device must have FP8 matmuls (CUDA compute capability 8.9 or more: L4/L40S, H100, H200,
B200); anywhere else ``loom train`` refuses ``train.fp8`` by name before launching, unless
``train.fp8_emulate`` asks torchao to emulate the FP8 matmuls in high precision with the same
scales and casts (what the tests on this CPU-only machine use; no faster than without FP8).

Context parallelism splits every sequence over ranks, so a scale over a whole tensor
(tensorwise) or over the tokens (rowwise's weight-gradient matmul, which contracts over them)
would see a rank's part only and results would change with cp; ``rowwise_with_gw_hp`` scales
per token or per weight row and keeps the weight gradient in high precision, so it is the recipe
allowed with cp > 1 (equal to one process, tests/dist/test_fp8_parity.py).

Tensor parallelism (and SP) keeps Loom's plain TP plan: the converted linears' weights become
DTensors, and ``Float8Linear`` computes its scales from DTensor amaxes, which reduce over the tp
mesh, so every recipe scales by the whole tensor as one process does (tests/dist/
test_fp8_parity.py, tp = 2 with and without SP). torchao's float8 styles
(``Float8ColwiseParallel``, ``PrepareFloat8ModuleInput``) would all-gather the SP input in float8
(half bf16's bytes on the wire); not taken: gloo cannot carry float8 tensors ("Invalid scalar
type"), so that path could not be proven against one process here.

FSDP2's float8 all-gather (``train.fp8_all_gather``; ZeRO-3, dp_shard > 1, ``tensorwise``
only): without it ZeRO-3 gathers each weight in the parameters' dtype and the gathered weight
is then cast to float8 inside the matmul. With it each rank casts its own shard to float8 with
the scale of the whole weight (the amax of every shard: an all-reduce) and the gather carries
the float8 bytes, 1 per element (half of bf16's, a quarter of fp32's); the gathered tensor is
the float8 weight the matmul takes. The scale is the one-process scale of the same weight, so
the float8 weight is the one cast after an fp32 gather, element for element: every step equals
ZeRO-3's without it (bit-identical, emulated on gloo, which carries FSDP2's packed byte buffer;
and with the H100's float8 GEMMs: tests/dist/test_fp8_parity.py, tests/gpu/test_gpu.py).
Measured, the debug model at dp_shard = 2, 3 steps: 9.9 MB gathered per rank in fp32 -> 4.0 MB,
4.9 MB in bf16 -> 3.0 MB (the embedding, head and norms still gather in their dtype). Not built
with tp > 1 or train.offload_optimizer (not proven here). ``precompute_all_gather_scales``
computes every weight's scale in one all-reduce of all the amaxes before every forward pass of
the trainer (a step's or an evaluation's) instead of one per weight at each gather (TorchTitan
does it after the optimizer step; before the forward it also covers weights changed between
steps by an outer step or a checkpoint load). Under ``train.dtype = bf16``
the shard is cast to float8 from its fp32 master instead of from the bf16 gathered copy: one
rounding instead of two. Only tensorwise: rowwise scales would need the gathered weight.

Why torchao and not hand-written: its ``Float8Linear`` is the kernel TorchTitan trains with
(scaling, the e4m3/e5m2 split, the autograd of the casts); Loom only chooses which layers convert
and where in ``parallelize``'s order (first: before any wrapper sees the module).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from loom.fp8_support import (FP8_CAPABILITY, device_refusal, missing_fp8_matmuls,
                              torchao_available)
from loom.layout import FP8_RECIPES

RECIPES = FP8_RECIPES  # torchao's names
KERNEL_MULTIPLE = 16  # both dimensions of an FP8 GEMM's operands


def converts(fqn: str, module: nn.Module) -> bool:
    """Whether ``module`` (named ``fqn`` in the model) runs its matmuls in FP8."""
    if not isinstance(module, nn.Linear) or not fqn.startswith("layers."):
        return False
    if fqn.rsplit(".", 1)[-1] == "router":
        return False
    return module.in_features % KERNEL_MULTIPLE == 0 and \
        module.out_features % KERNEL_MULTIPLE == 0


def apply_fp8(model: nn.Module, recipe: str, *, emulate: bool = False,
              fsdp_float8_all_gather: bool = False) -> int:
    """Convert ``model``'s eligible linear layers (``converts``) in place to torchao's
    ``Float8Linear`` with ``recipe``; returns how many were converted (0 for ``none``).
    ``fsdp_float8_all_gather``: their weights become torchao's float8-castable tensors, which
    FSDP2 (applied afterwards) gathers in float8 (``tensorwise`` only)."""
    if recipe == "none":
        return 0
    if recipe not in RECIPES:
        raise ValueError(f"train.fp8 = {recipe!r}: one of {', '.join(RECIPES)}")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(f"train.fp8_all_gather needs train.fp8 = tensorwise, not {recipe!r}")
    # torchao is an optional extra, imported only by runs that ask for FP8
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    chosen = {fqn for fqn, module in model.named_modules() if converts(fqn, module)}
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda module, fqn: fqn in chosen)
    return len(chosen)


def precompute_all_gather_scales(model: nn.Module) -> None:
    """Every float8-gathered weight's scale (``apply_fp8(..., fsdp_float8_all_gather=True)``
    under FSDP2) from its current sharded values, in one all-reduce of all their amaxes; call
    on every rank of the shard group, with the parameters sharded (between steps)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


__all__ = ["RECIPES", "FP8_CAPABILITY", "apply_fp8", "converts", "device_refusal",
           "missing_fp8_matmuls", "precompute_all_gather_scales",
           "torchao_available"]
