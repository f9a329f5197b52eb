"""Expert parallelism on the ``ep`` mesh axis: experts sharded, tokens moved by all-to-all.

Layout. ep rank r holds experts ``[r E/ep, (r+1) E/ep)`` of every MoE layer: rows of dim 0 of the
stacked ``w1``, ``w3``, ``w2`` (global names kept), cut from the seeded full value, so the weights
equal one process's bit for bit. The router, shared experts, attention, norms and ends are
replicated. Dense layers treat ``ep`` as data parallel: each ep rank holds its own B/ep
sequences and routes only them. Routing (top-k, capacity, balancing loss) is per sequence (see
``loom.models.moe``), so every rank drops exactly the assignments one process drops.

Collectives per MoE layer per rank, all ``all_to_all`` under axis ``ep`` in the ``CommLedger``
(A_out: this rank's kept assignments; A_in: the group's assignments to this rank's experts;
A_self: both; D model dim; b bytes per activation element):

* forward: the per-expert counts (E int64, 8E bytes, so each rank can size its receive), the
  dispatch of A_out token rows and the combine of A_in result rows back;
* backward: the reverse of the combine (A_out gradient rows) and of the dispatch (A_in rows).

Payload ``8E + 2 (A_out + A_in) D b``; wire (bytes leaving the rank) ``8E (ep-1)/ep + 2 (A_out +
A_in - 2 A_self) D b``, since a rank keeps its own rows. No collective is issued for the weights.

Gradients of the global-mean loss (``reduce_gradients``). Each rank's loss is the mean over its
own tokens, so a replicated (dense) gradient is averaged over the dp x ep ranks, as plain data
parallelism does. An expert's gradient already arrives summed over every ep rank's tokens (the
backward all-to-all brings it home), i.e. it is ep times the one-process gradient: it must not
be averaged over ep, but summed over the ranks outside ep that hold the same expert
(dp_replicate x dp_shard) and divided by the whole data-parallel degree dp x ep. One rule for
both kinds: sum over the ranks holding the parameter, divide by dp x ep.

Degree 1: ``apply_expert_parallel`` returns the model untouched. Why hand-written: torch has no
expert-parallel layer; TorchTitan's relies on CUDA kernels (grouped GEMM, token permutation).
Here the experts stay a plain ``GroupedExperts`` shard and only ``MoEFeedForward.dispatcher`` is
swapped; the model file never imports any of this.

Shape legend: D model dim, E experts (global), A rows of token-expert assignments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from loom.models.moe import GroupedExperts, MoEFeedForward
from loom.parallel import comm
from loom.parallel.comm import CommLedger


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's expert-parallel group (what ``apply_expert_parallel`` leaves on the model)."""

    group: Any
    size: int
    rank: int
    ledger: CommLedger | None = None


def check_divisible(n_experts: int, ep: int) -> None:
    """Raise ``ValueError`` naming the rule when ``n_experts`` cannot be split ``ep`` ways."""
    if n_experts <= 0:
        raise ValueError(f"expert parallelism: ep={ep} needs an MoE model (model.n_experts > 0)")
    if n_experts % ep:
        raise ValueError(f"expert parallelism: ep={ep} must divide model.n_experts={n_experts} "
                         f"(each ep rank holds n_experts/ep experts); valid ep degrees: "
                         f"{[d for d in range(1, n_experts + 1) if n_experts % d == 0]}")


def _exchange(x: torch.Tensor, ep: ExpertParallel, out_splits: list[int],
              in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), ep.group, axis="ep", ledger=ep.ledger,
                           output_split_sizes=out_splits, input_split_sizes=in_splits)
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to peers by ``in_splits``, from peers by ``out_splits``; backward: the reverse."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ep: ExpertParallel, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.ep, ctx.splits = ep, (out_splits, in_splits)
        return _exchange(x, ep, out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, ctx.ep, in_splits, out_splits), None, None, None


