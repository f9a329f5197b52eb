"""Inference through part of a model: a whole model run along one path of its pipeline stages
(SkipPipe, issue 18 item 6), e.g. the first and last stage only, or with half of the middle
stages left out.

A model trained with SkipPipe (``parallel.schedule = "skippipe"``) saw microbatches that
skipped middle stages, so it should lose less when stages are left out at inference than one
trained on full paths; ``path_loss`` measures that on the whole model of a finished run (its
``model.safetensors``, ``loom.generate.load_trained_model``): the model's layers split into
stages as the pipeline split them (``loom.pipeline.partition.partition_model``), the
embedding, then the layers of the visited stages in the path's order, then the final norm and
head. The rules are the paths' (``loom.schedule.paths``): the first and last stage are always
visited, no stage twice. One process, forward only; ``path_loss`` over every stage equals the
model's own loss.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

from loom.models.llama import Transformer


def check_stages(stages: Sequence[int], num_stages: int) -> None:
    """``ValueError`` naming what is wrong unless ``stages`` is a path's stage sequence over
    ``num_stages`` stages: starts at 0, ends at the last, visits none twice."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if not stages or stages[0] != 0 or stages[-1] != num_stages - 1:
        raise ValueError(f"stages {list(stages)}: a path starts at stage 0 and ends at the last"
                         f" stage, {num_stages - 1} (they hold the embedding and the head)")
    if len(set(stages)) != len(stages) or not all(0 <= s < num_stages for s in stages):
        raise ValueError(f"stages {list(stages)}: each of 0..{num_stages - 1} at most once")


def path_forward(model: Transformer, layers: Sequence[range], stages: Sequence[int],
                 tokens_BS: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, S, V]`` of ``model`` (a whole model) applying only the layers of
    ``stages``, in that order; ``layers[s]`` are stage s's global layer ids."""
    check_stages(stages, len(layers))
    seq = tokens_BS.shape[1]
    cos, sin = model.rope_cos[:seq], model.rope_sin[:seq]
    h = model.tok_embeddings(tokens_BS)
    for stage in stages:
        for layer in layers[stage]:
            h = model.layers[str(layer)](h, cos, sin)
    return model.output(model.norm(h))


@torch.no_grad()
def path_loss(model: Transformer, layers: Sequence[range], stages: Sequence[int],
              batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-token cross entropy over ``batches`` (inputs, targets) along ``stages``
    (``path_forward``); NaN for no batches. The perplexity is its exp."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        logits = path_forward(model, layers, stages, inputs)
        total += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                 reduction="sum").item()
        count += targets.numel()
    return total / count if count else math.nan


def half_of_the_middle(num_stages: int) -> list[list[int]]:
    """Every path that keeps the first and last stage and leaves out half of the middle
    stages (rounded down; at least one), in a fixed order: the set a result is averaged over."""
    import itertools

    middle = list(range(1, num_stages - 1))
    leave = max(1, len(middle) // 2) if middle else 0
    return [[0, *[s for s in middle if s not in out], num_stages - 1]
            for out in itertools.combinations(middle, leave)]


__all__ = ["check_stages", "half_of_the_middle", "path_forward", "path_loss"]
