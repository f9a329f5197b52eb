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
and serves dense and (with a different group) expert parameters alike. Sharded data parallelism
(ZeRO / FSDP2) will live beside it.
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
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.group, self.size, self.ledger, self.axis = group, size, ledger, axis
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
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.size)
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
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._reset()


def apply_data_parallel(model: nn.Module, group: Any, size: int, *,
                        ledger: comm.CommLedger | None = None, axis: str = "dp") -> nn.Module:
    """Attach a ``GradientReducer`` over ``group`` to ``model``; identity at degree 1."""
    if size > 1:
        model._loom_grad_reducer = GradientReducer(list(model.parameters()), group, size,
                                                   ledger=ledger, axis=axis)
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


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model (data parallelism no longer wraps it; kept for call sites' clarity)."""
    return model
