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
sent for it at the end). Its ``sync`` off accumulates microbatches locally (the pipeline
runtime turns it on for a stage's last backward piece, or ``flush``es after a W); ``finish``
waits for the reductions and writes the averages back. Degree 1: no reducer.

Gradient compression (``parallel.grad_compression``, ``loom.parallel.compression``): a
``GradCompressor`` replaces a bucket's fp32 all-reduce by its compressed collectives (int8 or
top-k all-gathers, PowerSGD's two all-reduces) with error feedback, launched from the same hook;
``finish`` lets it decode and write the averages back. ``none`` leaves this path untouched.

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
data parallelism's bytes). Pipeline stages can instead stay gathered across the whole step
(``reshard_after_backward=False``; the runtime ``flush``es after the stage's last backward piece):
one all-gather and one reduce-scatter per step, ``2 (d-1)/d * 4P_stage``, plain data
parallelism's bytes (the breadth-first insight). The next block's all-gather is prefetched
(issued before the current block computes; on a GPU it runs on its own stream). FSDP2's
all-gathers and reduce-scatters go through ``comm.py`` (``set_custom_all_gather`` /
``set_custom_reduce_scatter``), so the ledger counts them like Loom's own; HSDP's all-reduce is
recorded by an all-reduce hook (``_CountedReplicateAllReduce``). gloo has no ``PREMUL_SUM`` /
``AVG``: reductions are forced to ``SUM`` and FSDP2 divides by the data-parallel size afterwards
(the average).

Why FSDP2 for stage 3: per-parameter DTensor sharding composes with TP and with DCP (checkpoints
reshard across layouts by name), and its gather/free/prefetch machinery is what stage 3 needs.
Why not for stages 1 and 2: FSDP2 always shards the parameters at rest (``reshard_after_forward=
False`` gives stage 2's traffic, not its memory), so the replicated-parameter stages are Loom's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from loom.formulas.memory import BUCKET_BYTES  # the memory formulas depend on it too
from loom.models.moe import GroupedExperts
from loom.parallel import comm
from loom.parallel.comm import local_shard as _local
from loom.parallel.compression import (CompressionSpec, GradCompressor, build_compressor,
                                        copy_back)
from loom.parallel.mixed_precision import gradient_of


class GradientReducer:
    """Averages the gradients of ``params`` over ``group`` (``size`` ranks) after backward.

    ``compression``: what each bucket sends (``loom.parallel.compression``; None or ``none``:
    the fp32 all-reduce); ``seed`` seeds PowerSGD's warm-start Q, the same on every rank."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, size: int, *,
                 ledger: comm.CommLedger | None = None, axis: str = "dp",
                 bucket_bytes: int = BUCKET_BYTES,
                 reduce_dtype: torch.dtype = torch.float32,
                 compression: CompressionSpec | None = None, seed: int = 0) -> None:
        self.group, self.size, self.ledger, self.axis = group, size, ledger, axis
        self.compression, self.seed = compression, seed
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
        self._hooks = {id(p): p.register_post_accumulate_grad_hook(self._on_gradient_ready)
                       for bucket in self.buckets for p in bucket}
        self._build_compressor()
        self._reset()

    def _build_compressor(self) -> None:
        """The compressor's state is per tensor, in bucket order (its checkpoint slots)."""
        self.compressor: GradCompressor | None = build_compressor(
            [p for bucket in self.buckets for p in bucket], self.group, self.size,
            self.compression, ledger=self.ledger, axis=self.axis, seed=self.seed)

    def drop(self, params: Sequence[nn.Parameter]) -> None:
        """Stop reducing ``params``: a pipeline rank that holds both ends of a tied embedding
        shares one Parameter between two stages, and only the first stage's reducer keeps it."""
        ids = {id(p) for p in params}
        self.buckets = [kept for bucket in self.buckets
                        if (kept := [p for p in bucket if id(p) not in ids])]
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        for key in ids & set(self._hooks):
            self._hooks.pop(key).remove()
        self._build_compressor()  # before any step: nothing accumulated is lost
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._next = 0  # the next bucket to launch: launches happen in bucket order only
        self._pending: list[Any] = []  # (work, flat, grads), or the compressor's buckets

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        if not self.sync:
            return
        self._ready[self._bucket_of[id(param)]] += 1
        while self._next < len(self.buckets) and \
                self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        # unused this step here, maybe used elsewhere: zeros are sent; a bf16 parameter's
        # gradient is its fp32 ``main_grad`` (``mixed_precision``)
        grads = [_local(gradient_of(param, create=True)) for param in self.buckets[index]]
        if self.compressor is not None:
            self._pending.append(self.compressor.launch(self.buckets[index], grads))
            self._next = index + 1
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.size).to(self.reduce_dtype)
        work = comm.all_reduce(flat, self.group, axis=self.axis, ledger=self.ledger,
                               async_op=True)
        self._pending.append((work, flat, grads))
        self._next = index + 1

    def flush(self) -> None:
        """Launch every bucket not launched yet: the unused parameters' after a backward, or all
        of them when the gradients were accumulated with ``sync`` off (a pipeline stage's last
        backward piece, which may be a W that autograd's accumulate hooks never see)."""
        while self._next < len(self.buckets):
            self._launch(self._next)

    def finish(self) -> None:
        """Launch what backward did not (unused parameters), wait, write the averages back."""
        self.flush()
        if self.compressor is not None:
            self.compressor.complete(self._pending)
            self._reset()
            return
        for work, flat, grads in self._pending:
            work.wait()
            copy_back(flat, grads)
        self._reset()


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


class _CountedReplicateAllReduce:
    """HSDP's all-reduce of each reduced gradient shard over ``dp_replicate``, counted. FSDP2
    issues that collective itself (there is no custom-collective seam for it, unlike the gather
    and the reduce-scatter); its all-reduce hook runs right after it on the same buffer, so the
    hook records the call and its bytes and does nothing else."""

    def __init__(self, ledger: comm.CommLedger, size: int) -> None:
        self.ledger, self.size = ledger, size

    def __call__(self, reduced: torch.Tensor) -> None:
        payload = reduced.numel() * reduced.element_size()
        self.ledger.add("dp_replicate", "all_reduce", payload,
                        2 * (self.size - 1) / self.size * payload)


class FullyShardedSync:
    """The gradient synchronisation of an FSDP2 model (what ``apply_fully_shard`` returns).

    ``sync = False`` keeps the unsharded gradients of the non-final microbatches (no
    reduce-scatter) and tells FSDP2 the next backward is not the last. FSDP2 waits for its
    reductions at the end of the last backward, so ``finish`` has nothing left to do.

    Pipeline stages (``loom.pipeline.runtime``) accumulate every backward piece with ``sync``
    off, then call ``flush`` once after the stage's last piece of the step: it runs FSDP2's
    post-backward of every unit by hand (reduce-scatter, plus HSDP's all-reduce) and reshards.
    By hand because a W piece (Zero Bubble's weight gradient) computes its gradients with
    ``autograd.grad`` from saved intermediates, outside the module hooks that would fire FSDP2's
    post-backward, and after the I piece that already passed them. ``per_microbatch``: False
    keeps the stage's parameters gathered from its first F to ``flush`` (one all-gather per
    step); True lets FSDP2 reshard after every forward and backward (one per F and per B).
    """

    def __init__(self, model: nn.Module, per_microbatch: bool = True) -> None:
        self._model = model
        self.per_microbatch = per_microbatch
        self._sync = True

    @property
    def sync(self) -> bool:
        return self._sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self._model.set_requires_gradient_sync(value)
        self._model.set_is_last_backward(value)
        self._sync = value

    def flush(self) -> None:
        """Reduce the gradients accumulated with ``sync`` off, now (after a backward with
        ``sync`` on FSDP2 has reduced them itself); then reshard."""
        from torch.distributed.fsdp import fully_shard

        if not self._sync:
            self.sync = True
            state = fully_shard.state(self._model)  # the root's; its context lists every unit
            for unit in state._state_ctx.all_states:
                for group in unit._fsdp_param_groups:
                    group.post_backward()  # accumulated grads -> reduce-scatter (-> all-reduce)
            state._root_post_backward_final_callback()  # wait for the reductions, reset
        self.reshard()

    def reshard(self) -> None:
        """Free every unit's gathered parameters (a no-op for units already sharded)."""
        from torch.distributed.fsdp import FSDPModule

        for module in self._model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def finish(self) -> None:
        pass


def apply_fully_shard(model: nn.Module, mesh: Any, *, reshard_after_forward: bool = True,
                      reshard_after_backward: bool = True, param_dtype: torch.dtype | None = None,
                      reduce_dtype: torch.dtype = torch.float32, offload_optimizer: bool = False,
                      ledger: comm.CommLedger | None = None, axis: str = "dp_shard",
                      experts: tuple[Any, str] | None = None,
                      cast_forward_inputs: bool = True) -> FullyShardedSync:
    """ZeRO-3 with FSDP2 over ``mesh`` (1-D ``dp_shard`` or 2-D ``(dp_replicate, dp_shard)``):
    ``model`` is sharded in place; returns its gradient synchronisation.

    One FSDP unit per transformer block (gathered just in time, freed after use) and one for the
    rest (embedding, final norm, head: the root). ``param_dtype``: the compute dtype of the
    gathered parameters (bf16 mixed precision; the sharded fp32 values are the master weights);
    ``reduce_dtype``: the dtype of the reduce-scatter. ``cast_forward_inputs`` False: a unit's
    floating inputs keep their dtype (bf16 parameters: the residual stream is bf16 already and
    the RoPE tables stay fp32, as without ZeRO-3). ``offload_optimizer``: FSDP2's CPU offload
    (sharded parameters, gradients and the optimizer step on the host; for accelerators).
    ``reshard_after_backward=False`` (with ``reshard_after_forward=False``) keeps the parameters
    gathered until ``reshard`` / ``flush``: a pipeline stage held across its schedule window.
    The ledger counts the all-gathers and reduce-scatters (through ``comm.py``) and, with a 2-D
    mesh, HSDP's all-reduce over ``dp_replicate``.

    ``experts`` (expert parallelism, ``mesh`` then being ``dp_shard x ep (x cp)``): a mesh and
    its ledger name; every MoE layer's ``GroupedExperts`` (this ep rank's experts) becomes its
    own unit on that ``dp_shard (x cp)`` mesh (HSDP: ``(dp_replicate, ...)``), inside its
    block's unit, TorchTitan's layout. Its gradients are summed over that mesh and divided by
    the whole data-parallel degree ``mesh.size()`` (``set_gradient_divide_factor``): each
    rank's expert gradient already sums every ep rank's tokens (the backward all-to-all), so
    dividing by the expert mesh's size alone would leave it ep times too large.
    """
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                  cast_forward_inputs=cast_forward_inputs)
    offload = CPUOffloadPolicy() if offload_optimizer else OffloadPolicy()
    blocks = list(model.layers.values()) if hasattr(model, "layers") else []
    expert_units, (expert_mesh, expert_axis) = [], experts or (None, "")
    if expert_mesh is not None:
        expert_units = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        for unit in expert_units:
            fully_shard(unit, mesh=expert_mesh, reshard_after_forward=reshard_after_forward,
                        mp_policy=policy, offload_policy=offload)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy, offload_policy=offload)
    # The root (embedding, final norm, head) follows the same rule. TorchTitan keeps it gathered
    # (its backward starts right away), saving one all-gather of the root; resharding it keeps
    # the step's traffic exactly ZeRO-3's 3 x Psi and its memory exactly 1/d.
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                offload_policy=offload)
    for unit in [*expert_units, *blocks, model]:
        unit_mesh, unit_axis = (expert_mesh, expert_axis) if unit in expert_units \
            else (mesh, axis)
        unit.set_force_sum_reduction_for_comms(True)  # gloo: SUM, then FSDP2 divides by dp
        unit.set_custom_all_gather(_CountedAllGather(ledger, unit_axis))
        unit.set_custom_reduce_scatter(_CountedReduceScatter(ledger, unit_axis))
        unit.set_reshard_after_backward(reshard_after_backward, recurse=False)
        if ledger is not None and unit_mesh.ndim == 2:
            unit.set_all_reduce_hook(_CountedReplicateAllReduce(ledger, unit_mesh.size(0)))
    for unit in expert_units:  # the data-parallel degree dp x ep, not the expert mesh's dp
        unit.set_gradient_divide_factor(float(mesh.size()))
    # Explicit prefetch: the next block's all-gather is issued before this one computes.
    for current, following in zip(blocks, blocks[1:]):
        current.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([current])
    return FullyShardedSync(model, per_microbatch=reshard_after_backward)


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds ZeRO-3 (FSDP2) parameters: the model itself, or pipeline stages
    (``LocalStages``) whose blocks are FSDP2 units."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())
