"""What a checkpoint holds: the model and optimizer state under the full model's names and full
shapes, whatever the layout, so that any layout loads what any other saved.

``training_state(model, optimizer)`` returns ``{"model": ..., "optim": ...}``: the model's
``state_dict`` by fully qualified name (FSDP and pipeline containers stripped) and the optimizer
state *flattened* (``state.<fqn>.exp_avg``, ``state.<fqn>.step``, ``param_groups.<fqn>.lr`` ...),
as ``torch.distributed.checkpoint.state_dict.get_state_dict`` writes it. Each value is one of:

* a plain tensor: the whole value, identical on every rank that holds it (DCP writes it once);
* a DTensor (tensor parallelism, FSDP2): DCP reads its placement;
* a ``ShardedTensor`` built here, for the three layouts whose local tensors do not say where
  they sit in the global one:

  - ZeRO-1/2 (``loom.parallel.zero``): rank r owns a contiguous range of a flat bucket, which
    covers parts of several parameters. A parameter's part of that range is a run of its
    row-major elements, cut here into at most ``2 ndim - 1`` boxes (partial row, whole rows,
    partial row, recursively), each a contiguous view of the flat moment, so the moments are
    saved and loaded in place in the parameter's own shape;
  - expert parallelism (``loom.parallel.expert``): ep rank r holds experts ``[r E/ep, (r+1)
    E/ep)`` under the global name, saved as that slice of the ``[E, ...]`` tensor. An expert
    weight that is also a DTensor (expert-TP) contributes its tp-local box within that slice.
  - vocabulary parallelism across the pipeline (``loom.parallel.vocab_pipeline``): pipeline
    rank r holds rows ``[rV/p, (r+1)V/p)`` of the embedding and the head (and their moments)
    under the full names, saved as that box of the ``[V, D]`` weight (``VocabRows`` records
    where; under tp each tp rank its ``Shard(0)`` part of it, where its DTensor places it), so
    the checkpoint holds the whole weights, as one process's does.

``load_training_state`` copies what ``dcp.load`` filled back into the model and optimizer (for
the three cases above it was filled in place already; only hyper-parameters and step counts are
set). ``gather_full`` turns any of these values into full tensors (tests, inspection).

Collectives: building a ``ShardedTensor`` state needs every rank's boxes, exchanged in one
``all_gather_object`` over the world (a few hundred bytes per sharded tensor) per call;
``gather_full`` is one ``all_gather_object`` of the local pieces (for tests, not per step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from loom.parallel.expert import ExpertParallel, expert_parameter_names
from loom.parallel.vocab_pipeline import row_slices
from loom.parallel.zero import ZeroShardedOptimizer
from loom.train.checkpoint import is_sharded_tensor
from loom.train.checkpoint_safety import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


def _options():
    """Flattened optimizer state (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): with
    per-parameter keys, ranks holding different parameters (pipeline stages) never write the
    same key with different contents, so DCP can reshard the optimizer across layouts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


# ---------------------------------------------------------------------------------------------
# Boxes and ShardedTensors


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Split the row-major elements ``[start, stop)`` of a tensor of ``shape`` into boxes, in
    order; each box is a contiguous run of elements, so ``flat[start:stop]`` splits into views
    of the boxes' sizes."""
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape))]
    inner = math.prod(shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: recurse into it
        return [((first, *off), (1, *size))
                for off, size in flat_range_boxes(shape[1:], start - first * inner,
                                                  stop - first * inner)]
    boxes: list[Box] = []
    whole_from, whole_to = first, last + 1
    if start % inner:  # the end of a partial first row
        boxes += flat_range_boxes(shape, start, (first + 1) * inner)
        whole_from = first + 1
    tail = flat_range_boxes(shape, last * inner, stop) if stop % inner else []
    if tail:
        whole_to = last
    if whole_to > whole_from:
        boxes.append(((whole_from, *(0,) * (len(shape) - 1)),
                      (whole_to - whole_from, *shape[1:])))
    return boxes + tail


def _exchange_boxes(local: dict[str, list[Box]]) -> list[dict[str, list[Box]]]:
    """Every rank's boxes by key (one object all-gather over the world)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [local]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone


def _sharded_tensor(shape: tuple[int, ...], pieces: list[tuple[Box, torch.Tensor]],
                    boxes_by_rank: list[list[Box]]) -> Any:
    """A ``ShardedTensor`` of global ``shape`` whose local shards are ``pieces`` (views, so DCP
    loads in place). Ranks holding the same box (replicas) each list it as their own; every box
    appears once in the global metadata, placed on this rank when it holds it."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                   TensorProperties)
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    me = dist.get_rank() if dist.is_initialized() else 0
    device = pieces[0][1].device if pieces else torch.device("cpu")
    where = lambda rank: f"rank:{rank}/{device}"  # noqa: E731 (only this rank's is checked)
    mine = {box for box, _ in pieces}
    placed: dict[Box, int] = {box: me for box in mine}
    for rank, boxes in enumerate(boxes_by_rank):
        for box in boxes:
            placed.setdefault(box, rank)
    shards_md = [ShardMetadata(list(off), list(size), where(rank))
                 for (off, size), rank in placed.items()]
    local = [Shard(t, ShardMetadata(list(off), list(size), where(me))) for (off, size), t in pieces]
    template = pieces[0][1] if pieces else torch.empty(0)
    props = TensorProperties.create_from_tensor(template)
    props.requires_grad = False
    meta = ShardedTensorMetadata(shards_md, torch.Size(shape), props)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, meta, sharding_spec=EnumerableShardingSpec(shards_md))


