"""Data parallelism: gradients averaged over the data-parallel group, bucketed and overlapped.

Mesh axes: the flattened ``dp`` mesh (dp_replicate x dp_shard x ep), or ``dp_cp`` (the same plus
``cp``) when context parallelism is on — a cp rank holds the same weights and a different part of
the sequence, so its gradients are averaged like a data-parallel replica's.

Forward: nothing. Backward: one all-reduce (sum, then divide by the group size; gloo has no
average) of every gradient over the group: ``2 (d-1)/d * 4P`` wire bytes per rank per step for P
fp32 parameters. Gradients are packed into ~25 MB buckets in reverse parameter order (the order
backward produces them); a post-accumulate-grad hook launches a bucket's asynchronous all-reduce
as soon as its last gradient is ready, so communication overlaps the rest of the backward pass.
Buckets are always launched in the same order on every rank (a bucket waits for the earlier ones),
which keeps the collectives matched even when a parameter received no gradient (then zeros are
sent for it at the end). ``no_gradient_sync`` turns the hooks off for all but the last microbatch
of a gradient-accumulation step; ``finish_gradient_sync`` waits for the reductions and writes the
averages back. Degree 1: nothing is attached.

Why not torch's ``DistributedDataParallel``: it rejects DTensor parameters, so it cannot follow
tensor parallelism (torch 2.13's workaround drops them from reduction), and its collectives are
issued inside its C++ reducer where ``loom.parallel.comm`` cannot count them. This reducer works on
each parameter's *local* gradient (``DTensor._local_tensor`` under TP), goes through ``comm.py``,
and serves dense and (with a different group) expert parameters alike.

Sharded data parallelism on ``dp_shard`` (ZeRO) lives beside it: stage 3 here through FSDP2
(``apply_fully_shard``), stages 1 and 2 in ``loom.parallel.zero`` (Loom's own sharded optimizer).

ZeRO-3 (FSDP2, ``fully_shard`` per transformer block, then the root): mesh ``dp_shard``, or the
2-D ``(dp_replicate, dp_shard)`` mesh for HSDP (replicate over the first, shard over the second);
under TP the parameters are already DTensors on ``tp`` and FSDP2 adds the data dims (TorchTitan's
2-D composition). Per block, forward: one all-gather of its parameters, ``(d-1)/d * 4P_block``
wire bytes, freed after the block (``reshard_after_forward``); backward: the same all-gather again,
then one reduce-scatter of its gradients, ``(d-1)/d * 4P_block``; HSDP adds the all-reduce of the
gradient shard over ``dp_replicate``. Per step ``3 (d-1)/d * 4P`` against plain data
parallelism's ``2 (d-1)/d * 4P``: ZeRO's 1.5x (per microbatch the two all-gathers repeat; the
reduce-scatter runs on the last microbatch only, so m microbatches move ``(2m+1)/2`` times plain
data parallelism's bytes — the pipeline's breadth-first motive). The next block's all-gather is prefetched (issued
before the current block computes; on a GPU it runs on its own stream). FSDP2's collectives go
through ``comm.py`` (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), so the ledger
counts them like Loom's own. gloo has no ``PREMUL_SUM`` / ``AVG``: reductions are forced to
``SUM`` and FSDP2 divides by the data-parallel size afterwards (the average).

Why FSDP2 for stage 3: per-parameter DTensor sharding composes with TP and with DCP (checkpoints
reshard across layouts by name), and its gather/free/prefetch machinery is what stage 3 needs.
Why not for stages 1 and 2: FSDP2 always shards the parameters at rest (``reshard_after_forward=
False`` gives stage 2's traffic, not its memory), so the replicated-parameter stages are Loom's.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Sequence

import torch
from torch import nn

from loom.parallel import comm

BUCKET_BYTES = 25 * 2**20


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own storage of a (possibly DTensor) tensor."""
    return getattr(tensor, "_local_tensor", tensor)


class GradientReducer:
    """Averages the gradients of ``params`` over ``group`` (``size`` ranks) after backward."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, size: int, *,
                 ledger: comm.CommLedger | None = None, axis: str = "dp",
                 bucket_bytes: int = BUCKET_BYTES,
                 reduce_dtype: torch.dtype = torch.float32) -> None:
        self.group, self.size, self.ledger, self.axis = group, size, ledger, axis
        self.reduce_dtype = reduce_dtype  # bf16: half the bytes, gradients summed in bf16
        self.sync = True
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        current_bytes = 0
        for param in reversed([p for p in params if p.requires_grad]):
            current.append(param)
            current_bytes += _local(param).numel() * _local(param).element_size()
            if current_bytes >= bucket_bytes:
                self.buckets.append(current)
                current, current_bytes = [], 0
        if current:
            self.buckets.append(current)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient_ready)
                       for bucket in self.buckets for p in bucket]
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to launch: launches happen in bucket order only
        self._pending: list[tuple[Any, torch.Tensor, list[torch.Tensor]]] = []

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        self._ready[self._bucket_of[id(param)]] += 1
        while self._next < len(self.buckets) and \
                self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        grads = []
        for param in self.buckets[index]:
            if param.grad is None:  # unused this step here, maybe used elsewhere: send zeros
                param.grad = torch.zeros_like(param)
            grads.append(_local(param.grad))
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.size).to(self.reduce_dtype)
        work = comm.all_reduce(flat, self.group, axis=self.axis, ledger=self.ledger,
                               async_op=True)
        self._pending.append((work, flat, grads))
        self._next = index + 1

    def finish(self) -> None:
        """Launch what backward did not (unused parameters), wait, write the averages back."""
        while self._next < len(self.buckets):
            self._launch(self._next)
        for work, flat, grads in self._pending:
            work.wait()
            copy_back(flat, grads)
        self._reset()


def copy_back(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    """Write a reduced flat buffer back into the gradients it was packed from, in order."""
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def apply_data_parallel(model: nn.Module, group: Any, size: int, *,
                        ledger: comm.CommLedger | None = None, axis: str = "dp",
                        reduce_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Attach a ``GradientReducer`` over ``group`` to ``model``; identity at degree 1."""
    if size > 1:
        model._loom_grad_reducer = GradientReducer(list(model.parameters()), group, size,
                                                   ledger=ledger, axis=axis,
                                                   reduce_dtype=reduce_dtype)
    return model


