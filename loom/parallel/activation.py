"""Activation recomputation: what a transformer block keeps for backward, and what it recomputes.

Mesh axes: none (a per-rank memory/compute trade). No collectives of its own; a recomputed region
that contains collectives (TP's all-reduces, CP's exchanges) issues them again in backward.

Policies (``train.recompute``), with the bytes a block keeps per microbatch (Korthikanti et al.
2022 Table 2, adjusted to Loom's block in docs/benchmarks.md "Activation memory per layer"):

* ``none``: everything the block saves (no TP: ``sbh·e·(10 + 4f/h) + 4sb(2 + a)``);
* ``full``: every block is one checkpoint: only its input ``sbh·e`` is kept and the whole block
  runs forward again in backward (+1 forward, about +33% FLOPs);
* ``selective``: only the attention core (``Attention.core``: SDPA, or a CP core) is recomputed,
  Korthikanti's selective recomputation. With documents (``data.packing = pack | varlen``) the
  core is the document-masked one (``DocumentMask.attention``): the local core is wrapped as a
  core that takes the documents (``takes_documents``) and recomputes whichever it runs; a core
  swapped in from outside (CP) keeps its own document path, recomputed the same way. Loom's
  CPU core is a flash kernel that saves only its output and logsumexp, so the saving here is
  small; on kernels that store ``a·s²`` it is most;
* ``every_k``: full recomputation of blocks ``0, k, 2k, ...`` only (``train.recompute_every``):
  a middle point between the two, Megatron's "uniform/block" granularity.

``torch.utils.checkpoint`` with ``use_reentrant=False``: it works with keyword arguments, with
DTensor and FSDP2 hooks inside, and recomputes lazily when backward first needs a saved tensor.
The block's ``forward`` is wrapped in place (no wrapper module), so parameter names — which
checkpoints, the optimizer and parity tests key on — do not change. Applied in ``parallelize``
after TP/CP (it recomputes whatever they produced) and before data parallelism (FSDP2 gathers the
parameters before the block's backward, so recomputation finds them unsharded). Degree of
parallelism plays no part; ``none`` attaches nothing.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loom.models.document_attention import DocumentMask
from loom.models.layers import sdpa_causal

POLICIES = ("none", "full", "selective", "every_k")


def checkpointed(fn: Callable) -> Callable:
    """``fn`` recomputed in backward (non-reentrant ``torch.utils.checkpoint``); the wrapper's
    ``recomputes`` is ``fn`` (``compile.py`` compiles it inside the checkpoint where a block's
    code cannot all be traced)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    run.recomputes = fn
    return run


def _is_local(core: Callable) -> bool:
    """Whether ``core`` is the model's own one-device core (``Attention.__init__``'s)."""
    return core is sdpa_causal or (isinstance(core, functools.partial)
                                   and core.func is sdpa_causal)


def _local_core_with_documents(core: Callable, window: int) -> Callable:
    """The local core, taking the documents too: within documents it is the attention
    ``Attention`` runs for them (``DocumentMask.attention``), so recomputing this one call
    recomputes either path."""
    def run(q_BNSH: torch.Tensor, k_BKSH: torch.Tensor, v_BKSH: torch.Tensor,
            documents: DocumentMask | None = None) -> torch.Tensor:
        if documents is None:
            return core(q_BNSH, k_BKSH, v_BKSH)
        return documents.attention(q_BNSH, k_BKSH, v_BKSH, window)

    run.takes_documents = True  # Attention hands it the documents (functools.wraps keeps it)
    return run


def recomputed_layers(layer_ids: list[int], policy: str, every: int) -> list[int]:
    """Which global layer ids ``policy`` recomputes in full (``selective``: none in full)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; known: {', '.join(POLICIES)}")
    if policy == "full":
        return list(layer_ids)
    if policy == "every_k":
        return [i for i in layer_ids if i % every == 0]
    return []


def apply_activation_checkpointing(model: nn.Module, policy: str, every: int = 1) -> nn.Module:
    """Wrap the blocks of ``model`` (a ``Transformer`` or a pipeline stage of one) per ``policy``."""
    layers = getattr(model, "layers", None)
    if policy == "none" or layers is None:
        return model
    if policy == "selective":
        for block in layers.values():
            attention = block.attention
            core = attention.core
            if _is_local(core):  # a CP core keeps its own document path (and flag)
                core = _local_core_with_documents(core, attention.sliding_window)
            attention.core = checkpointed(core)
        return model
    full = set(recomputed_layers([int(k) for k in layers], policy, every))
    for key, block in layers.items():
        if int(key) in full:
            block.forward = checkpointed(block.forward)  # instance attribute: names unchanged
    return model
