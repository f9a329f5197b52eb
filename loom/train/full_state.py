"""Full (unsharded) tensors out of any layout: gradients for parity tests, weights for the run.

Every function is a collective over the axes that shard the model (tp, ep, dp_shard, pp): call it
on every rank. Gradients come back to every rank (parity tests compare them there); weights are
gathered to the main rank, which alone writes them (a temp file, then a rename). Split out of
``loom.train.trainer``, which keeps one-line methods of the same names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from loom.files import as_created
from loom.parallel import comm
from loom.parallel.expert import expert_parameter_names, gather_expert_weights
from loom.parallel.tensor import full_named_gradients

if TYPE_CHECKING:
    from loom.train.trainer import Trainer


def named_gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient by its model name (for parity tests): full tensors under
    TP (collective over tp), expert shards stacked over ep, then every stage's over ``pp``
    (a collective: call it on every rank)."""
    zero = trainer.zero  # ZeRO-1/2: the stages' reduced slices, all-gathered
    grads = zero.full_named_gradients() if zero is not None else \
        full_named_gradients(trainer.model)
    return _gather_over_pp(trainer, _gather_experts(trainer, grads))


def named_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's full value by its model name, on every rank (for tests and tools):
    gathered over tp and ZeRO-3's shards, expert shards stacked over ep, every stage's merged
    over ``pp`` (vocabulary rows concatenated). Collectives: call it on every rank."""
    local = {n: p.full_tensor() if hasattr(p, "full_tensor") else p
             for n, p in trainer.model.named_parameters()}
    if trainer.ep is not None:
        local.update(gather_expert_weights(trainer.model, trainer.ep))
    return _gather_over_pp(trainer, local)


def _gather_experts(trainer: Trainer, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Expert shards stacked back in ep-rank order (collective over ep)."""
    if trainer.ep is not None:
        for name in sorted(expert_parameter_names(trainer.model) & set(grads)):
            shard = grads[name].contiguous()
            full = shard.new_empty((shard.shape[0] * trainer.ep.size, *shard.shape[1:]))
            comm.all_gather_into_tensor(full, shard, trainer.ep.group, axis="ep")
            grads[name] = full
    return grads


def _gather_over_pp(trainer: Trainer, tensors: dict[str, torch.Tensor],
                    to_main: bool = False) -> dict[str, torch.Tensor]:
    """Merge name -> tensor dicts of the ``pp`` group (CPU copies, pickled: fine for tests
    and final weights, not for per-step use); ``to_main``: only pp rank 0 receives. Under
    vocabulary parallelism across pp the embedding's and the head's rows are concatenated in
    pp order (``loom.parallel.vocab_pipeline``: rank r holds rows [rV/p, (r+1)V/p))."""
    local = {k: v.detach().cpu().clone() for k, v in tensors.items()}
    if trainer.pipeline.pp_group is None:  # pp = 1: this rank holds the whole model
        return local
    parts: list[Any] = [None] * len(trainer.pipeline.pp_ranks)
    if to_main:
        dist.gather_object(local, parts if trainer.pipeline.pp_rank == 0 else None,
                           dst=trainer.pipeline.pp_ranks[0], group=trainer.pipeline.pp_group)
    else:
        dist.all_gather_object(parts, local, group=trainer.pipeline.pp_group)
    rows = {"tok_embeddings.weight", "output.weight"} \
        if getattr(trainer.pipeline, "vocab", None) is not None else set()
    merged = {k: v for part in parts if part for k, v in part.items() if k not in rows}
    for name in sorted(rows):
        pieces = [part[name] for part in parts if part and name in part]
        if pieces:
            merged[name] = torch.cat(pieces)
    return merged


def save_weights(trainer: Trainer, path: Path) -> None:
    """The full model weights as safetensors (main rank; written to a temp file, renamed)."""
    from safetensors.torch import save_file

    # TP / ZeRO-3 gathers (collectives over tp, dp_shard) ...
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in trainer.model.state_dict().items()}
    if trainer.ep is not None:  # expert shards stacked back over ep (collective)
        state.update(gather_expert_weights(trainer.model, trainer.ep))
    if trainer.dp_rank != 0:
        return
    state = _gather_over_pp(trainer, state, to_main=True)  # ... then the first pipeline's
    if not trainer.ctx.is_main:
        return
    if trainer.args.tie_embeddings:
        state.pop("output.weight", None)  # the same tensor as the embedding
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "loom_step": str(trainer.step)})
    as_created(tmp)  # safetensors writes 0600
    os.replace(tmp, path)
