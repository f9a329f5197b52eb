"""Sequence parallelism that keeps its saved inputs sharded: the q/k/v and w1/w3 linears' input.

Mesh axis: ``tp`` (with ``parallel.sequence_parallel``). Under SP the attention and MLP inputs
arrive sharded along the sequence and are all-gathered once per block part (``tensor.py``'s
``PrepareModuleInput``). The column-parallel linears then save that gathered ``[b, s, h]`` input
for their weight gradients, so every rank keeps the whole sequence where it needs only its slice:
``2·sbh·e`` per layer instead of ``2·sbh·e/t`` (Korthikanti et al. 2022 §4.2.2, which
Megatron-LM follows: save the shard, all-gather it again in backward).

``keep_saved_inputs_sharded`` does that from outside the model. While a block's ``attention`` or
``feed_forward`` runs forward, a ``torch.autograd.graph.saved_tensors_hooks`` pair is active:

* pack: a saved tensor that is the gathered input — a ``Replicate`` DTensor on the tp mesh whose
  local storage holds exactly ``b·s·h`` elements laid out as a contiguous ``[b, s, h]`` (the
  gathered input itself, or its autocast copy), where ``b, s, h`` are the module input's — is
  replaced by this rank's sequence slice, cloned once per storage however many linears save a view
  of it (q, k and v share one);
* unpack (backward): one all-gather along the sequence rebuilds the storage, shared by every view
  of it, and the view is re-made with its own size, stride and offset; the gathered copy is
  dropped when the last view is unpacked.

Communication: one extra all-gather of ``b·s·h`` elements per block part in backward (counted
into the ledger on axis ``tp``), as in Megatron-SP. Every other saved tensor passes untouched.

Not applied (the gathered input is saved whole, as before) to blocks that are recomputed in full
(``torch.utils.checkpoint``'s own saved-tensor hooks must see their saves, and recomputation
would run these hooks again inside them) or compiled (the compiled block saves its own
intermediates as plain tensors). Selective recomputation checkpoints only the attention core,
inside this module's hooks, so its saves stay checkpoint's.

Why hand-written: torch 2.13's ``ColwiseParallel`` (and TorchTitan, which uses it) saves the
gathered input; torch has no option to re-gather it, and the saved-tensor hooks are torch's own
mechanism for exactly this trade.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from loom.models.moe import MoEFeedForward
from loom.parallel import comm
from loom.parallel.comm import CommLedger


class _Shard:
    """This rank's slice of one gathered storage, and the gathered copy while backward uses it."""

    __slots__ = ("local", "shape", "views", "unpacked", "full")

    def __init__(self, local: torch.Tensor, shape: tuple[int, int, int]):
        self.local, self.shape = local, shape
        self.views = self.unpacked = 0
        self.full: torch.Tensor | None = None


class _ShardedSaving:
    """The hooks of one module part (attention or feed-forward) of one block."""

    def __init__(self, mesh: DeviceMesh, ledger: CommLedger | None):
        self.mesh, self.ledger = mesh, ledger
        self.group = mesh.get_group()
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.context: Any = None
        self.shape: tuple[int, int, int] | None = None
        self.shards: dict[int, _Shard] = {}
        self.held_bytes = 0  # what the last forward kept (bench/activation_memory.py reads it)
        # an outer saved-tensor pack hook does not see what these hooks take: a measurement
        # passes its own here to see every other saved tensor (bench/activation_memory.py)
        self.observe: Callable[[torch.Tensor], Any] | None = None

    def enter(self, module: nn.Module, args: tuple) -> None:
        x = args[0]
        self.shape = tuple(x.shape) if isinstance(x, DTensor) and x.ndim == 3 else None
        self.shards, self.held_bytes = {}, 0
        self.context = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.context.__enter__()

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.context.__exit__(None, None, None)
        self.context, self.shards = None, {}

    def _gathered(self, t: Any) -> torch.Tensor | None:
        """The local tensor of ``t`` if ``t`` is (a view of) the gathered input, else None."""
        if (self.shape is None or not isinstance(t, DTensor) or t.device_mesh != self.mesh
                or not all(p.is_replicate() for p in t.placements)):
            return None
        local = t.to_local()
        if hasattr(local, "trigger_wait"):  # a functional collective's result: its waited data
            local = local.trigger_wait()
        b, s, h = self.shape
        if (local.untyped_storage().nbytes() != b * s * h * local.element_size()
                or local.shape[-1] != h or s % self.size):
            return None
        return local

    def pack(self, t: torch.Tensor) -> Any:
        local = self._gathered(t)
        if local is None:
            return t if self.observe is None else self.observe(t)
        key = local.untyped_storage().data_ptr()
        shard = self.shards.get(key)
        if shard is None:
            b, s, h = self.shape
            full = local.as_strided((b, s, h), (s * h, h, 1), 0)
            piece = s // self.size
            shard = _Shard(full.narrow(1, self.rank * piece, piece).clone(), self.shape)
            self.shards[key] = shard
            self.held_bytes += shard.local.nbytes
        shard.views += 1
        return shard, tuple(local.shape), local.stride(), local.storage_offset()

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        shard, size, stride, offset = packed
        if shard.full is None:
            b, s, h = shard.shape
            out = shard.local.new_empty((self.size * b, s // self.size, h))  # ranks' slices
            comm.all_gather_into_tensor(out, shard.local, self.group, axis="tp",
                                        ledger=self.ledger)
            shard.full = out.view(self.size, b, s // self.size, h).transpose(0, 1).reshape(b, s, h)
        view = shard.full.as_strided(size, stride, offset)
        shard.unpacked += 1
        if shard.unpacked == shard.views:  # the last view of it: let the gathered copy go
            shard.full = None
        return DTensor.from_local(view, self.mesh, [Replicate()], run_check=False)


def keep_saved_inputs_sharded(blocks: Iterable[nn.Module], mesh: DeviceMesh,
                              ledger: CommLedger | None = None) -> list[_ShardedSaving]:
    """Register the hooks on each block's ``attention`` and dense ``feed_forward`` (blocks already
    parallelized with SP; pass only blocks that are neither recomputed in full nor compiled).
    Returns the hook objects (their ``held_bytes`` is what the last forward kept)."""
    savers = []
    for block in blocks:
        for part in (block.attention, block.feed_forward):
            if isinstance(part, MoEFeedForward):  # expert-TP has its own layout
                continue
            saver = _ShardedSaving(mesh, ledger)
            part.register_forward_pre_hook(saver.enter)
            part.register_forward_hook(saver.leave, always_call=True)  # also on an error
            savers.append(saver)
    return savers
