"""Plain single-device models. Nothing here imports the distributed package of torch.

``build_model`` makes a model (or a pipeline stage's slice of one) on any device, the meta device
included; ``reset_parameters`` then gives it the seeded, layout-independent initial weights.

The names below are imported on first use (PEP 562): importing ``loom.models.args`` (shapes)
or ``loom.models.presets`` must not import torch and the layers, which the planner never needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.models.args import TransformerArgs
    from loom.models.document_attention import DocumentMask
    from loom.models.llama import Transformer, build_model, initial_value, reset_parameters
    from loom.models.presets import PRESETS, active_parameter_count, parameter_count, preset

_HOMES = {
    "DocumentMask": "loom.models.document_attention",
    "PRESETS": "loom.models.presets",
    "Transformer": "loom.models.llama",
    "TransformerArgs": "loom.models.args",
    "active_parameter_count": "loom.models.presets",
    "build_model": "loom.models.llama",
    "initial_value": "loom.models.llama",
    "parameter_count": "loom.models.presets",
    "preset": "loom.models.presets",
    "reset_parameters": "loom.models.llama",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'loom.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