class ExpertParallelDispatcher:
    """``MoEFeedForward.dispatcher`` for sharded experts: counts, dispatch, compute, combine."""

    def __init__(self, ep: ExpertParallel) -> None:
        self.ep = ep

    def __call__(self, x_AD: torch.Tensor, counts_E: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        ep = self.ep
        local = counts_E.numel() // ep.size
        # Rows are sorted by global expert, and rank j owns a contiguous range of experts, so
        # the rows for rank j are one contiguous block: the split sizes are sums of counts.
        recv_counts = torch.empty_like(counts_E)
        comm.all_to_all_single(recv_counts, counts_E, ep.group, axis="ep", ledger=ep.ledger)
        send_splits = counts_E.view(ep.size, local).sum(1).tolist()
        recv_JE = recv_counts.view(ep.size, local)  # rows from peer j for my local expert e
        recv_splits = recv_JE.sum(1).tolist()
        x_in = _AllToAll.apply(x_AD, ep, recv_splits, send_splits)  # peer-major, then expert
        # Regroup expert-major for the expert loop, and undo it before sending results home.
        expert_of_row = torch.arange(local, device=x_AD.device).repeat(ep.size)
        expert_of_row = expert_of_row.repeat_interleave(recv_JE.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        y = experts(x_in[order], recv_JE.sum(0).tolist())
        y_in = y[torch.argsort(order)]
        return _AllToAll.apply(y_in, ep, send_splits, recv_splits)


def moe_layers(model: nn.Module) -> Iterator[MoEFeedForward]:
    return (m for m in model.modules() if isinstance(m, MoEFeedForward))


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names of the sharded expert weights (prefixes included, e.g. ``module.`` under DDP)."""
    return {f"{prefix}.{name}" for prefix, m in model.named_modules()
            if isinstance(m, GroupedExperts) for name, _ in m.named_parameters(recurse=False)}


def apply_expert_parallel(model: nn.Module, group: Any,
                          ledger: CommLedger | None = None) -> nn.Module:
    """Keep this rank's experts of every MoE layer and swap in the all-to-all dispatcher.

    Call after ``reset_parameters`` (the trainer's order): the shard is cut from the full seeded
    value the rank holds. Identity at degree 1. Returns ``model`` (changed in place).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return model
    layers = list(moe_layers(model))
    for moe in layers:
        check_divisible(moe.n_experts, size)
    ep = ExpertParallel(group, size, dist.get_rank(group), ledger)
    for moe in layers:
        shard = moe.n_experts // size
        start = ep.rank * shard
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            value = param.detach()[start:start + shard].clone()
            setattr(moe.experts, name, nn.Parameter(value, requires_grad=param.requires_grad))
        moe.dispatcher = ExpertParallelDispatcher(ep)
    model.expert_parallel = ep
    return model


def expert_parallel_of(model: nn.Module) -> ExpertParallel | None:
    return getattr(model, "expert_parallel", None)


@torch.no_grad()
def reduce_gradients(model: nn.Module, ep: ExpertParallel, *, dp_group: Any = None,
                     dense: bool = True) -> None:
    """Turn every local gradient into the one-process gradient of the global-mean loss.

    ``dp_group``: the data-parallel ranks outside ep holding the same experts (dp_replicate x
    dp_shard; None at degree 1). Expert gradients: summed over ``dp_group``, divided by dp x ep.
    Dense gradients (``dense=True``): summed over ep then dp, divided by dp x ep; pass
    ``dense=False`` when the data-parallel reducer over the flattened dp x ep mesh already
    averages them.
    """
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    experts = expert_parameter_names(model)
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        if name in experts:
            if dp > 1:
                comm.all_reduce(param.grad, dp_group, axis="dp", ledger=ep.ledger)
        elif dense:
            comm.all_reduce(param.grad, ep.group, axis="ep", ledger=ep.ledger)
            if dp > 1:
                comm.all_reduce(param.grad, dp_group, axis="dp", ledger=ep.ledger)
        else:
            continue
        param.grad.div_(dp * ep.size)


@torch.no_grad()
def gather_expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full value of every expert weight by name (collective over ep: call on every ep rank),
    e.g. to save a one-file checkpoint; shards are stacked back in rank order along dim 0."""
    ep, experts = expert_parallel_of(model), expert_parameter_names(model)
    out = {}
    for name, param in model.named_parameters():
        if name in experts:
            full = param.new_empty((param.shape[0] * ep.size, *param.shape[1:]))
            comm.all_gather_into_tensor(full, param.detach().contiguous(), ep.group, axis="ep",
                                        ledger=ep.ledger)
            out[name] = full
    return out


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, ep: ExpertParallel) -> torch.Tensor:
    """Global gradient norm (each expert shard counted once: squares summed over ep, replicated
    gradients counted once), clipped to ``max_norm`` (0: only measure). Returns the norm."""
    experts = expert_parameter_names(model)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    squares = [torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)]
    for name, grad in grads.items():
        squares[name in experts] += grad.float().pow(2).sum().cpu()
    comm.all_reduce(squares[1], ep.group, axis="ep", ledger=ep.ledger)
    norm = (squares[0] + squares[1]).sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in grads.values():
            grad.mul_(scale.to(grad.device))
    return norm
