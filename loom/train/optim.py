"""AdamW with linear warmup and cosine decay, and gradient clipping by the global norm.

The clipping norm is *global*: the square root of the sum of squares of every gradient element of
the whole model, however it is split. Each rank sums the squares of the gradient elements it owns;
the sums are all-reduced over the groups along which the model (not the data) is split — none for
pure data parallelism, whose gradients are identical on every rank after the reduction. This is
written here rather than taken from ``torch.nn.utils.clip_grad_norm_`` because that function only
sees the local parameters; the later tensor, pipeline and sharded layouts pass their groups in.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.clipping import clip_coefficient, scale_local_gradients
from loom.parallel.data import is_fully_sharded
from loom.parallel.expert import clip_grad_norm as ep_clip_grad_norm, expert_parameter_names
from loom.parallel.mixed_precision import clear_main_grads, mastered
from loom.parallel.tensor import clip_grad_norm as tp_clip_grad_norm
from loom.parallel.zero import ZeroShardedOptimizer, adamw_kernel


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, zero: ZeroShardedOptimizer | None = None) -> torch.optim.AdamW:
    """AdamW; 1-D parameters (norm weights) are not decayed, as in GPT-2, Llama and TorchTitan.

    Under ZeRO-1/2 (``zero``, the model's ``loom.parallel.zero`` reducer) the AdamW steps this
    rank's slices of the flat parameter buckets instead (same groups, same hyper-parameters;
    elementwise, so exact). With bf16 parameters (``loom.parallel.mixed_precision``) the same
    AdamW steps their fp32 masters inside ``master_window``: its state is fp32."""
    if zero is not None:
        return zero.build_optimizer(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # fused where the device and parameter types allow (zero.adamw_kernel says why and when not)
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_kernel(params))
    masters = mastered(model)
    if masters:  # bf16 parameters: zero_grad also forgets their fp32 ``main_grad``
        plain_zero_grad = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            plain_zero_grad(set_to_none)
            clear_main_grads(masters)

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
    return optimizer


def lr_at(step: int, *, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based).

    Linear warmup from 1/warmup to 1 over ``warmup_steps``, then cosine decay to ``min_ratio`` at
    the last step.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int,
                    min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_at(step, total_steps=total_steps, warmup_steps=warmup_steps,
                           min_ratio=min_ratio),
    )


def local_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the gradients this rank holds (torch's fused per-tensor norms), fp32."""
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).float()


