"""Fill a parallelized model's parameters from pretrained weights, each rank its own shard.

Called after ``parallelize`` (and after the pipeline split), so every parameter already has the
shape and placement it trains with; for each one this rank reads exactly the region it holds:

* a DTensor (tensor parallelism, ZeRO-3's FSDP2, or both): the local shard's offsets and shape
  from its mesh and placements (``compute_local_shape_and_global_offset``, what DCP uses);
* an expert weight under expert parallelism: this ep rank's experts, rows
  ``[rank E/ep, (rank + 1) E/ep)`` of dim 0 (before any TP split of them);
* the embedding's and the head's rows under vocabulary parallelism across the pipeline
  (``loom.parallel.vocab_pipeline.VocabRows``): this pipeline rank's rows ``[start, start + V/p)``;
* anything else (replicated parameters, ZeRO-1/2's views into their flat buckets): the whole
  tensor.

ZeRO-3 over tensor parallelism shards dim 0 twice (FSDP2's ``_StridedShard``: it chunks each
TP shard again), so the local rows are not one region of the full tensor: those ranks read their
TP shard and chunk it as FSDP2 does.

A pipeline rank only visits the parameters of its own stages. The values go in with ``copy_`` on
the local tensor, so views (ZeRO-1/2's buckets) and tied parameters stay what they are.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from loom.models.pretrained import PretrainedSource
from loom.parallel.expert import ExpertParallel, expert_parameter_names
from loom.parallel.vocab_pipeline import row_slices


@torch.no_grad()
def load_local_shards(model: nn.Module, source: PretrainedSource,
                      experts: ExpertParallel | None = None) -> int:
    """Copy every parameter's local region of ``model`` (global names) from ``source``;
    returns how many parameters were written. Raises ``PretrainedError`` for a name or region
    the source does not hold."""
    expert_names = expert_parameter_names(model) if experts is not None else set()
    vocab_rows = row_slices(model)  # name -> (first row, rows) of a vocabulary shard's rows
    written = 0
    for name, param in model.named_parameters():  # a tied weight is yielded once
        if isinstance(param, DTensor) and _strided(param):
            # ZeRO-3 over TP: FSDP2 chunks this rank's TP shard again along the same dim, so the
            # local rows are not one region of the full tensor: read the TP shard, chunk locally.
            local = param.to_local()
            outer = [Replicate() if isinstance(p, _StridedShard) else p for p in param.placements]
            shape, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                   outer)
            if name in expert_names:
                offsets = (offsets[0] + experts.rank * _experts_of(param), *offsets[1:])
            if name in vocab_rows:  # this pipeline rank's rows of the vocabulary
                offsets = (offsets[0] + vocab_rows[name][0], *offsets[1:])
            region = source.read(name, tuple(offsets), tuple(shape))
            for mesh_dim, placement in enumerate(param.placements):
                if isinstance(placement, _StridedShard):
                    pieces = region.chunk(param.device_mesh.size(mesh_dim), dim=placement.dim)
                    index = param.device_mesh.get_local_rank(mesh_dim)
                    region = pieces[index] if index < len(pieces) else region[:0]
            if local.numel():
                local.copy_(region.to(local.dtype))
            written += 1
            continue
        if isinstance(param, DTensor):
            shape, offsets = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements)
            local = param.to_local()
        else:
            shape, offsets, local = tuple(param.shape), (0,) * param.ndim, param.data
        if name in expert_names:  # this ep rank's experts: its rows of the full stack
            offsets = (offsets[0] + experts.rank * _experts_of(param), *offsets[1:])
        if name in vocab_rows:  # this pipeline rank's rows of the vocabulary
            offsets = (offsets[0] + vocab_rows[name][0], *offsets[1:])
        if local.numel():  # FSDP2 leaves an empty shard on ranks past the end of a small dim
            local.copy_(source.read(name, tuple(offsets), tuple(shape)).to(local.dtype))
        written += 1
    return written


def _strided(param: DTensor) -> bool:
    return any(isinstance(p, _StridedShard) for p in param.placements)


def _experts_of(param: torch.Tensor) -> int:
    """Experts held by one ep rank: the global dim 0 of this rank's expert weight."""
    return param.shape[0]


__all__ = ["load_local_shards"]
