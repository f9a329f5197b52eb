"""Whether this machine can run FP8 training: torchao installed, and FP8 matmuls on the device.

``loom train`` asks ``device_refusal`` before any worker starts. These checks live outside
``loom.parallel`` (whose package imports DTensor, sympy and every parallel wrapper: about 1.5 s)
so that the command's start-up, and its refusal of a bad config, stay at torch's own import.
``loom.parallel.fp8`` re-exports them beside the conversion they guard.
"""

from __future__ import annotations

import importlib.util

import torch

# CUDA compute capability from which the FP8 tensor-core matmuls exist (Ada, Hopper, Blackwell)
FP8_CAPABILITY = (8, 9)


def torchao_available() -> bool:
    """Whether the optional ``torchao`` package (``pip install 'loom[fp8]'``) is installed."""
    return importlib.util.find_spec("torchao") is not None


def device_refusal(recipe: str, emulate: bool, device: torch.device) -> str | None:
    """The rule ``loom train`` refuses ``train.fp8 = recipe`` by on this machine's ``device``
    (``train.device`` resolved; None: torchao is installed and the device has FP8 matmuls or
    they are emulated, or FP8 is off)."""
    if recipe == "none":
        return None
    if not torchao_available():
        return "needs the torchao package, which is not installed: pip install 'loom[fp8]'"
    missing = None if emulate else missing_fp8_matmuls(device)
    if missing is None:
        return None
    return (f"needs FP8 matmuls (CUDA compute capability 8.9 or more: L40S, H100, H200, B200);"
            f" {missing}. Use such a GPU, or train.fp8_emulate = true to emulate them (tests;"
            " not faster)")


def missing_fp8_matmuls(device: torch.device) -> str | None:
    """Why ``device`` has no FP8 matmuls, or None when it has them."""
    if device.type != "cuda":
        return f"device {str(device)!r} has no FP8 matmuls"
    if not torch.cuda.is_available():
        return "CUDA is not available here"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} is compute capability"
                f" {capability[0]}.{capability[1]}, below {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}")
    return None
