"""``torch.compile`` per transformer block (``train.compile``), applied from outside the model.

Mesh axes: none (a per-rank compiler pass). Each block of ``model.layers`` (a ``Transformer`` or
a pipeline stage of one) gets a compiled ``forward`` as an instance attribute, as recomputation
(``activation.py``) installs its checkpointed one: the module keeps its class and its parameter
names (no ``_orig_mod.`` wrapper, so checkpoints, the optimizer and the parity tests key on the
same names), and its ``__call__`` runs the block's own hooks eagerly around the compiled code.

Per block, not the whole model, as TorchTitan does: every block has the same code and shapes, so
dynamo compiles one graph and reuses it for every layer (compile time stays that of one block;
measured: one graph for 4 and for 12 layers), and the ends (embedding, head, the
vocabulary-parallel loss) and the pipeline runtime stay eager.

Where in ``parallelize``: after tensor/context/expert parallelism and activation recomputation,
before data parallelism (TorchTitan's order). The compiled region then traces what those made:
DTensor parameters and TP's input/output redistributions (hooks on the block's submodules), and
the checkpointed ``forward`` that recomputation installed (dynamo turns
``torch.utils.checkpoint`` into its checkpoint higher-order op). FSDP2's ``fully_shard`` comes
after: its all-gather and reshard hooks sit on the block itself, so they run eagerly around the
compiled forward (torch also marks them dynamo-disabled).

``fullgraph=False``: a graph break (ring attention's isend/irecv, document masks' lock) costs
speed, not correctness. ``dynamic=False``: the shapes of a run are fixed (sequence length,
micro-batch), and a static graph is what inductor fuses best; a new shape (evaluation's batch)
compiles once more. Varlen microbatches (``data.packing = varlen``) are the exception: every
one has its own length, so ``apply_compile(dynamic=True)`` compiles each block once for any
length (a symbolic sequence dimension) instead of once per length until dynamo's recompile
limit sends the blocks back to eager. Their per-document attention
(``DocumentMask._segments``, on the CPU) runs eagerly between two compiled pieces: its spans
are host-side integers that change with every batch. So does a core that takes the documents
(context parallelism's, Zeppelin's): its document path splits by data-dependent sizes, which
symbolic shapes cannot trace. Tensor parallelism is refused with varlen and compile
(``config_rules``): tp's DTensor blocks traced with a symbolic length exceed the recursion
limit in torch 2.13's dynamo.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

from loom.models.moe import MoEFeedForward
from loom.parallel.activation import checkpointed

__all__ = ["apply_compile"]


def _fresh_views(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with every tensor argument that is a view replaced by a copy, eagerly, before the
    compiled region sees it.

    Why: under tensor parallelism without sequence parallelism, the first block's input is the
    vocabulary-parallel embedding's ``DTensor.to_local()``, a view of the DTensor's local tensor
    made inside an autograd Function. Given that view as a graph input, AOTAutograd (torch 2.13)
    regenerates it from its base and routes the input's gradient past ``to_local``'s backward:
    DTensor's redistribute backward then receives a plain tensor (an AttributeError at tp = 2)
    or, under FSDP2, the embedding gets a wrong gradient. A fresh tensor has no base to replay.
    Only that one input per step is a view (block outputs are new tensors); the copy is
    B x S x D elements, once per forward."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.clone() if isinstance(a, torch.Tensor) and a._is_view() else a
                     for a in args)
        return fn(*args, **kwargs)

    return run


def _compile_forward(module: nn.Module, dynamic: bool = False, documents: bool = False) -> None:
    """Give ``module`` a compiled ``forward`` as an instance attribute, as activation.py does:
    names and class unchanged; the module's own hooks (FSDP2's all-gather, added later; TP's
    redistributions) stay outside the compiled region. ``documents``: a checkpointed forward
    (full recomputation) is compiled inside its checkpoint rather than traced with it: dynamo
    traces a checkpoint as one higher-order op that cannot break around the eager
    per-document kernel, so the whole block would run eagerly (measured: 0 graphs)."""
    forward = module.forward
    inner = getattr(forward, "recomputes", None)
    if documents and inner is not None:
        compiled = torch.compile(inner, backend="inductor", fullgraph=False, dynamic=dynamic)
        module.forward = _fresh_views(checkpointed(compiled))
        return
    compiled = torch.compile(forward, backend="inductor", fullgraph=False, dynamic=dynamic)
    module.forward = _fresh_views(compiled)


def apply_compile(model: nn.Module, dynamic: bool = False, documents: bool = False
                  ) -> nn.Module:
    """Compile every block of ``model.layers`` in place (inductor); returns ``model``. A module
    without ``layers`` is returned unchanged. A block whose feed-forward is an MoE layer gets
    its attention and its two norms compiled one by one and its MoE layer left eager: the
    router's token counts per expert (and ep's all-to-all splits) are data, so a compiled MoE
    would recompile every batch until dynamo's limit and then run eagerly anyway (measured
    before this split: 2 steps of the debug MoE model 86 s compiled against 10 s eager; with
    it, 2 graphs in all, counted by tests/dist/test_compile_parity.py). ``dynamic``: compile
    for any sequence length (varlen microbatches; module docstring); ``documents``: rows of
    documents (``pack``, ``varlen``), whose attention kernel runs eagerly."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return model
    if dynamic:  # a core that takes documents (cp's): eager between the compiled pieces
        eager: dict[int, Callable[..., Any]] = {}
        for block in layers.values():
            core = block.attention.core
            if getattr(core, "takes_documents", False):
                if id(core) not in eager:
                    eager[id(core)] = torch.compiler.disable(core)
                    eager[id(core)].takes_documents = True
                block.attention.core = eager[id(core)]
    for block in layers.values():
        if isinstance(getattr(block, "feed_forward", None), MoEFeedForward):
            for name in ("attention_norm", "attention", "ffn_norm"):
                _compile_forward(getattr(block, name), dynamic, documents)
        else:
            _compile_forward(block, dynamic, documents)
    return model