def _as_sharded(state: dict[str, Any], local: dict[str, tuple[tuple[int, ...],
                                                               list[tuple[Box, torch.Tensor]]]]
                ) -> None:
    """Replace ``state[key]`` by a ShardedTensor for every ``key`` of ``local`` (collective)."""
    everyone = _exchange_boxes({k: [box for box, _ in pieces] for k, (_, pieces) in local.items()})
    for key, (shape, pieces) in local.items():
        state[key] = _sharded_tensor(shape, pieces, [r.get(key, []) for r in everyone])


# ---------------------------------------------------------------------------------------------
# ZeRO-1/2: flat bucket slices


def _adamw_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of ``param``, created as AdamW creates it when it has none yet (a
    fresh trainer that loads a checkpoint): step 0 and zero moments, filled by the load."""
    state = optimizer.state[param]
    if not state:
        from torch.optim.optimizer import _get_scalar_dtype

        # as AdamW makes it: a fused optimizer keeps ``step`` on the parameter's device
        fused = any(group.get("fused") for group in optimizer.param_groups)
        state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(is_fused=fused),
                                     device=param.device if fused else None)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _zero_optimizer_state(zero: Any, optimizer: torch.optim.Optimizer,
                          ep: Any = None, masters: dict[str, Any] | None = None,
                          vocab: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The flattened optimizer state of ZeRO-1/2 under per-parameter names and full shapes
    (``ep``: an expert bucket's boxes sit in this ep rank's slice of the ``[E, ...]`` tensor).
    ``masters`` (bf16 parameters): filled with each weight's fp32 master, from the rank's
    slices in the moments' boxes, as ShardedTensors under the weight's name. ``vocab``
    (``row_slices``): a vocabulary shard's boxes sit at its rows' offset in the full weight."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: dict[str, Any] = {}
    local: dict[str, Any] = {}
    master_local: dict[str, Any] = {}
    for bucket, name, shape, boxes, at in _slice_boxes(zero, ep, vocab):
        state = _adamw_state(optimizer, bucket.shard)
        if masters is not None:
            master_local[name] = (shape, _views(bucket.shard.detach(), boxes, at))
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == bucket.shard.shape:  # moments
                local[f"state.{name}.{key}"] = (shape, _views(value, boxes, at))
            else:  # the step count; a copy per name, so a load can check they agree
                out[f"state.{name}.{key}"] = value.detach().clone()
        hyper = {k: v for k, v in group_of[id(bucket.shard)].items() if k != "params"}
        out.update({f"param_groups.{name}.{k}": v for k, v in hyper.items()})
    _as_sharded(out, local)
    if masters is not None:
        _as_sharded(masters, master_local)
    return out


def _slice_boxes(zero: Any, ep: Any = None, vocab: dict[str, tuple[int, int]] | None = None):
    """For every parameter of every ZeRO-1/2 bucket: ``(bucket, name, global shape, boxes of
    the global tensor this rank's slice holds, where in the slice they start)`` (``ep``: an
    expert bucket's boxes sit in this ep rank's rows of ``[E, ...]``; ``vocab``, ``row_slices``:
    a vocabulary shard's at its rows' offset in the full weight)."""
    vocab = vocab or {}
    for bucket in zero.buckets:
        per_rank = bucket.flat.numel() // bucket.shards.size
        lo, hi = bucket.shards.rank * per_rank, (bucket.shards.rank + 1) * per_rank
        offset = 0
        for name, param in zip(bucket.names, bucket.params):
            part = getattr(param, "_local_tensor", param)  # under TP: the rank's tp shard
            begin, end = max(offset, lo), min(offset + part.numel(), hi)
            boxes = _in_global(flat_range_boxes(tuple(part.shape), begin - offset, end - offset),
                               param)
            shape = tuple(param.shape)
            if bucket.expert and ep is not None:  # this ep rank's experts: rows of [E, ...]
                rows = shape[0]
                boxes = [((off[0] + ep.rank * rows, *off[1:]), size) for off, size in boxes]
                shape = (rows * ep.size, *shape[1:])
            if name in vocab:  # vocab_parallel_pp: this pipeline rank's rows of [V, D]
                start, total = vocab[name]
                boxes = [((off[0] + start, *off[1:]), size) for off, size in boxes]
                shape = (total, *shape[1:])
            yield bucket, name, shape, boxes, begin - lo
            offset += part.numel()


def zero_slices_by_name(zero: Any, per_bucket: list[torch.Tensor], ep: Any = None,
                        vocab: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """A state shaped like the ZeRO-1/2 buckets' slices (``per_bucket[i]`` like
    ``zero.buckets[i].shard``: the outer loop's snapshot, momentum, ...) under per-parameter
    names and full shapes, as the optimizer's moments are saved: ShardedTensors whose boxes
    view ``per_bucket``, so a load fills it in place and any layout reads it (collective)."""
    index = {id(bucket): i for i, bucket in enumerate(zero.buckets)}
    local = {name: (shape, _views(per_bucket[index[id(bucket)]], boxes, at))
             for bucket, name, shape, boxes, at in _slice_boxes(zero, ep, vocab)}
    out: dict[str, Any] = {}
    _as_sharded(out, local)
    return out


def _views(flat: torch.Tensor, boxes: list[Box], at: int) -> list[tuple[Box, torch.Tensor]]:
    """``flat[at:]`` cut into views of the sizes of ``boxes``, in order."""
    views = []
    for box in boxes:
        n = math.prod(box[1])
        views.append((box, flat[at:at + n].view(box[1])))
        at += n
    return views


def _in_global(boxes: list[Box], param: torch.Tensor) -> list[Box]:
    """Boxes of a DTensor's local shard moved to where that shard sits in the global tensor
    (ZeRO-1/2 under TP); a plain tensor's unchanged."""
    if not hasattr(param, "device_mesh"):
        return boxes
    _, shift = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                     param.placements)
    return [(tuple(o + s for o, s in zip(off, shift)), size) for off, size in boxes]


