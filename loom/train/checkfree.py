"""CheckFree: a lost middle pipeline stage rebuilt from its two neighbours, without a checkpoint.

Blagoev, Ersoy and Chen, "All is Not Lost: LLM Recovery without Checkpoints" (arXiv 2506.15461):
when the process holding pipeline stage ``s`` dies, a replacement takes its place and its
transformer blocks become the weighted average of the blocks of stages ``s - 1`` and ``s + 1``,

    W_s = (w_prev * W_{s-1} + w_next * W_{s+1}) / (w_prev + w_next),

position by position (the k-th block of the stage from the k-th block of each neighbour), where
each neighbour's weight ``w`` is the L2 norm of its own blocks' gradient at its last completed
optimizer step (after clipping) plus ``NORM_EPS``, as in the authors' public code (their
``prev_gradient_norm``; secondary summaries of the paper speak of squared norms, the code uses
the norm). The rebuilt stage's optimizer starts empty (fresh AdamW moments and step counts, the
paper's reset); the learning-rate schedule continues at the current step. The survivors keep
their weights and optimizer state in memory and the run continues at the step that failed.

What runs where (``loom.relaunch`` is the launcher side):
1. a rank's ``fit`` raises when a peer dies (gloo reports the closed connection; a rank that is
   not next to the dead one learns it when its neighbours drop their groups, at worst after
   ``train.timeout_s``); it waits for the launcher to publish the next generation (the failed
   rank, ``failed_key``) in the launcher's TCP store, and raises as before when none comes;
2. it keeps a ``Snapshot`` of its state (weights, optimizer, LR schedule, data position, step:
   references, nothing written), drops its process group and joins a new one under the store
   prefix of the next generation, together with the replacement the launcher started;
3. every rank builds a fresh ``Trainer`` on the new group (all groups, meshes and the pipeline
   are rebuilt, so nothing refers to the dead group); the survivors load their snapshots; the
   two neighbours send the replacement their step, schedule, data position, gradient norm and
   blocks; the replacement averages them (``neighbour_average``), and ``fit`` continues.

Stages must hold the same number of blocks with the same shapes (the launcher refuses a
partition that does not give neighbouring stages equal block counts); stage 0 also holds the
embedding and the last stage the final norm and head, which are never averaged: only the blocks
are sent and averaged. Under ``checkfree`` only middle stages (1 .. pp-2) are rebuilt.

CheckFree+ (``fault.recovery = checkfree_plus``, pp >= 4) also rebuilds the first and the last
stage. Training runs every other microbatch with the first two and the last two stages' blocks
swapped (``loom.pipeline.out_of_order``), so stage 1 learns to act as stage 0 and stage pp-2 as
stage pp-1; and after every optimizer step stage 0 sends its embedding to stage 1 and stage
pp-1 its final norm and head to stage pp-2, which keep them as copies (``END_PARAMS``; not
trained there). A lost stage 0 becomes a copy of stage 1's blocks plus stage 1's copy of the
embedding; a lost stage pp-1 a copy of stage pp-2's blocks plus its copy of the norm and head
(``recovery_sources``). Middle stages are averaged as under CheckFree.

The rebuilt stage's learning rate: the authors' code gives the rebuilt stage a fresh optimizer
whose base learning rate is ``lr_scale`` times the others' (1.1 for their 124M and 1.5B models,
1.2 for 500M) for the rest of training; here ``fault.recovery_lr_scale`` (default 1.1) scales
the rebuilt rank's schedule (``scaled_schedule``), which then continues at the current step.
The paper's text was not available to check against; this follows the public code.

This module is the protocol's pure part (the average, the block keys, the store keys: torch
only, so the launcher can import it); ``loom.train.checkfree_worker`` is the trainer side.

Why hand-written: torch's elastic agent restarts every worker on a failure (it has no notion of
keeping survivors), and torchft's managers target data-parallel replicas, not pipeline stages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch

NORM_EPS = 1e-4  # added to each neighbour's gradient norm (a zero norm still gets a say)
STORE_PREFIX = "loom/checkfree"
BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")


# CheckFree+: the parameters of the first (last) stage that are not blocks, copied to stage 1
# (pp - 2) after every optimizer step
END_PARAMS = {"first": ("tok_embeddings.weight",), "last": ("norm.weight", "output.weight")}


def failed_key(generation: int) -> str:
    """The launcher's store key naming the rank replaced at the start of ``generation``."""
    return f"{STORE_PREFIX}/gen{generation}/failed"


