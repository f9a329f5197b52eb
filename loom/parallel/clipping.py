"""Gradient clipping's scale, applied to the gradients each rank holds.

Every layout clips the same way: torch's factor ``min(max_norm / (norm + 1e-6), 1)`` for the
global norm, multiplied into the gradient each rank holds (a DTensor's local shard, an
expert's own slice, a plain tensor). The layouts differ only in how they sum the norm's
squares (``tensor.grad_squares``, ``expert.grad_squares``, ``loom.train.optim``'s FSDP2 and
plain paths); this module is the one scaling they all run, so the synchronous step and the
post-validated one (``loom.train.post_validation``) scale with the same arithmetic. torch's own
``clip_grads_with_norm_`` does this for plain tensors (``optim.clip_to_norm`` uses it there);
on DTensors it would multiply through DTensor dispatch, so the local shards are scaled here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clipping factor min(max_norm / (norm + 1e-6), 1): the gradients are scaled by it.
    Exactly 1 means clipping leaves every gradient bit unchanged (x * 1.0 == x)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def scale_local_gradients(parameters: Iterable[nn.Parameter], max_norm: float,
                          norm: torch.Tensor) -> None:
    """Scale the local tensor of every gradient of ``parameters`` (in place) by
    ``clip_coefficient(norm, max_norm)``; ``max_norm`` 0: leave them."""
    local = [grad.to_local() if isinstance(grad, DTensor) else grad
             for grad in (p.grad for p in parameters) if grad is not None]
    if max_norm > 0 and local:
        torch._foreach_mul_(local, clip_coefficient(norm, max_norm).to(local[0].device))