def _load_zero_optimizer_state(zero: Any, optimizer: torch.optim.Optimizer,
                               optim_sd: dict[str, Any]) -> None:
    """After ``dcp.load`` filled the moments in place: step counts and hyper-parameters, and the
    host copy of each slice (optimizer offload) refreshed from the loaded weights."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for bucket in zero.buckets:
        state = optimizer.state[bucket.shard]
        group = group_of[id(bucket.shard)]
        for key, value in list(state.items()):
            if not (torch.is_tensor(value) and value.shape == bucket.shard.shape):
                values = [optim_sd[f"state.{n}.{key}"] for n in bucket.names]
                _require_one({repr(v.tolist()) for v in values}, f"state.*.{key}", bucket.names)
                value.copy_(values[0])
        for k in [k for k in group if k != "params"]:
            values = [optim_sd[f"param_groups.{n}.{k}"] for n in bucket.names]
            _require_one(set(map(repr, values)), f"param_groups.*.{k}", bucket.names)
            group[k] = values[0]
        if bucket.shard.untyped_storage().data_ptr() != bucket.flat.untyped_storage().data_ptr() \
                and not zero.keeps_master:
            # optimizer offload: the slice is a host copy of the (just loaded) weights
            per_rank, rank = bucket.flat.numel() // bucket.shards.size, bucket.shards.rank
            bucket.shard.data.copy_(bucket.flat[rank * per_rank:(rank + 1) * per_rank])


def _require_one(values: set, key: str, names: list[str]) -> None:
    if len(values) != 1:
        raise CheckpointError(f"{key}: the checkpoint holds different values for parameters"
                              f" that share one ZeRO bucket ({names[0]} ...): {sorted(values)}")


# ---------------------------------------------------------------------------------------------
# Expert parallelism: slices of the global expert tensors


def _expert_pieces(value: torch.Tensor, ep: Any) -> tuple[tuple[int, ...],
                                                         list[tuple[Box, torch.Tensor]]]:
    """(global shape, [(box, local view)]) of an ep rank's experts of one weight (or moment)."""
    local = value
    offset = [0] * value.ndim
    shape = list(value.shape)
    if hasattr(value, "device_mesh"):  # expert-TP: the tp-local box inside this ep slice
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                          value.placements)
        offset = list(offset)
        local = value.to_local()
    experts = shape[0]
    offset[0] += ep.rank * experts
    shape[0] = experts * ep.size
    return tuple(shape), [((tuple(offset), tuple(local.shape)), local.detach())]


