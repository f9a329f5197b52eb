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

What it does not move: the stage's input and output (``PipelineStage``'s in-flight record, one
``[micro, seq, dim]`` tensor each, the size of one pipeline message) and views a slot does not
own (a view of an offloaded tensor is copied on its own).

On an accelerator the host copy goes to pinned memory; the copies are synchronous on the current
stream (correct, not overlapped: the simulator's copy streams are not implemented here yet). On
a CPU device the "host" copy is a separate tensor in the same memory: it frees nothing real and
only costs the copies; ``bytes_moved`` and ``seconds`` say how much and how long, measured.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager

import torch


def _is_leaf_weight(tensor: torch.Tensor) -> bool:
    """A leaf that needs a gradient: a parameter, or the stage input the runtime made a leaf
    (which the stage keeps for its backward anyway): offloading it would free nothing."""
    return tensor.is_leaf and tensor.requires_grad


class _Slot:
    """One saved tensor: on its ``home`` device (``offloaded`` False) or its host copy. The home
    is per slot: autograd also saves small host tensors beside the activations (on a GPU, e.g. an
    attention kernel's random-number state), which must come back where they were."""

    __slots__ = ("tensor", "home")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.home = tensor.device


class SavedActivations:
    """The saved tensors of one (stage, microbatch)'s forward, which ``offload`` / ``reload``
    move between the device and the host. ``bytes_moved`` and ``seconds`` accumulate both ways."""

    def __init__(self, name: str) -> None:
        self.name = name  # e.g. "2O3": named in errors
        self.slots: list[_Slot] = []
        self._by_id: dict[int, _Slot] = {}
        self.offloaded = False
        self.bytes_moved = 0
        self.seconds = 0.0

    def hooks(self) -> AbstractContextManager:
        """Enter around the forward whose saved tensors this store holds."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Slot:
        if _is_leaf_weight(tensor) or (tensor._base is not None and _is_leaf_weight(tensor._base)):
            return tensor  # a parameter or a view of one (a linear saves weight.t()): it stays
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

    @property
    def nbytes(self) -> int:
        """Bytes of the saved tensors this store moves."""
        return sum(slot.tensor.numel() * slot.tensor.element_size() for slot in self.slots)

    def offload(self) -> None:
        """Copy every slot to the host and drop the device tensor."""
        began = time.perf_counter()
        self._by_id.clear()  # packing is over: the ids may be reused from now on
        for slot in self.slots:
            tensor = slot.tensor
            if tensor.device.type == "cpu":
                slot.tensor = tensor.clone()  # a separate buffer: on CPU it frees nothing real
            else:  # pinned, with the device tensor's strides where they are dense
                host = torch.empty_like(tensor, device="cpu", pin_memory=True)
                host.copy_(tensor)
                slot.tensor = host
        self.offloaded = True
        self.bytes_moved += self.nbytes
        self.seconds += time.perf_counter() - began

    def reload(self) -> None:
        """Copy every slot back to the device it came from."""
        began = time.perf_counter()
        for slot in self.slots:
            slot.tensor = slot.tensor.clone() if slot.home.type == "cpu" \
                else slot.tensor.to(slot.home)
        self.offloaded = False
        self.bytes_moved += self.nbytes
        self.seconds += time.perf_counter() - began
