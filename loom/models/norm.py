"""RMSNorm that saves its input and one scale per row for backward, not two full-size fp32 copies.

``torch.nn.RMSNorm`` (``F.rms_norm``) runs, where torch has no fused kernel for it (the CPU in
torch 2.13), as its decomposition: the input upcast to fp32, its normalised value and the
reciprocal RMS are all saved by autograd. For a bf16 block input that is two fp32 tensors of the
activation's size (4 times the input's bytes), and in fp32 twice the input: measured with
saved-tensor hooks (bench/activation_memory.py), the two norms of a layer held 1.05 MB of its
6.8 MB in bf16. Megatron's and Apex's fused RMSNorm keep only the input and the per-row scale
(rstd) and recompute the normalised value in backward; so does this one, with the same forward
arithmetic as ``F.rms_norm`` (fp32 throughout, the weight applied in fp32, the result cast back
to the input's dtype) and the analytic backward (in float64 for float64 inputs, as torch's):

    x̂ = x · rstd,   y = x̂ · w,   rstd = 1 / sqrt(mean(x²) + eps)
    dw = Σ_rows g · x̂,   dx = rstd · (g·w − x̂ · mean(g·w·x̂))

It is a subclass of ``nn.RMSNorm`` (same parameter, same state-dict key, same ``extra_repr``), so
checkpoints, Hugging Face interop and tensor parallelism's ``SequenceParallel`` style see the
module they expect; DTensor inputs go through the same arithmetic (a sequence-sharded input's
weight gradient comes out as a partial sum, as with the decomposition). Hand-written because
torch offers no RMSNorm that saves only (input, rstd) on every device.

Inside ``torch.compile`` (``train.compile``) the module runs ``F.rms_norm`` instead. Compiled
on CUDA (torch 2.11, an H100), this Function gave every norm weight a zero gradient and the
blocks' other weights gradients 16-88% off, with the forward exact (tests/gpu/test_gpu.py's
compiled-vs-eager test; the same run with ``F.rms_norm`` matched eager to 1e-4, and on the CPU
both match). There the Function is not needed: AOTAutograd's partitioner decides what a
compiled block saves, and recomputes the cheap element-wise values in backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for 16-bit inputs, the input's own dtype from fp32 up (``F.rms_norm``'s opmath)."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNormFunction(torch.autograd.Function):
    """``F.rms_norm`` over the last dimension, saving (input, weight, rstd)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(_compute_dtype(x))
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * weight).type_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normalised = x.to(rstd.dtype) * rstd
        g = grad.to(rstd.dtype)
        gw = g * weight
        dx = rstd * (gw - normalised * (gw * normalised).mean(-1, keepdim=True))
        dw = (g * normalised).sum(dim=tuple(range(g.dim() - 1)))
        return dx.type_as(x), dw.type_as(weight), None


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with an elementwise weight over the last dimension (what Loom's models
    use), keeping only its input and rstd for backward."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # see the module docstring: wrong gradients on CUDA
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


__all__ = ["RMSNorm"]