def _experts_as_slices(model: nn.Module, ep: Any, model_sd: dict[str, Any],
                       optim_sd: dict[str, Any]) -> None:
    _as_slices(expert_parameter_names(model), lambda name, value: _expert_pieces(value, ep),
               model_sd, optim_sd)


def experts_by_name_as_slices(model: nn.Module, ep: Any | None,
                              by_name: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A per-parameter state other than the optimizer's (the outer loop's snapshot, momentum,
    ...: ``name -> tensor`` shaped like the parameter) with each expert entry made this ep
    rank's box of the global tensor, as the weights are (collective over the job when ep > 1;
    a load fills the boxes in place, so the tensors of ``by_name`` hold the loaded values)."""
    if ep is None:
        return by_name
    state = dict(by_name)
    _as_slices(expert_parameter_names(model) & set(state),
               lambda name, value: _expert_pieces(value, ep), state, {})
    return state


# ---------------------------------------------------------------------------------------------
# Vocabulary parallelism across the pipeline: rows of the embedding and the head


def _vocab_pieces(rows: dict[str, tuple[int, int]], name: str, value: torch.Tensor
                  ) -> tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]:
    """(global shape, [(box, local view)]) of a vocabulary shard's rows of ``name`` (or of one
    of its moments): pipeline rank r's rows ``[start, start + V/p)`` of the ``[V, D]`` weight
    (``loom.parallel.vocab_pipeline.VocabRows``); under tp this tp rank's part of them, where
    the DTensor's placement puts it."""
    start, total = rows[name]
    offset = [0] * value.ndim
    if hasattr(value, "device_mesh"):  # tp: Shard(0) of the pipeline rank's rows
        _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh,
                                                          value.placements)
        offset, value = list(offset), value.to_local()
    offset[0] += start
    return (total, *value.shape[1:]), [((tuple(offset), tuple(value.shape)), value.detach())]


