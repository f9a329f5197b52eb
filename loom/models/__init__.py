"""Plain single-device models. Nothing here imports the distributed package of torch.

``build_model`` makes a model (or a pipeline stage's slice of one) on any device, the meta device
included; ``reset_parameters`` then gives it the seeded, layout-independent initial weights.
"""

from __future__ import annotations

from typing import Iterable

import torch

from loom.models.document_attention import DocumentMask
from loom.models.llama import Transformer, initial_value, reset_parameters
from loom.models.layers import TransformerArgs
from loom.models.presets import PRESETS, active_parameter_count, parameter_count, preset

__all__ = [
    "DocumentMask", "PRESETS", "Transformer", "TransformerArgs", "active_parameter_count",
    "build_model", "initial_value",
    "parameter_count", "preset", "reset_parameters",
]


def build_model(
    args: TransformerArgs,
    *,
    device: torch.device | str = "meta",
    layer_ids: Iterable[int] | None = None,
    with_embedding: bool = True,
    with_head: bool = True,
) -> Transformer:
    """Construct the module (default: on the meta device, so no memory is touched)."""
    with torch.device(device):
        return Transformer(args, layer_ids=layer_ids, with_embedding=with_embedding,
                           with_head=with_head)
