"""One pipeline stage: a slice of the model and its forward, I, W and B on one microbatch.

``PipelineStage`` wraps the ``Transformer`` slice of one stage (``build_stages`` makes the slices
a rank owns under a schedule's placement, each initialised with the seeded weights of the full
model) and keeps, per microbatch in flight, what its backward needs. It computes only; moving
tensors between ranks is ``loom.pipeline.runtime``'s job, so nothing here communicates.

The I/W split. ``I`` (gradient w.r.t. the stage input) and ``W`` (gradients w.r.t. the weights)
must give the same numbers as one full backward ``B`` without running the backward twice. Loom
calls torch's ``stage_backward_input`` / ``stage_backward_weight``
(``torch.distributed.pipelining._backward``): I runs ``autograd.grad`` to the input only, with
pre-hooks that capture the gradients flowing into the "intermediate" nodes where the weight
branches join the input path; W then starts ``autograd.grad`` from those saved gradients to the
weights, so the shared part of the graph is not recomputed. The graph walk that finds those nodes
is subtle (it must not double count descendants), is maintained with torch's own ZB schedules and
tested there, and a second copy in Loom would be a liability; the module is private, so
``tests/unit/pipeline/test_stage.py`` pins the behaviour Loom relies on (I+W == B, bit for bit
on CPU). The first stage has no input gradient (its input is token ids), so its I is a no-op and
its W is the full backward, as in torch's own runtime.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from loom.models import Transformer, TransformerArgs, build_model, reset_parameters
from loom.parallel import Parallelized
from loom.schedule.ir import Schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _InFlight:
    """What one microbatch's backward needs: the stage input (a leaf when it needs a gradient),
    the output (or the loss on the last stage), and after I the saved gradients for W."""

    inputs: torch.Tensor
    output: torch.Tensor
    output_grad: torch.Tensor | None = None
    param_groups: list[dict[str, Any]] | None = None


@dataclass
class PipelineStage:
    """Stage ``index`` of a schedule whose routes are ``num_stages`` long: its module and the
    microbatches it holds activations for. With one route ``index`` is the model stage; with
    several (``Schedule.routes``) it is ``route * num_stages + model stage``."""

    index: int
    num_stages: int  # stages per route: the model's
    module: Transformer
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # Global token positions of this rank's sequence shard (context parallelism), for RoPE;
    # None: the whole sequence in order. Set by the trainer before each step.
    positions: torch.Tensor | None = None
    # What ``parallelize`` applied to ``module`` (its TP / EP records and reducer); None when
    # the stage was built without it
    applied: Parallelized | None = None
    # MoE: this step's load-balancing loss of the slice's layers, summed over the microbatches
    # it trained (for the log; its gradient joins in backward: aux_loss_backward_scale)
    aux_loss_sum: torch.Tensor | None = None
    _in_flight: dict[int, _InFlight] = field(default_factory=dict)

    @property
    def model_stage(self) -> int:
        """Which slice of the model this is (the same on every route's copy)."""
        return self.index % self.num_stages

    @property
    def is_first(self) -> bool:
        return self.model_stage == 0

    @property
    def is_last(self) -> bool:
        return self.model_stage == self.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, microbatch: int, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                loss_fn: LossFn | None = None, *, training: bool = True,
                documents: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the slice. Returns the output (hidden states) or, on the last stage, the loss of
        ``loss_fn(logits, targets)``. With ``training`` the graph is kept for the backward.
        ``documents``: packed rows' (positions, document ids), for attention within documents."""
        positions, document_ids = documents if documents is not None else (self.positions, None)
        if not training:
            with torch.no_grad(), self.autocast():
                out = self.module(inputs, positions=positions, document_ids=document_ids)
            return loss_fn(out, targets) if self.is_last else out
        if not self.is_first:  # a leaf, so I can ask autograd for its gradient
            inputs = inputs.detach().requires_grad_(True)
        with self.autocast():
            out = self.module(inputs, positions=positions, document_ids=document_ids)
        if not self.is_last and out._is_view():
            # Under sequence parallelism the output is a view of a DTensor's local shard;
            # torch's stage_backward_input detaches stage outputs in place, which views forbid.
            out = out.clone()
        if self.module.args.n_experts:
            aux = self.module.moe_aux_loss().detach()
            self.aux_loss_sum = aux if self.aux_loss_sum is None else self.aux_loss_sum + aux
        if self.is_last:
            out = loss_fn(out, targets)
        self._in_flight[microbatch] = _InFlight(inputs, out)
        return out

    def backward_input(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """I: the gradient w.r.t. the stage input (None on the first stage); W must follow."""
        state = self._in_flight[microbatch]
        state.output_grad = output_grad
        if self.is_first:
            return None  # token ids have no gradient; W does the whole backward
        grads = None if output_grad is None else [output_grad]
        dinputs, state.param_groups = stage_backward_input(
            [state.output], grads, [state.inputs], self.parameters())
        state.inputs = state.output = None  # type: ignore[assignment]  (W needs only the groups)
        return dinputs[0]

    def backward_weight(self, microbatch: int) -> None:
        """W: accumulate the weight gradients of ``microbatch`` into ``.grad``; frees its state."""
        state = self._in_flight.pop(microbatch)
        if self.is_first:
            torch.autograd.backward(state.output, state.output_grad)
        else:
            stage_backward_weight(self.parameters(), state.param_groups)

    def backward(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """B: one backward pass for the input and the weights; returns the input gradient."""
        state = self._in_flight.pop(microbatch)
        torch.autograd.backward(state.output, output_grad)  # loss: output_grad None means 1
        return None if self.is_first else state.inputs.grad

    @property
    def holds_activations(self) -> bool:
        return bool(self._in_flight)


def build_stages(args: TransformerArgs, schedule: Schedule, layers: Sequence[range], rank: int,
                 device: torch.device | str, seed: int,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 ) -> dict[int, PipelineStage]:
    """The stages ``rank`` owns under ``schedule.placement``, with ``layers[model stage]`` each,
    made on the meta device and initialised by name, so every slice holds the full model's
    weights (and the copies of a stage on different routes start identical)."""
    stages = {}
    length = schedule.stages_per_route
    for index in schedule.stages_of(rank):
        module = build_model(args, device="meta", layer_ids=layers[index % length],
                             with_embedding=schedule.is_first(index),
                             with_head=schedule.is_last(index))
        module.to_empty(device=device)
        reset_parameters(module, seed)  # a tied head starts as the embedding (seeded_name)
        stages[index] = PipelineStage(index, length, module, autocast)
    for route in range(schedule.num_routes if length > 1 else 0):
        first, last = route * length, route * length + length - 1
        if args.tie_embeddings and first in stages and last in stages:
            # Both ends on this rank (a V placement): one Parameter, as in the unsplit model.
            stages[last].module.output.weight = stages[first].module.tok_embeddings.weight
    return stages


class _TiedHead(nn.Module):
    """Presents a last stage's copy of a tied embedding under the embedding's name."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class LocalStages(nn.Module):
    """The stages one rank holds, under the full model's parameter names.

    Its attributes mirror ``Transformer`` (``tok_embeddings``, ``layers``, ``norm``, ``output``)
    and refer to the stages' own submodules — no copies — so ``named_parameters()`` and
    ``state_dict()`` use the same global names under every pipeline layout. That is what the
    optimizer's state, checkpoints (DCP matches tensors by name) and parity tests key on. It is a
    container only: the runtime runs the stages, never this module's ``forward``.

    Tied embeddings: the last stage's head weight is registered first as
    ``tok_embeddings.weight`` (and again as ``output.weight``, as in the unsplit model's state
    dict), so every copy has the one global name. On a rank without the first stage that copy is
    a *replica* (``tied_replicas``): the first stage's rank holds the same gradient after the
    runtime's tie reduction, so the global norm counts it there only.

    Routes (bidirectional schedules): ``replicas`` are the modules of this rank's stages whose
    copy on route 0 lives on another rank. After the runtime's copy sum they hold the same
    gradients as that copy, so ``tied_replicas`` lists their parameters too: the global norm
    counts each model parameter once, on the rank of its route-0 copy, and clipping scales the
    replicas by the same factor (the copies stay bit-identical).
    """

    def __init__(self, modules: Sequence[Transformer],
                 replicas: Sequence[Transformer] = ()) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        self._tie_replica = False
        # by identity: a copy's tied head and embedding are one Parameter, listed once
        self._route_replicas = list({id(p): p for module in replicas
                                     for p in module.parameters()}.values())
        for module in modules:
            if module.tok_embeddings is not None:
                self.tok_embeddings = module.tok_embeddings
            for name, layer in module.layers.items():
                self.layers[name] = layer
            if module.output is not None:
                if module.args.tie_embeddings and "tok_embeddings" not in self._modules:
                    self.tok_embeddings = _TiedHead(module.output.weight)
                    self._tie_replica = True
                self.norm, self.output = module.norm, module.output

    def tied_replicas(self) -> list[nn.Parameter]:
        """Parameters another rank counts in the global norm: the tied head weight when this rank
        holds it without the embedding, and the route replicas' parameters (see the class)."""
        return ([self.output.weight] if self._tie_replica else []) + self._route_replicas

    def forward(self, *args: Any) -> None:  # pragma: no cover - a container, not a model
        raise RuntimeError("LocalStages holds a rank's pipeline stages; run them with the runtime")