def recoverable(recovery: str, stage: int, num_stages: int) -> bool:
    """Whether ``recovery`` rebuilds a lost ``stage`` of ``num_stages``: middle stages under
    checkfree, every stage under checkfree_plus."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} of {num_stages}")
    if recovery == "checkfree_plus":
        return True
    return recovery == "checkfree" and 1 <= stage <= num_stages - 2


def recovery_sources(recovery: str, stage: int, num_stages: int) -> tuple[int, ...]:
    """The stages a lost ``stage`` is rebuilt from: both neighbours for a middle stage (their
    weighted average), the one neighbour for the first or last stage under checkfree_plus (a
    copy, with that neighbour's copy of the embedding or head). ValueError naming the stage
    when ``recovery`` cannot rebuild it."""
    if not recoverable(recovery, stage, num_stages):
        raise ValueError(f"fault.recovery={recovery} cannot rebuild stage {stage} of"
                         f" {num_stages} (checkfree: middle stages 1..{num_stages - 2} only;"
                         " the first and last need checkfree_plus)")
    if stage == 0:
        return (1,)
    if stage == num_stages - 1:
        return (num_stages - 2,)
    return (stage - 1, stage + 1)


def copy_target(stage: int, num_stages: int) -> tuple[int, tuple[str, ...]] | None:
    """CheckFree+: the stage that keeps a copy of this stage's end parameters, and their names
    (stage 0: the embedding, to stage 1; the last: norm and head, to stage pp-2); None for the
    middle stages."""
    if stage == 0:
        return 1, END_PARAMS["first"]
    if stage == num_stages - 1:
        return num_stages - 2, END_PARAMS["last"]
    return None


def scaled_schedule(own: Mapping[str, Any], neighbour: Mapping[str, Any],
                    scale: float) -> dict[str, Any]:
    """A rebuilt stage's LambdaLR state: its own (fresh) state with the neighbour's position
    (``last_epoch``, ``_step_count``) and every base learning rate times ``scale``. Built from
    the rank's own base rates, so a neighbour that was itself rebuilt (scaled) does not pass its
    scale on."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"learning-rate scale must be finite and > 0, got {scale}")
    state = dict(own)
    state["last_epoch"], state["_step_count"] = neighbour["last_epoch"], neighbour["_step_count"]
    state["base_lrs"] = [lr * scale for lr in own["base_lrs"]]
    return state


# -- the pure part --------------------------------------------------------------------------------
def neighbour_weights(norm_prev: float, norm_next: float) -> tuple[float, float]:
    """Each neighbour's weight: its last gradient norm plus ``NORM_EPS``."""
    for norm in (norm_prev, norm_next):
        if not (math.isfinite(norm) and norm >= 0):
            raise ValueError(f"gradient norms must be finite and >= 0, got {norm}")
    return abs(norm_prev) + NORM_EPS, abs(norm_next) + NORM_EPS


def neighbour_average(prev: Mapping[str, torch.Tensor], next_: Mapping[str, torch.Tensor],
                      w_prev: float, w_next: float) -> dict[str, torch.Tensor]:
    """``(prev * w_prev + next * w_next) / (w_prev + w_next)`` for every key (the same keys and
    shapes on both sides). A pure function: the inputs are not modified."""
    if set(prev) != set(next_):
        raise ValueError(f"the neighbours hold different blocks: {sorted(set(prev) ^ set(next_))}")
    if not (w_prev > 0 and w_next > 0):
        raise ValueError(f"weights must be > 0, got {w_prev} and {w_next}")
    total = w_prev + w_next
    out = {}
    for key, a in prev.items():
        b = next_[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"block {key}: {tuple(a.shape)} {a.dtype} vs"
                             f" {tuple(b.shape)} {b.dtype}")
        out[key] = (a * w_prev + b * w_next) / total
    return out


def stage_blocks(named: Mapping[str, torch.Tensor] | Any) -> dict[str, torch.Tensor]:
    """This stage's transformer-block tensors keyed ``<position>.<name in the block>``: the k-th
    block the stage holds (in layer order) at position k, so neighbouring stages line up."""
    items = dict(named.named_parameters()) if hasattr(named, "named_parameters") else dict(named)
    layers = sorted({int(m.group(1)) for m in map(BLOCK.match, items) if m})
    position = {layer: k for k, layer in enumerate(layers)}
    out = {}
    for name, tensor in items.items():
        match = BLOCK.match(name)
        if match:
            out[f"{position[int(match.group(1))]}.{match.group(2)}"] = tensor
    return out


def blocks_grad_norm(model: torch.nn.Module) -> float:
    """The L2 norm of the gradient of this rank's transformer blocks (0 without gradients)."""
    grads = [p.grad for p in stage_blocks(model).values() if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
