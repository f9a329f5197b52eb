"""The runtime side of PipeOffload: a microbatch's saved activations, movable to host and back.

``loom.schedule.offload`` puts ``O`` (offload) and ``R`` (reload) actions into a schedule; the
pipeline runtime (``loom.pipeline.runtime``) runs them with this module. For every (stage,
microbatch) that the rank's list offloads, the runtime wraps that F in ``SavedActivations.hooks``
(``torch.autograd.graph.saved_tensors_hooks``): every tensor autograd saves for the backward goes
into one slot of the store instead of the graph (leaves that need a gradient and views of them
excepted: parameters, the transposed weight a linear saves, and the stage input stay on the device
anyway, so moving them would copy them and free nothing; a tensor saved by several nodes, such as
a layer input that q, k and v all read, is one slot). ``offload`` replaces each slot's
tensor by a host copy and drops the device one (autograd's graph now holds only the slots);
``reload`` copies them back; the backward's unpack hook returns the slot's tensor. The copies are
exact, so a schedule with offloads gives bit-identical losses and gradients
(``tests/dist/test_pipeline_offload.py``).

Saved tensors that view one storage (a linear's output and the transposed view attention
saves of it, say) move as one byte range of that storage: the copy frees exactly what the graph
held and reload restores the views over one buffer again, no larger than before (an earlier
version copied each view on its own: measured on an H100, 409 MiB moved to free 344). What it
does not move: the stage's input and output (``PipelineStage``'s in-flight record, one
``[micro, seq, dim]`` tensor each, the size of one pipeline message), and ``resident`` tensors
(the stage's buffers, such as RoPE tables: the module keeps them, so a copy would free nothing).

On an accelerator the host copy goes to pinned memory; the copies are synchronous on the current
stream (correct, not overlapped: the simulator's copy streams are not implemented here yet). On
a CPU device the "host" copy is a separate tensor in the same memory: it frees nothing real and
only costs the copies; ``bytes_moved`` and ``seconds`` say how much and how long, measured.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch


def _is_leaf_weight(tensor: torch.Tensor) -> bool:
    """A leaf that needs a gradient: a parameter, or the stage input the runtime made a leaf
    (which the stage keeps for its backward anyway): offloading it would free nothing."""
    return tensor.is_leaf and tensor.requires_grad


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, end) of its storage that ``tensor`` reads."""
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    last = sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    return first, first + (last + 1) * size


def _view(buffer: torch.Tensor, dtype: torch.dtype, shape: torch.Size, stride: tuple[int, ...],
          byte_offset: int) -> torch.Tensor:
    """A tensor of ``dtype``, ``shape`` and ``stride`` over the bytes of ``buffer`` (uint8)
    from ``byte_offset`` on."""
    return torch.empty(0, dtype=dtype, device=buffer.device).set_(
        buffer.untyped_storage(), buffer.storage_offset() + byte_offset // dtype.itemsize, shape,
        stride)


class _Slot:
    """One saved tensor: on its ``home`` device (``offloaded`` False) or a view of its group's
    host copy. The home is per slot: autograd also saves small host tensors beside the
    activations (on a GPU, e.g. an attention kernel's random-number state), which stay where
    they were."""

    __slots__ = ("tensor", "home", "byte_offset")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.home = tensor.device
        self.byte_offset = 0  # within its group's copy


class _Group:
    """Slots that view one storage (and dtype), moved as the one byte range they read."""

    def __init__(self, slots: list[_Slot]) -> None:
        spans = [_byte_span(slot.tensor) for slot in slots]
        self.first, self.end = min(a for a, _ in spans), max(b for _, b in spans)
        self.slots = slots
        self.home = slots[0].home
        for slot, (first, _) in zip(slots, spans):
            slot.byte_offset = first - self.first

    @property
    def nbytes(self) -> int:
        return self.end - self.first

    def move(self, buffer: torch.Tensor) -> None:
        """Point every slot at its place in ``buffer`` (this group's bytes, anywhere)."""
        for slot in self.slots:
            t = slot.tensor
            slot.tensor = _view(buffer, t.dtype, t.shape, t.stride(), slot.byte_offset)


