"""Host offload of saved activations and of optimizer state, for accelerator devices.

Mesh axes: none. No collectives; host<->device copies instead (per microbatch, the saved
activations of the forward pass go to pinned host memory and come back in backward; per step,
the optimizer state and the master shard stay on the host, the reduced gradient slice goes down
and the updated slice comes back up).

* activations: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around forward + backward;
* optimizer: ZeRO-3 uses FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and the
  step on the host); ZeRO-1/2 keep their shard's master copy and AdamW moments on the host
  (``loom.parallel.zero``); plain data parallelism has no shard to offload and refuses.

On a CPU device there is nothing to offload *to*: ``plan_offload`` turns both off and says so in
one log line. The decision is a pure function of the device (``is_accelerator`` is a parameter so
tests can exercise the accelerator branch on a CPU machine).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch


def _is_accelerator(device: torch.device) -> bool:
    return device.type != "cpu"


@dataclass(frozen=True)
class OffloadPlan:
    activations: bool
    optimizer: bool
    notes: tuple[str, ...] = field(default=())


def plan_offload(device: torch.device, *, activations: bool, optimizer: bool,
                 is_accelerator: Callable[[torch.device], bool] = _is_accelerator) -> OffloadPlan:
    """What to offload on ``device``; ``notes`` holds the one log line for what was turned off."""
    if not (activations or optimizer) or is_accelerator(device):
        return OffloadPlan(activations, optimizer)
    asked = " and ".join(w for w, on in (("activations", activations),
                                          ("optimizer state", optimizer)) if on)
    return OffloadPlan(False, False, (f"offload: {asked} already live in host memory on device"
                                      f" {device}; offload is a no-op",))


def activation_offload(plan: OffloadPlan) -> contextlib.AbstractContextManager:
    """Enter around a microbatch's forward and backward."""
    if not plan.activations:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)
