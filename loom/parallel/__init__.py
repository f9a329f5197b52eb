"""Applying parallelism to a plain model, from outside, in one documented order.

``parallelize`` is the only place where techniques are composed. The order (each step a short
``apply_x(model, its_submesh, its_knobs)`` in its own module) is the one TorchTitan settled on,
because each later wrapper must see the module the earlier ones produced:

1. tensor / sequence parallelism on ``tp``      (not yet in this version)
2. context parallelism on ``cp``                (not yet in this version)
3. expert parallelism on ``ep``                 (not yet in this version)
4. activation recomputation                     (not yet in this version)
5. data parallelism on ``dp`` (DDP; ZeRO/FSDP2 later), always last: it must wrap the final
   parameters and see every gradient.

Pipeline parallelism is applied before all of these by splitting the model into stages; each
stage is then parallelized by this function. Every step is the identity at degree 1.
"""

from __future__ import annotations

from torch import nn

from loom.parallel.data import apply_data_parallel, no_gradient_sync, unwrap
from loom.topology import Meshes

__all__ = ["parallelize", "no_gradient_sync", "unwrap"]


def parallelize(model: nn.Module, meshes: Meshes) -> nn.Module:
    """Apply every parallelism whose mesh axis has degree > 1, in the order above."""
    return apply_data_parallel(model, meshes.dp)
