"""ZeRO stages 1 and 2 on ``dp_shard``: parameters replicated, optimizer state (stage 1) and also
gradients (stage 2) sharded — Loom's own sharded optimizer (stage 3 is FSDP2, ``data.py``).

Mesh axes: ``dp_shard`` (size d: the shard group; ``dp_shard x cp`` flattened under context
parallelism, whose ranks hold the same weights) and ``dp_replicate`` (HSDP: a rank's reduced
gradient slice is further averaged over it). Degree 1: ``apply_zero`` is never called (plain data
parallelism, ``GradientReducer``).

Composition. Under TP the buckets hold each rank's local tp shards (a DTensor parameter's local
tensor becomes a view of its bucket; tp-sharded and replicated parameters go to separate
buckets), so the shard group is the dp_shard ranks of one tp coordinate and nothing crosses tp
but the clipping norm's squares of tp-sharded buckets. Inside pipeline stages every stage has its
own instance, driven by the runtime (``sync`` off, ``flush`` after the stage's last backward
piece), and ``of_stages`` gives one optimizer view over a rank's stages.

Expert parallelism (ep > 1, ``expert_mesh``). Dense weights are replicated over ep as well as
dp_shard, so their buckets shard over ``dp_shard x ep`` flattened (ledger axis ``dp_shard_ep``),
TorchTitan's choice: 1/(d ep) of their moments per rank, and the same ring volume as sharding
over dp_shard plus an all-reduce over ep would move, in one collective instead of two. This ep
rank's expert weights are its own, replicated only over dp_shard: they go to separate buckets
sharded over ``dp_shard`` (ledger axis ``dp_shard``). Divisor: every slice is divided by
d x ep x dp_replicate (the data-parallel degree), the dense ones because d x ep x dp_replicate
ranks contributed, the expert ones although only d x dp_replicate did, because each rank's
expert gradient already sums the tokens of all ep ranks (the backward all-to-all), as
``expert.reduce_gradients`` divides. Clipping stays one float: dense elements are partitioned
over dp_shard x ep, expert elements over ep (experts) x dp_shard (slices), so one sum over the
dp_shard x ep group counts every element once. Under context parallelism cp joins both groups
(dense: dp_shard x ep x cp; experts: dp_shard x cp), and the divisor (cp ranks hold other tokens
of the same sequences).

Layout. Trainable parameters are packed into flat fp32 buckets (~25 MB, each holding one weight-
decay group, in reverse parameter order: the order backward produces gradients), each padded to a
multiple of d. Every parameter becomes a view into its bucket. Rank r owns slice r of every
bucket: a ``Parameter`` sharing the bucket's storage, and the only thing the (elementwise) AdamW
steps — so its two fp32 moments are 1/d of the model, and the result is exactly one process's.

bf16 parameters (``train.dtype = bf16``, ``param_dtype``): Megatron's distributed optimizer.
The buckets hold bf16; rank r's slice is an fp32 copy taken from the fp32 initial values, the
master that AdamW steps (with its fp32 moments: 12 bytes per owned element), and the step's
all-gather sends bf16 (half the bytes below). Gradients are in ``reduce_dtype``: with fp32,
stage 1's buffer is fp32 and each backward's bf16 ``.grad`` is folded into it by a hook
(``main_grad``, ``mixed_precision``), stage 2 folds into a per-parameter fp32 ``main_grad``
until packed; with bf16, autograd accumulates as in fp32 and the reduced bf16 slice is upcast
for the step only (its fp32 copy is dropped at the all-gather). Checkpoints save the masters
(``checkpoint_state``).

Collectives (wire bytes per rank, P parameters, fp32; ``grad_reduce_dtype=bf16`` halves the
reduce-scatter's):

* backward, last microbatch: when a bucket's gradients are all ready, one reduce-scatter of the
  bucket over ``dp_shard``: ``(d-1)/d * 4P`` per step (with ep: ``(n-1)/n * 4P_dense`` over
  ``dp_shard x ep``, n = d ep, plus ``(d-1)/d * 4P_experts`` over ``dp_shard``, P_experts being
  this ep rank's expert elements; the same for the all-gather below); HSDP adds an all-reduce of the slice over
  ``dp_replicate``. Stage 1 keeps a persistent full-size gradient buffer (autograd accumulates
  into views of it: 4P at rest); stage 2 keeps only its slice (4P/d at rest, see "Stage 2's
  gradients" below); with ``train.grad_reduce_every_microbatch`` the trainer leaves ``sync`` on
  for every microbatch, so stage 2 reduces after each backward (m times the reduce-scatter
  bytes) and sums the slices;
* after the optimizer step: one all-gather of every bucket over ``dp_shard``: ``(d-1)/d * 4P``;
* clipping: one scalar all-reduce over the shard group (each element's square is counted by its
  owner only; under TP two: the tp-sharded and the replicated squares), under TP one scalar
  all-reduce over tp (the tp-sharded squares), under pp one over pp.

Both stages move ``2 (d-1)/d * 4P``, the same as plain data parallelism (ZeRO §7: P_os and P_os+g
cost 2Ψ). Reduce-scatter instead of all-reduce for stage 1 too: only the owner's slice of a
reduced gradient is ever used.

Stage 2's gradients, at their peak too. Each parameter's gradient is copied into its bucket's
packing buffer as soon as autograd has accumulated it (``register_post_accumulate_grad_hook``)
and ``p.grad`` is freed there, DeepSpeed's "ipg" bucket; a bucket is reduce-scattered once full,
in bucket order (every rank launches the same collectives in the same order), and at most
``MAX_IN_FLIGHT`` reduce-scatters are outstanding: before another buffer is allocated the oldest
is waited for and its input freed (only the 4P/d output is kept). So the gradients a stage-2 rank
holds at any instant of its last backward are at most ``MAX_IN_FLIGHT + 1`` buckets beyond its
slices, not 4P. Accumulating microbatches with ``sync`` off still holds autograd's full-size
``p.grad`` until the last backward (or a pipeline stage's ``flush``, which packs bucket by bucket
and frees as it goes, so it adds one bucket); ``train.grad_reduce_every_microbatch`` avoids that.

Why hand-written: FSDP2 always shards parameters at rest, so it cannot express stages 1 and 2;
torch's ``ZeroRedundancyOptimizer`` shards whole parameters (uneven shards, no gradient sharding)
and issues its collectives where ``comm.py`` cannot count them. Flat buffers make the shards even
and every collective one call per bucket.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from loom.parallel import comm
from loom.parallel.mixed_precision import MAIN_GRAD, fold_main_grad, gradient_of, set_value
# MAX_IN_FLIGHT: reduce-scatters a rank keeps outstanding before waiting for the oldest: two
# overlap the reduction of one bucket with the packing of the next (DeepSpeed's double buffer)
# and bound the packed gradients held to three buckets (the memory formulas depend on it).
from loom.formulas.memory import MAX_IN_FLIGHT
from loom.parallel.comm import local_shard as _local
from loom.parallel.data import BUCKET_BYTES
from loom.parallel.expert import expert_parameter_names


def _tp_sharded(param: torch.Tensor) -> bool:
    """A DTensor split over tp (its local elements are its own); replicated ones are whole."""
    return any(p.is_shard() for p in getattr(param, "placements", ()))


def _as_param_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` presented like ``param``: a DTensor with its mesh and placements, or as is."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a bucket's slices are spread over: process group, size, this rank's index,
    and its name in the ledger."""

    group: Any
    size: int
    rank: int
    axis: str


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    names: list[str]
    decay: bool
    tp_sharded: bool  # its parameters are tp shards (their squares are summed over tp)
    expert: bool  # expert-parallel shards: spread over the expert shard group
    shards: ShardGroup  # the ranks that own its slices
    flat: torch.Tensor  # the parameters' storage, padded to a multiple of shards.size
    shard: nn.Parameter  # this rank's slice (a view of ``flat``, or a host copy when offloading)
    grad_flat: torch.Tensor | None = None  # stage 1: persistent full-size gradient buffer
    grad_shard: torch.Tensor | None = None  # the reduced gradient slice (persistent)
    offsets: dict[int, int] = field(default_factory=dict)  # id(param) -> its offset in ``flat``
    packed: torch.Tensor | None = None  # stage 2: the gradients being packed for reduction
    reduced: torch.Tensor | None = None  # the reduce-scatter outputs received this step, summed
    ready: int = 0
    counted: bool = True  # in the clipping norm (False: a copy another rank counts)


