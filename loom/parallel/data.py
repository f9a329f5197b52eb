"""Data parallelism over the flattened ``dp`` mesh axis (dp_replicate x dp_shard x ep).

Forward: nothing. Backward: one all-reduce (average) of every gradient over the ``dp`` group,
``2 * (d-1)/d * P`` elements per rank per step for ``P`` parameters with a ring algorithm, bucketed
(25 MB buckets) and started by autograd hooks as soon as a bucket's gradients are ready, so it
overlaps the rest of the backward pass. Degree 1: the module is returned untouched.

Engine: torch's ``DistributedDataParallel``. It already does exactly what we need — bucketing,
overlap with backward, ``no_sync`` for gradient accumulation, a fp32 reduction of fp32 gradients
under bf16 autocast — and is maintained by the people who maintain the collectives, so Loom does
not rewrite it. Sharded data parallelism (ZeRO / FSDP2) will live beside it in this module.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import ContextManager

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """Wrap ``model`` for gradient all-reduce over ``dp_mesh`` (1-D); identity at degree 1."""
    if dp_mesh.size() == 1:
        return model
    device = next(model.parameters()).device
    with warnings.catch_warnings():
        # torch 2.13 deprecates broadcast_buffers in favour of forward_sync_buffers, whose False
        # still syncs at init; we want no buffer traffic at all, which only this flag gives today.
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(
            model,
            process_group=dp_mesh.get_group(),
            device_ids=[device] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            broadcast_buffers=False,  # RoPE tables are rebuilt identically on every rank
            init_sync=False,  # weights are already identical: seeded per parameter name
        )


def no_gradient_sync(model: nn.Module) -> ContextManager:
    """Skip the all-reduce for all but the last microbatch of a gradient-accumulation step."""
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model under any data-parallel wrapper (for names, saving and generation)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