def _vocab_as_slices(model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """Under ``parallel.vocab_parallel_pp`` every pipeline rank holds other rows under the same
    names: each rank's rows (and moments) are saved as its box of the full weight, so the
    checkpoint holds the whole embedding and head, loadable by any layout (collective)."""
    rows = row_slices(model)
    if rows:
        _as_slices(set(rows), lambda name, value: _vocab_pieces(rows, name, value), model_sd,
                   optim_sd)


def _as_slices(names: set[str],
               pieces_of: Callable[[str, torch.Tensor],
                                   tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]],
               model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """Replace every weight of ``names`` and its moments (``state.<name>.*`` tensors; not the
    step count) by a ShardedTensor of ``pieces_of(name, value)``'s boxes (collective)."""
    local: dict[str, Any] = {}
    for name in sorted(names):
        local[name] = pieces_of(name, model_sd[name])
        for key, value in optim_sd.items():
            if key.startswith(f"state.{name}.") and torch.is_tensor(value) and value.ndim:
                local[key] = pieces_of(name, value)
    sharded: dict[str, Any] = {}
    _as_sharded(sharded, local)
    for key, value in sharded.items():
        state = model_sd if key in names else optim_sd
        value._loom_unsharded = state[key]  # what the load hands back (a DTensor under TP)
        state[key] = value


# ---------------------------------------------------------------------------------------------
# The two entry points


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                   zero: ZeroShardedOptimizer | None = None,
                   ep: ExpertParallel | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` for DCP (see the module docstring); collective when a
    layout needs ShardedTensors (ZeRO-1/2 ``zero``, ep > 1 ``ep``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if zero is not None:  # its optimizer steps flat slices, which get_state_dict cannot name
        model_sd = get_model_state_dict(model, options=_options())
        if ep is not None:  # the expert weights as slices (their moments: the boxes above)
            _experts_as_slices(model, ep, model_sd, {})
        _vocab_as_slices(model, model_sd, {})  # (vocabulary rows: theirs too)
        masters: dict[str, Any] | None = {} if zero.keeps_master else None
        optim_sd = _zero_optimizer_state(zero, optimizer, ep, masters, row_slices(model))
        if masters is not None:  # bf16 parameters: the weights saved are the fp32 masters
            unknown = set(masters) - set(model_sd)
            if unknown:
                raise CheckpointError(f"ZeRO buckets name weights the model does not:"
                                      f" {sorted(unknown)[:3]}")
            model_sd.update(masters)
        return {"model": model_sd, "optim": optim_sd}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options())
    if ep is not None:
        _experts_as_slices(model, ep, model_sd, optim_sd)
    _vocab_as_slices(model, model_sd, optim_sd)
    return {"model": model_sd, "optim": optim_sd}


def _locals(state: dict[str, Any]) -> dict[str, Any]:
    """Expert slices (ShardedTensors) replaced by the rank's own tensor they view, which
    ``dcp.load`` filled in place."""
    return {key: getattr(value, "_loom_unsharded", value) for key, value in state.items()}


def load_training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                        tensors: dict[str, Any], *,
                        zero: ZeroShardedOptimizer | None = None) -> None:
    """Apply ``tensors`` (``training_state``'s dict, filled by ``dcp.load``) to the model and
    optimizer (``zero``: its ZeRO-1/2 optimizer, as for ``training_state``)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    if zero is not None:
        model_sd = _locals(tensors["model"])
        if zero.keeps_master:  # the masters were loaded in place; the rest (none today) here
            names = {n for bucket in zero.buckets for n in bucket.names}
            model_sd = {k: v for k, v in model_sd.items() if k not in names}
        if model_sd:
            options = _options()
            options.strict = not zero.keeps_master  # bf16: the weights are not all here
            set_model_state_dict(model, model_sd, options=options)
        _load_zero_optimizer_state(zero, optimizer, tensors["optim"])
        if zero.keeps_master:  # every rank's bf16 parameters from the loaded masters
            zero.gather_parameters()
        return
    set_state_dict(model, optimizer, model_state_dict=_locals(tensors["model"]),
                   optim_state_dict=_locals(tensors["optim"]), options=_options())


def gather_full(tensors: dict[str, Any]) -> dict[str, Any]:
    """``training_state``'s dict as ``"model/<fqn>"`` / ``"optim/<key>"`` -> full tensor (or
    hyper-parameter), the same on every rank (collective over the world; for tests)."""
    flat: dict[str, Any] = {}
    pieces: dict[str, Any] = {}
    for part in ("model", "optim"):
        for key, value in tensors[part].items():
            name = f"{part}/{key}"
            if is_sharded_tensor(value):
                pieces[name] = (tuple(value.size()), [
                    (tuple(s.metadata.shard_offsets), s.tensor.detach().cpu().clone())
                    for s in value.local_shards()])
            elif hasattr(value, "full_tensor"):
                flat[name] = value.full_tensor().detach().cpu().clone()
            elif torch.is_tensor(value):
                flat[name] = value.detach().cpu().clone()
            else:
                flat[name] = value
    everyone: list[Any] = [(flat, pieces)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (flat, pieces))
    out: dict[str, Any] = {}
    for rank_flat, _ in everyone:
        out.update(rank_flat)
    for rank_flat, rank_pieces in everyone:
        for name, (shape, parts) in rank_pieces.items():
            if name not in out:
                template = parts[0][1] if parts else torch.empty(0)
                out[name] = torch.full(shape, float("nan"), dtype=template.dtype)
            for offsets, value in parts:
                out[name][tuple(slice(o, o + n) for o, n in zip(offsets, value.shape))] = value
    return out