class ZeroShardedOptimizer:
    """Flat buckets, gradient reduce-scatter hooks and the sharded AdamW of ZeRO-1/2."""

    def __init__(self, model: nn.Module, stage: int, shard_group: Any, shard_size: int,
                 shard_rank: int, *, replicate_group: Any = None, replicate_size: int = 1,
                 reduce_dtype: torch.dtype = torch.float32, offload: bool = False,
                 ledger: comm.CommLedger | None = None, bucket_bytes: int = BUCKET_BYTES,
                 decays: Callable[[nn.Parameter], bool] = lambda p: p.ndim >= 2,
                 axis: str = "dp_shard", tp_group: Any = None,
                 experts: set[str] = frozenset(), expert_shards: ShardGroup | None = None,
                 ep_size: int = 1, param_dtype: torch.dtype = torch.float32,
                 alone: dict[str, str] | None = None) -> None:
        self.stage, self.group, self.d, self.rank = stage, shard_group, shard_size, shard_rank
        alone = alone or {}
        # bf16 parameters (train.dtype = bf16): the buckets hold bf16, each rank's slice is an
        # fp32 master copy (the distributed optimizer); gradients go to ``reduce_dtype``
        self.param_dtype = param_dtype
        self.keeps_master = param_dtype != torch.float32
        # fp32 gradients of bf16 parameters are accumulated outside autograd (``main_grad``)
        self._main_grads = self.keeps_master and reduce_dtype == torch.float32
        self.axis = axis  # the ledger's name of the shard group
        self.dense_shards = ShardGroup(shard_group, shard_size, shard_rank, axis)
        # Expert parallelism: the expert weights (``experts``, by name) are this ep rank's own,
        # replicated only over ``expert_shards`` (dp_shard); their gradients arrive summed over
        # the ep ranks' tokens, so every gradient is divided by d x dp_replicate x ep in the end.
        self.expert_shards = expert_shards or self.dense_shards
        self.ep_size = ep_size
        self.pp_group: Any = None  # set on the merged view of a rank's stages (``of_stages``)
        self.tp_group = tp_group  # tensor parallelism: parameters are DTensors, buckets local
        self.replicate_group, self.replicate_size = replicate_group, replicate_size
        self.reduce_dtype, self.offload, self.ledger = reduce_dtype, offload, ledger
        self.sync = True
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.buckets: list[_Bucket] = []
        kinds = [(decay, sharded, expert) for expert in (False, True)
                 for decay in (True, False) for sharded in (True, False)]
        for decay, sharded, expert in kinds:
            group = [(n, p) for n, p in reversed(named) if decays(p) == decay
                     and _tp_sharded(p) == sharded and (n in experts) == expert]
            current: list[tuple[str, nn.Parameter]] = []
            size = 0
            for name, param in group:
                if name in alone:  # a bucket of its own, under its global name
                    self._add_bucket([(alone[name], param)], decay, sharded, expert)
                    continue
                current.append((name, param))
                size += _local(param).numel() * param.element_size()
                if size >= bucket_bytes:
                    self._add_bucket(current, decay, sharded, expert)
                    current, size = [], 0
            if current:
                self._add_bucket(current, decay, sharded, expert)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0  # the next bucket to launch: every rank launches in bucket order
        self._in_flight: deque[tuple[_Bucket, Any, torch.Tensor]] = deque()
        self._end_queued = False  # the end-of-backward flush is queued for this backward
        # bf16 parameters, fp32 gradients: each backward's bf16 ``.grad`` is added into the fp32
        # ``main_grad`` (stage 1: a view of the bucket's fp32 buffer), before the hook below
        self._hooks = [p.register_post_accumulate_grad_hook(fold_main_grad)
                       for b in self.buckets for p in b.params] if self._main_grads else []
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_gradient_ready)
                       for b in self.buckets for p in b.params]

    def _add_bucket(self, named: list[tuple[str, nn.Parameter]], decay: bool,
                    tp_sharded: bool, expert: bool) -> None:
        params = [p for _, p in named]
        shards = self.expert_shards if expert else self.dense_shards
        d, rank = shards.size, shards.rank
        locals_ = [_local(p) for p in params]  # under TP: each rank's shard of the DTensor
        numel = sum(t.numel() for t in locals_)
        padded = -(-numel // d) * d
        flat = torch.zeros(padded, dtype=params[0].dtype, device=locals_[0].device)
        offset, offsets = 0, {}
        for param, local in zip(params, locals_):  # the values, packed
            offsets[id(param)] = offset
            flat[offset:offset + local.numel()].view_as(local).copy_(local.detach())
            offset += local.numel()
        piece = flat[rank * padded // d:(rank + 1) * padded // d]
        if self.keeps_master:  # the fp32 slice is the master; the parameters live in bf16
            shard = nn.Parameter(piece.to("cpu" if self.offload else piece.device, copy=True))
            flat = flat.to(self.param_dtype)
        else:
            shard = nn.Parameter(piece.to("cpu", copy=True) if self.offload else piece)
        for param, local in zip(params, locals_):  # each parameter becomes a view of the bucket
            offset = offsets[id(param)]
            view = flat[offset:offset + local.numel()].view_as(local)
            if self.keeps_master:  # a new dtype: the tensor (and a DTensor's wrapper) changes
                set_value(param, _as_param_like(view, param))
            elif local is param:
                param.data = view
            else:  # a DTensor: ``.data`` would not share storage; its local tensor does
                param._local_tensor = view
        bucket = _Bucket(params, [n for n, _ in named], decay, tp_sharded, expert, shards, flat,
                         shard, offsets=offsets)
        if self.stage == 1:  # autograd accumulates straight into views of one buffer
            bucket.grad_flat = torch.zeros_like(flat, dtype=self.reduce_dtype
                                                if self.keeps_master else flat.dtype)
            offset = 0
            for param, local in zip(params, locals_):
                grad = _as_param_like(
                    bucket.grad_flat[offset:offset + local.numel()].view_as(local), param)
                if self._main_grads:  # fp32 buffer, bf16 parameter: the fold hook adds into it
                    setattr(param, MAIN_GRAD, grad)
                else:
                    param.grad = grad
                offset += local.numel()
        elif self._main_grads:  # stage 2: accumulated in fp32 until packed
            for param in params:
                setattr(param, MAIN_GRAD, None)
        piece = slice(rank * padded // d, (rank + 1) * padded // d)
        # the reduced slice, in the gradients' dtype (bf16 parameters: ``reduce_dtype``; a bf16
        # slice is upcast for the optimizer step only, ``finish`` / ``gather_parameters``)
        bucket.grad_shard = (bucket.grad_flat[piece] if bucket.grad_flat is not None  # no copy
                             else torch.zeros(padded // d, dtype=self.reduce_dtype
                                              if self.keeps_master else flat.dtype,
                                              device=flat.device))
        self.buckets.append(bucket)

    # -- backward -------------------------------------------------------------------------------
    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        if self._next == len(self.buckets):  # every bucket went out: this is the next backward
            self._next = 0
        if not self._end_queued:  # launch what this backward leaves (unused parameters) at its end
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True
        bucket = self._bucket_of[id(param)]
        if self.stage == 2:
            self._pack(bucket, param)
        bucket.ready += 1
        while self._next < len(self.buckets) and \
                self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self.flush()

    def _pack(self, bucket: _Bucket, param: nn.Parameter) -> None:
        """Stage 2: copy ``param``'s gradient into its bucket's packing buffer and free it."""
        grad = gradient_of(param)  # fp32 ``main_grad`` of a bf16 parameter, or ``.grad``
        if grad is None:
            return
        if bucket.packed is None:  # zeros: the padding, and parameters that got no gradient
            self._bound_in_flight()
            bucket.packed = torch.zeros_like(bucket.flat, dtype=self.reduce_dtype
                                             if self.keeps_master else bucket.flat.dtype)
        grad = _local(grad).reshape(-1)
        offset = bucket.offsets[id(param)]
        bucket.packed[offset:offset + grad.numel()].copy_(grad)
        param.grad = None
        if hasattr(param, MAIN_GRAD):
            setattr(param, MAIN_GRAD, None)

    def _bound_in_flight(self) -> None:
        while len(self._in_flight) >= MAX_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        """Wait for the oldest outstanding reduce-scatter; its packed input is freed with the
        work, and its output is added to the bucket's slices received this step."""
        bucket, work, out = self._in_flight.popleft()
        work.wait()
        if bucket.reduced is None:
            bucket.reduced = out
        else:  # a reduction per microbatch: the microbatches' slices are summed in fp32
            bucket.reduced = bucket.reduced.float().add_(out)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.grad_flat is not None:  # stage 1: the gradients already are the buffer
            if self._main_grads:  # what a hook did not see (a pipeline W step) joins it
                for param in bucket.params:
                    gradient_of(param)
            flat = bucket.grad_flat
        else:  # stage 2: what the hooks have not packed (a flush after ``sync`` off) joins
            for param in bucket.params:
                self._pack(bucket, param)
            flat = bucket.packed if bucket.packed is not None else torch.zeros_like(bucket.flat)
            bucket.packed = None
        self._bound_in_flight()
        send = flat.to(self.reduce_dtype)
        del flat
        shards = bucket.shards
        out = torch.empty(send.numel() // shards.size, dtype=self.reduce_dtype,
                          device=send.device)
        work = comm.reduce_scatter_tensor(out, send, shards.group, axis=shards.axis,
                                          ledger=self.ledger, async_op=True)
        self._in_flight.append((bucket, work, out))
        bucket.ready = 0
        self._next += 1

    def flush(self) -> None:
        """Launch every bucket not launched yet: the unused parameters' after a backward, or all
        of them when the gradients were accumulated with ``sync`` off (a pipeline stage after its
        last backward piece, which may be a W that the accumulate hooks never see)."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])

    def finish(self) -> None:
        """Reduce what backward did not reach (unused parameters), wait, average the slices and
        hand them to the optimizer's shard parameters as their gradients."""
        self.flush()
        while self._in_flight:
            self._complete_oldest()
        for bucket in self.buckets:
            reduced, bucket.reduced = bucket.reduced, None
            if self.replicate_size > 1:
                comm.all_reduce(reduced, self.replicate_group, axis="dp_replicate",
                                ledger=self.ledger)
            # d is the dense group's size (dp_shard, or dp_shard x ep): one divisor for
            # both kinds, since an expert's slice is summed over dp_shard only but each
            # rank's expert gradient already sums the tokens of all ep ranks
            bucket.grad_shard.copy_(reduced).div_(self.d * self.replicate_size)
            bucket.shard.grad = bucket.grad_shard.to(bucket.shard.device, bucket.shard.dtype)
        self._next = 0

    def leave_out_of_norm(self, name: str | None = None) -> None:
        """These parameters (all, or the one bucketed alone under ``name``) are a copy whose
        gradient another rank holds and counts (a pipeline route's replica after the runtime's
        copy sum; a tied head after the tie sum): ``clip_grad_norm`` leaves their slices'
        squares out and still scales them by the same factor, so the copies stay identical."""
        for bucket in self.buckets if name is None else [self._alone(name)]:
            bucket.counted = False

    def _alone(self, name: str) -> _Bucket:
        (bucket,) = [b for b in self.buckets if b.names == [name]]
        return bucket

    def alone_gradient(self, name: str) -> torch.Tensor:
        """After ``finish``: this rank's reduced gradient slice of the parameter bucketed alone
        under ``name`` (``alone``), the tensor the optimizer steps. Two such parameters of one
        shape (a tied embedding's two copies on two pipeline stages) are padded and sliced
        alike on every dp_shard rank, so their slices line up element by element."""
        return self._alone(name).shard.grad

    # -- optimizer ------------------------------------------------------------------------------
    def build_optimizer(self, *, lr: float, weight_decay: float, betas: tuple[float, float],
                        eps: float) -> torch.optim.AdamW:
        """AdamW over this rank's slices (decay and no-decay groups, as ``optim.build_optimizer``);
        after each step the updated slices are all-gathered into every rank's parameters."""
        groups = [{"params": [b.shard for b in self.buckets if b.decay],
                   "weight_decay": weight_decay},
                  {"params": [b.shard for b in self.buckets if not b.decay],
                   "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                      eps=eps, **adamw_kernel([b.shard for b in self.buckets]))
        optimizer.register_step_post_hook(lambda *_: self.gather_parameters())
        plain_zero_grad = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:  # + stage 1's accumulation buffer
            plain_zero_grad(set_to_none)
            for bucket in self.buckets:
                if bucket.grad_flat is not None:
                    bucket.grad_flat.zero_()
                elif self._main_grads:  # stage 2: nothing accumulated is kept
                    for param in bucket.params:
                        setattr(param, MAIN_GRAD, None)

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        return optimizer

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather the updated slices into every rank's parameters. (Stage 1's gradient buffer
        is cleared by the optimizer's ``zero_grad``, so the reduced slice, which lives in it,
        stays readable until the next step.)"""
        for bucket in self.buckets:
            if bucket.shard.grad is not None and bucket.grad_shard.dtype != bucket.shard.dtype:
                # a bf16 gradient slice: its fp32 copy was the step's; the (clipped) values
                # stay readable in the slice, the copy goes
                bucket.grad_shard.copy_(bucket.shard.grad)
                bucket.shard.grad = None
            mine = bucket.shard.detach().to(bucket.flat.device, bucket.flat.dtype, copy=True)
            comm.all_gather_into_tensor(bucket.flat, mine, bucket.shards.group,
                                        axis=bucket.shards.axis, ledger=self.ledger)

    @torch.no_grad()
    def masters_from_parameters(self) -> None:
        """Set every rank's slice from its bucket's values (after weights were written into the
        parameters: a pretrained load). With bf16 parameters the fp32 masters take their bf16
        rounding; with fp32 ones and no offload the slice already is a view: nothing to do."""
        for bucket in self.buckets:
            if bucket.shard.untyped_storage().data_ptr() != \
                    bucket.flat.untyped_storage().data_ptr():
                per_rank, rank = bucket.flat.numel() // bucket.shards.size, bucket.shards.rank
                bucket.shard.data.copy_(bucket.flat[rank * per_rank:(rank + 1) * per_rank])

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global-norm clipping of the reduced slices (padding is zero; every element once):
        squares summed over the shard group; under TP the tp shards' also over tp (replicated
        parameters are whole on every tp rank: counted once); over pp for a rank's stages."""
        squares = torch.zeros(2, dtype=torch.float32, device=self.buckets[0].flat.device)
        for bucket in self.buckets:  # [tp-sharded, whole]; a copy's squares are counted elsewhere
            if bucket.counted:
                squares[0 if bucket.tp_sharded else 1] += \
                    bucket.shard.grad.float().pow(2).sum().to(squares.device)
        if self.tp_group is None:  # nothing to tell apart: one float on the wire
            squares = squares.sum().reshape(1)
        comm.all_reduce(squares, self.group, axis=self.axis, ledger=self.ledger)
        if self.tp_group is not None:
            comm.all_reduce(squares[:1], self.tp_group, axis="tp", ledger=self.ledger)
        squares = squares.sum().reshape(1)
        if self.pp_group is not None:  # a rank's pipeline stages: the other stages' squares
            comm.all_reduce(squares, self.pp_group, axis="pp", ledger=self.ledger)
        norm = squares.sqrt()[0]
        if max_norm > 0:
            torch._foreach_mul_([b.shard.grad for b in self.buckets],
                                torch.clamp(max_norm / (norm + 1e-6), max=1.0).item())
        return norm

    def full_named_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's reduced (and clipped) gradient by name: the slices all-gathered
        (a collective over the shard group, and over tp for DTensors; for tests and
        inspection)."""
        out = {}
        for bucket in self.buckets:
            grad = bucket.shard.grad if bucket.shard.grad is not None else bucket.grad_shard
            full = torch.empty_like(bucket.flat, dtype=grad.dtype)
            comm.all_gather_into_tensor(full, grad.to(full.device).contiguous(),
                                        bucket.shards.group, axis=bucket.shards.axis)
            offset = 0
            for name, param in zip(bucket.names, bucket.params):
                local = _local(param)
                grad = _as_param_like(full[offset:offset + local.numel()].view_as(local), param)
                out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).clone()
                offset += local.numel()
        return out


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation for ``params``, as keyword arguments: ``fused`` (one kernel per
    tensor list: each element read and written once, about 3x faster than ``foreach`` on the
    CPU for the tiny model) where torch has it for the device and the list is homogeneous, else
    torch's default. Elementwise either way, so a flat ZeRO slice steps exactly as the
    parameters it holds; ``build_optimizer`` and ZeRO-1/2 both take it from here so that every
    layout runs the same kernel as the one-process reference (fused and foreach differ in the
    last bit). Not fused: a list mixing DTensor (tensor-parallel) and plain tensors, as with
    tp > 1 and a replicated embedding, which neither multi-tensor path takes; meta tensors.
    ``loom.formulas.memory.adamw_step_fused`` predicts this from the layout for the memory
    estimator and the planner (the fused step has no temporaries); tests/dist's
    test_fused_step_rule checks the two agree."""
    if not params:
        return {}
    kinds = {type(p).__name__ == "DTensor" for p in params}
    devices = {p.device.type for p in params}
    fusable = set(_get_fused_kernels_supported_devices())
    if (len(kinds) == 1 and len(devices) == 1 and devices <= fusable
            and all(torch.is_floating_point(p) for p in params)):
        return {"fused": True}
    return {}


def apply_zero(model: nn.Module, stage: int, shard_mesh: Any, replicate_mesh: Any | None, *,
               axis: str = "dp_shard", reduce_dtype: torch.dtype = torch.float32,
               offload: bool = False, ledger: comm.CommLedger | None = None,
               tp_group: Any = None, experts: tuple[Any, str] | None = None, ep_size: int = 1,
               bucket_bytes: int = BUCKET_BYTES,
               param_dtype: torch.dtype = torch.float32,
               alone: dict[str, str] | None = None) -> ZeroShardedOptimizer:
    """ZeRO-1/2 of ``model`` over ``shard_mesh`` (``dp_shard``, ``dp_shard x cp`` or, under
    expert parallelism, ``dp_shard x ep`` flattened) and ``replicate_mesh`` (``dp_replicate``;
    None: no averaging across replicas, an outer dp mode's);
    ``tp_group``: the model's tensor-parallel group (its DTensor parameters are bucketed by
    local shard); ``experts``: with ``ep_size`` > 1, the 1-D mesh the expert weights (already
    cut to this ep rank's experts) shard over, ``dp_shard`` or ``dp_shard x cp``, and its ledger
    name; ``param_dtype`` bf16: bf16 parameters, fp32 master slices (``train.dtype = bf16``);
    ``alone``: parameters (by name in ``model``) that get a bucket of their own, named by
    the value (a tied embedding's copies, under their one global name).
    Returns the sharded optimizer, which also reduces the gradients."""
    names, expert_shards = frozenset(), None
    if experts is not None:
        (mesh, expert_axis), names = experts, frozenset(expert_parameter_names(model))
        expert_shards = ShardGroup(mesh.get_group(), mesh.size(), mesh.get_local_rank(),
                                   expert_axis)
    return ZeroShardedOptimizer(
        model, stage, shard_mesh.get_group(), shard_mesh.size(), shard_mesh.get_local_rank(),
        replicate_group=replicate_mesh.get_group() if replicate_mesh is not None else None,
        replicate_size=replicate_mesh.size() if replicate_mesh is not None else 1,
        reduce_dtype=reduce_dtype, offload=offload, ledger=ledger, axis=axis, tp_group=tp_group,
        experts=names, expert_shards=expert_shards, ep_size=ep_size, bucket_bytes=bucket_bytes,
        param_dtype=param_dtype, alone=alone)


def of_stages(parts: list[Any], pp_group: Any) -> ZeroShardedOptimizer | None:
    """One ZeRO-1/2 optimizer over the buckets of a rank's pipeline stages, given each stage's
    reducer (None unless every one is ZeRO-1/2's). Each stage keeps its own instance, hooks and
    ``flush`` (the runtime reduces a stage's gradients within its last backward piece); this
    view, with the same shard group, steps, gathers and clips them together, and sums the
    clipping norm over ``pp_group``."""
    if not parts or not all(isinstance(p, ZeroShardedOptimizer) for p in parts):
        return None
    if len(parts) == 1 and pp_group is None:  # one stage, the whole model (pp = 1)
        return parts[0]
    merged = copy.copy(parts[0])
    merged.buckets = [bucket for part in parts for bucket in part.buckets]
    merged._bucket_of = {id(p): b for b in merged.buckets for p in b.params}
    merged._hooks = []  # the stages' own hooks drive the reduction
    merged.pp_group = pp_group
    return merged

