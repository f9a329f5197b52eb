"""Expert parallelism on the ``ep`` mesh axis (experts sharded, tokens moved by all-to-all), and
expert tensor parallelism on ``tp`` (every expert's hidden dim split, see below).

Layout. ep rank r holds experts ``[r E/ep, (r+1) E/ep)`` of every MoE layer: rows of dim 0 of the
stacked ``w1``, ``w3``, ``w2`` (global names kept), cut from the seeded full value, so the weights
equal one process's bit for bit. The router, shared experts, attention, norms and ends are
replicated. Dense layers treat ``ep`` as data parallel: each ep rank holds its own B/ep
sequences and routes only them. Routing (top-k, capacity, balancing loss) is per sequence, or
per document for packed rows and varlen microbatches (see ``loom.models.moe``), so every rank
drops exactly the assignments one process drops.

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
both kinds: sum over the ranks holding the parameter, divide by dp x ep. Under context
parallelism (cp ranks hold other tokens of the same sequences, and the same experts; the ep
all-to-all runs among the ranks of one cp coordinate) cp joins both: expert gradients are summed
over dp_replicate x dp_shard and cp, everything is divided by dp x ep x cp. Under ZeRO
(dp_shard > 1) the sharded reduction applies the same rule itself (``zero.py``, and
``data.apply_fully_shard``'s expert units), and ``reduce_gradients`` is not called.

**Expert tensor parallelism: expert-TP = TP** (``apply_expert_tensor_parallel``, called by
``tensor.apply_tensor_parallel`` for every MoE block). Attention keeps its TP layout; the MoE layer
uses the same tp group with Megatron's expert-TP folding at ETP = TP: every expert's ``w1``/``w3``
split by hidden columns (``Shard(2)`` of ``[E, D, F]``) and ``w2`` by hidden rows (``Shard(1)`` of
``[E, F, D]``), the shared experts like the dense MLP, the router replicated (a plain parameter).
Tokens are replicated over tp (under SP the sequence is all-gathered first), every tp rank routes
the same tokens identically, runs all of the routed rows through its hidden slice and produces a
partial output; one all-reduce (SP: reduce-scatter) sums it. With ep > 1 the all-to-all runs
among the ranks of one tp coordinate, each moving the same rows as without tp.

Why this folding and not tp folded into the all-to-all group: it needs no change to routing or
dispatch (one process's per-sequence routing, so capacity drops and the balancing loss are those
of one process by construction), the collectives are exactly the dense MLP's, and the global
parameter names and shapes stay those of one process (DTensors on the tp mesh, ep rows cut from
dim 0 as before), so DCP can reshard them. The price is that every tp rank computes the router
and moves the full token rows in the all-to-all; folding tp into ep would cut the all-to-all
bytes per rank by t (each rank would dispatch only its 1/t of the tokens to ep x t holders of
E/(ep t) whole experts), but needs E divisible by ep x t and a second routing layout.

Collectives on ``tp`` per MoE layer per microbatch (T = B*S tokens of the rank, D model dim,
A kept assignments, b bytes per element; all under axis ``tp`` in the ledger):

* forward: all-reduce of the partial output, T*D*b (SP: all-gather of the input, T*D*b gathered,
  and reduce-scatter of the output, T*D*b input);
* backward: all-reduce of the experts' input gradient, T*D*b (SP: all-gather of the output
  gradient and reduce-scatter of the input gradient), and all-reduce of the combine weights'
  gradient, A*4 bytes (fp32): each tp rank's gradient of a combine weight is its partial expert
  output dotted with the output gradient, a partial sum. Reducing A weights instead of the router
  gradient keeps the router gradient complete and identical on every tp rank (the balancing
  loss's part is already complete there and must not be summed t times).

Wire bytes: the dense MLP's ``4 (t-1)/t T D b`` per layer, plus ``2 (t-1)/t A 4`` (tested,
``tests/dist/test_expert_tp.py``). Gradients: expert shards are tp shards of the ep shard, reduced
by the rule above on their local tensors; the router is replicated over tp and dp x ep (dense);
clipping sums the expert squares over ep, then every tp-sharded square over tp.

Degree 1: ``apply_expert_parallel`` returns the model untouched. Why hand-written: torch has no
expert-parallel layer; TorchTitan's relies on CUDA kernels (grouped GEMM, token permutation).
Here the experts stay a plain ``GroupedExperts`` shard and only ``MoEFeedForward.dispatcher`` is
swapped; the model file never imports any of this.

Shape legend: D model dim, E experts (global), A rows of token-expert assignments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.func import functional_call

from loom.models.document_attention import DocumentMask
from loom.models.moe import GroupedExperts, MoEFeedForward
from loom.parallel import comm
from loom.parallel.clipping import scale_local_gradients
from loom.parallel.comm import CommLedger
from loom.parallel.mixed_precision import gradient_of


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's expert-parallel group (what ``apply_expert_parallel`` returns)."""

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


