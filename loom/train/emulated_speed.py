"""A slower device, emulated: the compute inside ``slowed_to(speed, device)`` is stretched to
``1 / speed`` of its time by sleeping ``(1/speed - 1)`` times what it took, after it.

The trainer enters it around every forward and backward piece of a rank whose emulated node is
slower than the fastest one (``loom train --cluster FILE --emulate``; ``loom.emulate`` gives each
rank its speed), so waiting for messages and collectives is not stretched, only compute. On an
accelerator the device is synchronized before both clock readings (its kernels run
asynchronously), which also serializes this rank's compute with its communication: acceptable
for an emulation, not for a real run, which never enters it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from loom.train.flops import synchronize


@contextlib.contextmanager
def slowed_to(speed: float, device: torch.device) -> Iterator[None]:
    """Run the body, then sleep so that it took ``1 / speed`` of its own time."""
    if not 0 < speed <= 1:
        raise ValueError(f"an emulated speed is in (0, 1], got {speed!r}")
    synchronize(device)
    start = time.perf_counter()
    yield
    synchronize(device)
    time.sleep((time.perf_counter() - start) * (1 / speed - 1))


__all__ = ["slowed_to"]