@torch.no_grad()
def clip_to_norm(parameters: Sequence[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients in place by ``clip_coefficient(norm, max_norm)`` (0: leave them)."""
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach=True)


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float,
                   model_parallel_groups: Sequence[dist.ProcessGroup] = ()) -> torch.Tensor:
    """Clip gradients in place to a global norm of ``max_norm`` (0: only measure); return the
    norm before clipping, as an fp32 scalar tensor on the gradients' device."""
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.zeros(())
    norm = local_grad_norm([p.grad for p in parameters])
    if model_parallel_groups:  # squares summed over the ranks holding other parts of the model
        squares = norm.pow(2)
        for group in model_parallel_groups:
            dist.all_reduce(squares, group=group)
        norm = squares.sqrt()
    clip_to_norm(parameters, max_norm, norm)
    return norm


def tied_replicas(model: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient another rank holds too and counts in the global norm: a
    pipeline's last-stage copy of a tied embedding (``loom.pipeline.stage.LocalStages``)."""
    replicas = getattr(model, "tied_replicas", None)
    return replicas() if callable(replicas) else []


@torch.no_grad()
def clip_gradients(model: nn.Module, max_norm: float, *, tp=None, ep=None,
                   zero: ZeroShardedOptimizer | None = None,
                   pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global-norm clipping for any layout of ``model`` (the trainer's model: plain, DP, TP, EP,
    ZeRO-1/2 (``zero``), FSDP2, or a rank's pipeline stages with ``pp_group``); returns the norm before
    clipping. Each gradient element is counted once: ZeRO-1/2 sum their slices' squares over
    dp_shard, FSDP2 over the mesh dims each gradient is sharded on, EP the experts' over ep, TP
    the shards' over tp, and a pipeline every stage's over ``pp_group``; a tied embedding's
    replica is left out of the sum and scaled like the original, so both stay identical."""
    # ZeRO-1/2 leave a replica's bucket out of the norm themselves and scale every slice (a
    # stage-1 ``p.grad`` is a view of the buffer those slices are cut from: no second scaling)
    replicas = [] if zero is not None else \
        [p for p in tied_replicas(model) if p.grad is not None]
    if replicas:  # counted on the rank holding the original; scaled here by the same factor
        grads = [p.grad for p in replicas]
        for param in replicas:
            param.grad = None
        try:
            norm = clip_gradients(model, max_norm, tp=tp, ep=ep, zero=zero, pp_group=pp_group)
        finally:
            for param, grad in zip(replicas, grads):
                param.grad = grad
        if max_norm > 0:
            torch._foreach_mul_([getattr(g, "_local_tensor", g) for g in grads],
                                clip_coefficient(norm, max_norm))
        return norm
    if zero is not None:
        return zero.clip_grad_norm(max_norm)
    if is_fully_sharded(model):
        experts = None
        if ep is not None:  # expert units are sharded over dp_shard; the experts differ over ep
            names = expert_parameter_names(model)
            experts = ({id(p) for n, p in model.named_parameters() if n in names}, ep.group)
        return clip_grad_norm_dtensor(model.parameters(), max_norm,
                                      [pp_group] if pp_group is not None else [],
                                      experts=experts)
    if ep is not None:
        return ep_clip_grad_norm(model, max_norm, ep, tp=tp, pp_group=pp_group)
    if tp is not None:
        other = (("pp", pp_group),) if pp_group is not None else ()
        return tp_clip_grad_norm(model.parameters(), max_norm, tp=tp, other_groups=other)
    return clip_grad_norm(model.parameters(), max_norm, [pp_group] if pp_group is not None else [])


@torch.no_grad()
def clip_grad_norm_dtensor(parameters: Iterable[nn.Parameter], max_norm: float,
                           model_parallel_groups: Sequence[dist.ProcessGroup] = (),
                           experts: tuple[set[int], dist.ProcessGroup] | None = None
                           ) -> torch.Tensor:
    """Global-norm clipping when gradients are DTensors on any mesh (FSDP2, FSDP2 x TP, HSDP).

    Each gradient's local sum of squares is added to the bucket of the mesh dims it is sharded
    on (``Shard`` / ``_StridedShard``); each bucket is all-reduced over exactly those dims, so
    every element is counted once and replicated dims are not summed (explicit, rather than
    DTensor's norm, so the collectives are a fixed, short list: one per mesh dim per bucket).
    ``model_parallel_groups`` (a pipeline's ``pp``): the total is summed over them too.
    ``experts`` (expert parallelism): the ids of the expert weights and the ep group; their
    squares, after their mesh dims, are summed over ep as well (each ep rank's experts are its
    own, a dimension their DTensor mesh does not show).
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    total = dtensor_grad_squares(params, experts)
    for group in model_parallel_groups:  # every rank holds other stages' gradients
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    scale_local_gradients(params, max_norm, norm)
    return norm


def _local_grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """Each gradient's local tensor (a DTensor's shard, sharing its storage)."""
    return [getattr(p.grad, "_local_tensor", p.grad) for p in params]


@torch.no_grad()
def dtensor_grad_squares(params: Sequence[nn.Parameter],
                         experts: tuple[set[int], dist.ProcessGroup] | None = None
                         ) -> torch.Tensor:
    """``clip_grad_norm_dtensor``'s squared norm before ``model_parallel_groups``: each bucket
    all-reduced over its mesh dims (and the experts' over ep), blocking; ``params`` those with
    a gradient (the post-validated step sums this over pp in the background)."""
    grads = [p.grad for p in params]
    local = _local_grads(params)
    expert_ids, ep_group = experts if experts is not None else (set(), None)
    buckets: dict[tuple, tuple[object, torch.Tensor]] = {}
    for param, grad, part in zip(params, grads, local):
        mesh = getattr(grad, "device_mesh", None)  # a DTensor's; None for a plain tensor
        # _StridedShard (FSDP2 over TP's Shard(0)) is not ``is_shard()`` in torch 2.13
        dims = tuple(i for i, p in enumerate(grad.placements)
                     if not (p.is_replicate() or p.is_partial())) if mesh else ()
        key = (id(mesh), dims, id(param) in expert_ids)
        square = part.float().pow(2).sum()
        buckets[key] = (mesh, buckets[key][1] + square if key in buckets else square)
    total = torch.zeros((), dtype=torch.float32, device=local[0].device)
    for (_, dims, expert), (mesh, squares) in buckets.items():
        for dim in dims:
            dist.all_reduce(squares, group=mesh.get_group(dim))
        if expert:
            dist.all_reduce(squares, group=ep_group)
        total = total + squares
    return total