# -- expert tensor parallelism (expert-TP = TP) ----------------------------------------------------
@dataclass(frozen=True)
class ExpertTensorParallel:
    """The tp group as an MoE layer's expert-TP forward uses it (held by that forward)."""

    mesh: Any
    group: Any
    size: int
    sequence_parallel: bool
    ledger: CommLedger | None = None


# Placement of each weight over tp: w1 (and SwiGLU's w3) by columns (the hidden dim), w2 by rows.
_EXPERT_SHARD_DIM = {"w1": 2, "w3": 2, "w2": 1}  # GroupedExperts, [E, D, F] / [E, F, D]
_SHARED_SHARD_DIM = {"w1.weight": 0, "w3.weight": 0, "w2.weight": 1}  # nn.Linear, [out, in]


def sequence_shard_lengths(S: int, t: int) -> list[int]:
    """The sequence lengths of the t SP shards of S tokens as DTensor's ``Shard(1)`` cuts them
    (``torch.chunk``: ``ceil(S/t)`` each, the last shorter or empty): a varlen microbatch
    (``data.packing = varlen``) need not divide by t."""
    chunk = -(-S // t)
    return [max(0, min(chunk, S - r * chunk)) for r in range(t)]


def _gather_sequence(x_BsD: torch.Tensor, etp: ExpertTensorParallel, S: int) -> torch.Tensor:
    """[B, S/t, D] sequence shards -> [B, S, D] (all-gather of B*S*D elements; uneven shards
    travel padded to the longest)."""
    B, s, D = x_BsD.shape
    lengths = sequence_shard_lengths(S, etp.size)
    chunk = lengths[0]
    padded = F.pad(x_BsD, (0, 0, 0, chunk - s)) if s < chunk else x_BsD
    out = x_BsD.new_empty((etp.size * B, chunk, D))  # rank-major along dim 0, as gloo wants
    comm.all_gather_into_tensor(out, padded.contiguous(), etp.group, axis="tp",
                                ledger=etp.ledger)
    if etp.size * chunk == S:
        return out.view(etp.size, B, chunk, D).movedim(0, 1).reshape(B, S, D)
    parts = out.view(etp.size, B, chunk, D)
    return torch.cat([parts[r, :, :n] for r, n in enumerate(lengths)], dim=1)


def _reduce_scatter_sequence(x_BSD: torch.Tensor, etp: ExpertTensorParallel) -> torch.Tensor:
    """Partial [B, S, D] -> summed [B, S/t, D] (reduce-scatter of B*S*D elements; uneven shards
    padded to the longest)."""
    B, S, D = x_BSD.shape
    lengths = sequence_shard_lengths(S, etp.size)
    chunk = lengths[0]
    if etp.size * chunk != S:
        x_BSD = F.pad(x_BSD, (0, 0, 0, etp.size * chunk - S))
    parts = x_BSD.reshape(B, etp.size, chunk, D).movedim(1, 0)
    parts = parts.reshape(etp.size * B, chunk, D)  # rank-major along dim 0
    out = x_BSD.new_empty((B, chunk, D))
    comm.reduce_scatter_tensor(out, parts, etp.group, axis="tp", ledger=etp.ledger)
    return out[:, :lengths[etp.mesh.get_local_rank()]]


def _all_reduce(x: torch.Tensor, etp: ExpertTensorParallel) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce a tensor autograd may still hold in place
    comm.all_reduce(out, etp.group, axis="tp", ledger=etp.ledger)
    return out


def _sequence_chunk(x_BSD: torch.Tensor, etp: ExpertTensorParallel) -> torch.Tensor:
    lengths = sequence_shard_lengths(x_BSD.shape[1], etp.size)
    rank = etp.mesh.get_local_rank()
    return x_BSD.narrow(1, sum(lengths[:rank]), lengths[rank])


class _EnterExperts(torch.autograd.Function):
    """x -> (x_router, x_experts), both the full tokens of this tp group.

    Forward: under SP all-gather the sequence, else identity. Backward: the router path's
    gradient is complete on every rank (the routing is replicated), the experts path's is this
    rank's partial sum; so the input gradient is g_router + all-reduce(g_experts), or under SP
    this rank's chunk of g_router + reduce-scatter(g_experts). One collective each way.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, etp: ExpertTensorParallel, S: int):
        ctx.etp = etp
        full = _gather_sequence(x, etp, S) if etp.sequence_parallel else x
        return full.view_as(full), full.view_as(full)

    @staticmethod
    def backward(ctx: Any, g_router: torch.Tensor | None, g_experts: torch.Tensor | None):
        etp = ctx.etp
        g_router = torch.zeros_like(g_experts) if g_router is None else g_router
        g_experts = torch.zeros_like(g_router) if g_experts is None else g_experts
        if etp.sequence_parallel:
            return (_sequence_chunk(g_router, etp) + _reduce_scatter_sequence(g_experts, etp),
                    None, None)
        return g_router + _all_reduce(g_experts, etp), None, None


class _ExitExperts(torch.autograd.Function):
    """This rank's partial expert output -> the sum over tp (all-reduce; SP: reduce-scatter to
    the sequence shard). Backward: identity (SP: all-gather of the shard gradients)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, etp: ExpertTensorParallel) -> torch.Tensor:
        ctx.etp, ctx.S = etp, partial.shape[1]
        if etp.sequence_parallel:
            return _reduce_scatter_sequence(partial, etp)
        return _all_reduce(partial, etp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        etp = ctx.etp
        return (_gather_sequence(grad, etp, ctx.S) if etp.sequence_parallel else grad), None


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over tp. For the combine weights: each
    rank's gradient is its partial expert output dotted with the output gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, etp: ExpertTensorParallel) -> torch.Tensor:
        ctx.etp = etp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_reduce(grad, ctx.etp), None


def _local(module: nn.Module) -> Callable:
    """``module`` called with the local shard of each DTensor weight (autograd flows back)."""
    params = {n: p.to_local() if isinstance(p, DTensor) else p
              for n, p in module.named_parameters()}
    return lambda *args: functional_call(module, params, args)


def _compute_on_local_shards(module: nn.Module) -> None:
    """Make ``module``'s own forward compute with the local shard of each DTensor weight, so it
    is still called as a module: under ZeRO-3 the experts are their own FSDP2 unit, and only a
    module call runs the unit's hooks (gather before, reduce-scatter of the gradients after).
    The weights are read at call time, after the unit has gathered them."""
    plain = type(module).forward

    def forward(*args: Any) -> torch.Tensor:
        params = {n: p.to_local() if isinstance(p, DTensor) else p
                  for n, p in module.named_parameters()}
        # the mechanism torch.func.functional_call uses, without calling the module again
        with torch.nn.utils.stateless._reparametrize_module(module, params):
            return plain(module, *args)

    module.forward = forward


def _expert_tensor_parallel_forward(moe: MoEFeedForward, etp: ExpertTensorParallel) -> Callable:
    def forward(x_BSD: torch.Tensor, documents: DocumentMask | None = None) -> torch.Tensor:
        local = x_BSD.to_local() if isinstance(x_BSD, DTensor) else x_BSD
        # under SP the DTensor knows the whole sequence's length (shards may be uneven)
        x_router, x_experts = _EnterExperts.apply(local, etp, x_BSD.shape[1])
        # replicated over tp: every rank routes the same (whole rows: the documents' own ids)
        routing = moe.route_tokens(x_router, documents)
        routing = routing._replace(weight_A=_SumGradient.apply(routing.weight_A, etp))
        shared = _local(moe.shared) if moe.shared is not None else None
        partial = moe.experts_output(x_experts, routing, moe.experts, shared)
        out = _ExitExperts.apply(partial, etp)
        if etp.sequence_parallel:  # the residual stream is a DTensor sharded on the sequence
            # the global shape said: shards of a varlen microbatch may be uneven
            return DTensor.from_local(out, etp.mesh, [Shard(1)], run_check=False,
                                      shape=x_BSD.shape, stride=x_BSD.stride())
        return out

    return forward


def apply_expert_tensor_parallel(moe: MoEFeedForward, tp_mesh: Any, *, sequence_parallel: bool,
                                 ledger: CommLedger | None = None) -> MoEFeedForward:
    """Shard one MoE layer's experts over the 1-D ``tp_mesh`` (expert-TP = TP), in place.

    Every expert's (and the shared experts') w1/w3 become DTensors split by hidden columns, w2 by
    hidden rows; the router stays a replicated plain parameter. Each rank keeps its slice of the
    full value it holds (call after ``reset_parameters``; ``tensor.load_shard`` for meta init).
    ``forward`` is replaced on the instance (names unchanged) by: enter (SP: all-gather), route
    on the full tokens, the local shards' partial output, exit (all-reduce; SP: reduce-scatter).
    """
    etp = ExpertTensorParallel(tp_mesh, tp_mesh.get_group(), tp_mesh.size(), sequence_parallel,
                               ledger)
    for module, dims in ((moe.experts, _EXPERT_SHARD_DIM), (moe.shared, _SHARED_SHARD_DIM)):
        # the weights the module has (GELU experts and shared experts have no w3)
        for name, param in list(module.named_parameters()) if module is not None else ():
            dim = dims[name]
            owner, _, leaf = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            value = distribute_tensor(param.detach(), tp_mesh, [Shard(dim)], src_data_rank=None)
            setattr(holder, leaf, nn.Parameter(value, requires_grad=param.requires_grad))
    _compute_on_local_shards(moe.experts)
    moe.forward = _expert_tensor_parallel_forward(moe, etp)
    return moe


def moe_layers(model: nn.Module) -> Iterator[MoEFeedForward]:
    return (m for m in model.modules() if isinstance(m, MoEFeedForward))


def expert_parameter_names(model: nn.Module) -> set[str]:
    """Names of the sharded expert weights (prefixes included, e.g. ``module.`` under DDP)."""
    return {f"{prefix}.{name}" for prefix, m in model.named_modules()
            if isinstance(m, GroupedExperts) for name, _ in m.named_parameters(recurse=False)}


def apply_expert_parallel(model: nn.Module, group: Any,
                          ledger: CommLedger | None = None) -> ExpertParallel | None:
    """Keep this rank's experts of every MoE layer and swap in the all-to-all dispatcher.

    Call after ``reset_parameters`` (the trainer's order): the shard is cut from the full seeded
    value the rank holds. Changes ``model`` in place; returns the rank's ``ExpertParallel``
    record (None at degree 1, where nothing changes).
    """
    size = dist.get_world_size(group)
    if size == 1:
        return None
    layers = list(moe_layers(model))
    for moe in layers:
        check_divisible(moe.n_experts, size)
    ep = ExpertParallel(group, size, dist.get_rank(group), ledger)
    for moe in layers:
        shard = moe.n_experts // size
        start = ep.rank * shard
        for name, param in list(moe.experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # expert-TP first: cut the ep rows of the tp shard
                value = DTensor.from_local(param.to_local()[start:start + shard].clone(),
                                           param.device_mesh, param.placements, run_check=False)
            else:
                value = param.detach()[start:start + shard].clone()
            setattr(moe.experts, name, nn.Parameter(value, requires_grad=param.requires_grad))
        moe.dispatcher = ExpertParallelDispatcher(ep)
    return ep


@torch.no_grad()
def reduce_gradients(model: nn.Module, ep: ExpertParallel, *, dp_group: Any = None,
                     cp_group: Any = None, dense: bool = True, compressor: Any = None) -> None:
    """Turn every local gradient into the one-process gradient of the global-mean loss.

    ``dp_group``: the data-parallel ranks outside ep holding the same experts (dp_replicate x
    dp_shard; None at degree 1); ``cp_group``: the context-parallel ranks (None at degree 1).
    Expert gradients: summed over ``dp_group`` and ``cp_group``, divided by dp x ep x cp. Dense
    gradients (``dense=True``): summed over ep, dp and cp, divided by dp x ep x cp; pass
    ``dense=False`` when the data-parallel reducer over the flattened dp x ep (x cp) mesh
    already averages them.

    ``compressor`` (``loom.parallel.compression.GradCompressor`` over ``dp_group``, built for
    the expert parameters in model order; ``parallel.grad_compression``): the expert gradients
    are averaged over ``dp_group`` by it, with error feedback, in one bucket, instead of the
    fp32 all-reduce; then summed over cp and divided by ep x cp, as above.
    """
    dp = dist.get_world_size(dp_group) if dp_group is not None else 1
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    holders = [(g, axis) for g, n, axis in ((dp_group, dp, "dp"), (cp_group, cp, "cp")) if n > 1]
    experts = expert_parameter_names(model)
    compressed = set()
    if compressor is not None and dp > 1:
        _reduce_compressed_experts(model, ep, experts, compressor, cp_group, cp)
        compressed = experts  # reduced: the loop below leaves them alone
    for name, param in model.named_parameters():
        if name in compressed:
            continue
        # a bf16 parameter's gradient is its fp32 ``main_grad`` (``mixed_precision``); .grad
        # is then empty, and reducing it would leave the masters' gradient unreduced
        grad = gradient_of(param)
        if grad is None:
            continue
        grad = _local_tensor(grad)  # a tp shard under expert-TP: reduced as it is
        if name in experts:
            groups = holders
        elif dense:
            groups = [(ep.group, "ep"), *holders]
        else:
            continue
        for group, axis in groups:
            comm.all_reduce(grad, group, axis=axis, ledger=ep.ledger)
        grad.div_(dp * ep.size * cp)


def _reduce_compressed_experts(model: nn.Module, ep: ExpertParallel, experts: set[str],
                               compressor: Any, cp_group: Any, cp: int) -> None:
    """``reduce_gradients``' expert half under gradient compression: every expert gradient
    (zeros for one that got no tokens, so every rank sends the same tensors) averaged over the
    compressor's group, then summed over cp and divided by ep x cp."""
    params = [p for n, p in model.named_parameters() if n in experts]
    grads = [_local_tensor(gradient_of(p, create=True)) for p in params]
    compressor.complete([compressor.launch(params, grads)])
    for grad in grads:
        if cp > 1:
            comm.all_reduce(grad, cp_group, axis="cp", ledger=ep.ledger)
        grad.div_(ep.size * cp)


def _local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def gather_expert_weights(model: nn.Module, ep: ExpertParallel) -> dict[str, torch.Tensor]:
    """The full value of every expert weight by name (collective over ``ep``: call on every ep
    rank), e.g. to save a one-file checkpoint; shards are stacked back in rank order (dim 0)."""
    experts = expert_parameter_names(model)
    out = {}
    for name, param in model.named_parameters():
        if name in experts:
            shard = param.detach()
            shard = (shard.full_tensor() if isinstance(shard, DTensor) else shard).contiguous()
            full = shard.new_empty((shard.shape[0] * ep.size, *shard.shape[1:]))
            comm.all_gather_into_tensor(full, shard, ep.group, axis="ep", ledger=ep.ledger)
            out[name] = full
    return out


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, ep: ExpertParallel,
                   tp: Any = None, pp_group: Any = None) -> torch.Tensor:
    """Global gradient norm, each element counted once, clipped to ``max_norm`` (0: only measure).

    Expert shards' squares are summed over ep; then, under tensor parallelism (``tp``, a
    ``tensor.TensorParallel``, None at tp = 1), every tp-sharded square (experts and dense)
    over tp; replicated gradients are added once; with pipeline stages (``pp_group``) the total
    is summed over pp. Returns the norm.
    """
    total = grad_squares(model, ep, tp)
    if pp_group is not None:  # each pipeline rank holds other layers
        comm.all_reduce(total, pp_group, axis="pp", ledger=ep.ledger)
    norm = total.sqrt()
    scale_local_gradients(model.parameters(), max_norm, norm)
    return norm


@torch.no_grad()
def grad_squares(model: nn.Module, ep: ExpertParallel, tp: Any = None) -> torch.Tensor:
    """``clip_grad_norm``'s squared norm before pp: expert squares over ep, then tp-sharded
    ones over tp (blocking), plus the replicated ones (the post-validated step sums this over
    pp in the background, ``loom.train.post_validation``)."""
    experts = expert_parameter_names(model)
    expert_sq, sharded_sq, replicated_sq = (torch.zeros((), dtype=torch.float32) for _ in range(3))
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        square = _local_tensor(grad).float().pow(2).sum().cpu()
        if name in experts:
            expert_sq += square
        elif isinstance(grad, DTensor) and any(p.is_shard() for p in grad.placements):
            sharded_sq += square
        else:
            replicated_sq += square
    comm.all_reduce(expert_sq, ep.group, axis="ep", ledger=ep.ledger)
    sharded_sq += expert_sq
    if tp is not None:  # under expert-TP every expert shard is a tp shard too
        comm.all_reduce(sharded_sq, tp.mesh.get_group(), axis="tp", ledger=tp.ledger)
    return sharded_sq + replicated_sq