class SavedActivations:
    """The saved tensors of one (stage, microbatch)'s forward, which ``offload`` / ``reload``
    move between the device and the host. ``bytes_moved`` and ``seconds`` accumulate both ways.
    Tensors whose storage is one of ``resident``'s (the stage's buffers) are left in place."""

    def __init__(self, name: str, resident: Iterable[torch.Tensor] = ()) -> None:
        self.name = name  # e.g. "2O3": named in errors
        self.slots: list[_Slot] = []
        self._by_id: dict[int, _Slot] = {}
        self._resident = {t.untyped_storage().data_ptr() for t in resident}
        self._groups: list[_Group] | None = None  # formed at the first offload
        self.offloaded = False
        self.bytes_moved = 0
        self.seconds = 0.0

    def hooks(self) -> AbstractContextManager:
        """Enter around the forward whose saved tensors this store holds."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Slot:
        if _is_leaf_weight(tensor) or (tensor._base is not None and _is_leaf_weight(tensor._base)):
            return tensor  # a parameter or a view of one (a linear saves weight.t()): it stays
        if tensor.numel() == 0 or tensor.untyped_storage().data_ptr() in self._resident:
            return tensor  # nothing to move, or the module keeps it anyway
        slot = self._by_id.get(id(tensor))
        if slot is None or slot.tensor is not tensor:
            slot = _Slot(tensor)
            self._by_id[id(tensor)] = slot
            self.slots.append(slot)
        return slot

    def _unpack(self, packed: torch.Tensor | _Slot) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if self.offloaded:
            raise RuntimeError(f"{self.name}: the backward reads activations that are still on "
                               "the host; the schedule must reload them first")
        return packed.tensor

    def groups(self) -> list[_Group]:
        """The slots grouped by the storage (and dtype) they view."""
        if self._groups is None:
            by_storage: dict[tuple, list[_Slot]] = {}
            for slot in self.slots:
                t = slot.tensor
                key = (t.device, t.untyped_storage().data_ptr(), t.dtype)
                by_storage.setdefault(key, []).append(slot)
            self._groups = [_Group(slots) for slots in by_storage.values()]
        return self._groups

    @property
    def nbytes(self) -> int:
        """Bytes this store moves each way: each storage's range its saved tensors read."""
        return sum(group.nbytes for group in self.groups())

    def offload(self) -> None:
        """Copy every group's bytes to the host and drop the device tensors."""
        began = time.perf_counter()
        self._by_id.clear()  # packing is over: the ids may be reused from now on
        for group in self.groups():
            storage = group.slots[0].tensor.untyped_storage()
            device_bytes = torch.empty(0, dtype=torch.uint8, device=group.home).set_(
                storage, group.first, (group.nbytes,), (1,))
            if group.home.type == "cpu":
                host = device_bytes.clone()  # a separate buffer: on CPU it frees nothing real
            else:
                host = torch.empty(group.nbytes, dtype=torch.uint8, pin_memory=True)
                host.copy_(device_bytes)
            group.move(host)
        self.offloaded = True
        self.bytes_moved += self.nbytes
        self.seconds += time.perf_counter() - began

    def reload(self) -> None:
        """Copy every group back to the device it came from, one buffer per group."""
        began = time.perf_counter()
        for group in self.groups():
            host = torch.empty(0, dtype=torch.uint8).set_(
                group.slots[0].tensor.untyped_storage(), 0, (group.nbytes,), (1,))
            group.move(host.clone() if group.home.type == "cpu" else host.to(group.home))
        self.offloaded = False
        self.bytes_moved += self.nbytes
        self.seconds += time.perf_counter() - began