def _reducer(model: nn.Module) -> GradientReducer | None:
    return getattr(model, "_loom_grad_reducer", None)


@contextlib.contextmanager
def _sync_off(reducer: GradientReducer):
    reducer.sync = False
    try:
        yield
    finally:
        reducer.sync = True


def no_gradient_sync(model: nn.Module) -> ContextManager:
    """Skip the reduction for all but the last microbatch of a gradient-accumulation step."""
    reducer = _reducer(model)
    return _sync_off(reducer) if reducer is not None else contextlib.nullcontext()


def finish_gradient_sync(model: nn.Module) -> None:
    """Wait for this step's gradient reductions (call before clipping and the optimizer step)."""
    reducer = _reducer(model)
    if reducer is not None:
        reducer.finish()


class _CountedAllGather:
    """FSDP2's all-gather, issued through ``comm.py`` so the ledger counts it."""

    def __init__(self, ledger: comm.CommLedger | None, axis: str) -> None:
        self.ledger, self.axis = ledger, axis

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return comm.all_gather_into_tensor(output_tensor, input_tensor, group, axis=self.axis,
                                           ledger=self.ledger, async_op=async_op)


class _CountedReduceScatter(_CountedAllGather):
    """FSDP2's reduce-scatter, issued through ``comm.py``."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return comm.reduce_scatter_tensor(output_tensor, input_tensor, group, axis=self.axis,
                                          ledger=self.ledger, op=op, async_op=async_op)


class _FullyShardedSync:
    """``no_gradient_sync`` / ``finish_gradient_sync`` for an FSDP2 model: ``sync = False`` keeps
    the unsharded gradients of the non-final microbatches (no reduce-scatter); FSDP2 waits for its
    reductions at the end of backward, so ``finish`` has nothing left to do."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def sync(self) -> bool:
        return True

    @sync.setter
    def sync(self, value: bool) -> None:
        self._model.set_requires_gradient_sync(value)

    def finish(self) -> None:
        pass


def apply_fully_shard(model: nn.Module, mesh: Any, *, reshard_after_forward: bool = True,
                      param_dtype: torch.dtype | None = None,
                      reduce_dtype: torch.dtype = torch.float32, offload_optimizer: bool = False,
                      ledger: comm.CommLedger | None = None, axis: str = "dp_shard") -> nn.Module:
    """ZeRO-3 with FSDP2 over ``mesh`` (1-D ``dp_shard`` or 2-D ``(dp_replicate, dp_shard)``).

    One FSDP unit per transformer block (gathered just in time, freed after use) and one for the
    rest (embedding, final norm, head: the root). ``param_dtype``: the compute dtype of the
    gathered parameters (bf16 mixed precision; the sharded fp32 values are the master weights);
    ``reduce_dtype``: the dtype of the reduce-scatter. ``offload_optimizer``: FSDP2's CPU offload
    (sharded parameters, gradients and the optimizer step on the host; for accelerators).
    """
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if offload_optimizer else OffloadPolicy()
    blocks = list(model.layers.values()) if hasattr(model, "layers") else []
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy, offload_policy=offload)
    # The root (embedding, final norm, head) follows the same rule. TorchTitan keeps it gathered
    # (its backward starts right away), saving one all-gather of the root; resharding it keeps
    # the step's traffic exactly ZeRO-3's 3 x Psi and its memory exactly 1/d.
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                offload_policy=offload)
    for unit in [*blocks, model]:
        unit.set_force_sum_reduction_for_comms(True)  # gloo: SUM, then FSDP2 divides by dp
        unit.set_custom_all_gather(_CountedAllGather(ledger, axis))
        unit.set_custom_reduce_scatter(_CountedReduceScatter(ledger, axis))
    # Explicit prefetch: the next block's all-gather is issued before this one computes.
    for current, following in zip(blocks, blocks[1:]):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])
    model._loom_grad_reducer = _FullyShardedSync(model)
    return model


def is_fully_sharded(model: nn.Module) -> bool:
    return isinstance(getattr(model, "_loom_grad_reducer", None), _FullyShardedSync)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model (data parallelism no longer wraps it; kept for call sites' clarity)."""
    return model
