"""One pipeline stage: a slice of the model and its forward, I, W and B on one microbatch.

``PipelineStage`` wraps the ``Transformer`` slice of one stage (``build_stages`` makes the slices
a rank owns under a schedule's placement, each initialised with the seeded weights of the full
model) and keeps, per microbatch in flight, what its backward needs. It computes only; moving
tensors between ranks is ``loom.pipeline.runtime``'s job, so nothing here communicates.

The I/W split. ``I`` (gradient w.r.t. the stage input) and ``W`` (gradients w.r.t. the weights)
must give the same numbers as one full backward ``B`` without running the backward twice, and I
must free every activation W does not read, so that a rank holds what the schedule's memory
accounting says (Zero Bubble's M_W after I, not the whole M_B until W). Loom's I therefore walks
the microbatch's autograd graph once (``_plan_split``) and finds every matmul whose second operand
is a parameter used nowhere else (an ``nn.Linear``: ``MmBackward0`` / ``AddmmBackward0`` of
``weight.t()``, optionally through autocast's cast, plus its bias). I runs ``autograd.grad`` to the
stage input and to every *other* parameter (norm weights, which are small, and MoE experts, whose
parameter-sized gradients are too large to hold per microbatch in flight; their gradients are
accumulated during I) without ``retain_graph``, so
autograd frees each saved tensor as soon as its node has run; a pre-hook on each deferred
matmul's node keeps what its weight gradient needs, the layer input autograd saved for it and
the gradient of its output. W then computes ``grad^T @ input`` (and the bias's row sum) exactly
as autograd's ``mm_mat2_backward`` would, the same kernels on the same operands, so the result is
bit-identical to a full backward. On the first stage (token ids: no input gradient) I stops at
the embedding's output (a ``GradientEdge``) and W finishes the embedding's backward, so that
stage frees at I too.

Where that plan cannot be made the stage keeps the retaining split of torch's
``stage_backward_input`` / ``stage_backward_weight`` (``torch.distributed.pipelining._backward``:
I runs ``autograd.grad(..., retain_graph=True)`` and W restarts from the intermediates where the
weight branches join, so the whole graph is held until W): parameters that are DTensors (tensor
parallelism, ZeRO-3's FSDP2) and blocks recomputed in full (``free_graph_after_input_grad`` off,
set by ``build_pipeline``: reading a checkpointed matmul's input in I would unpack it twice).
That W writes ``.grad`` itself, so no post-accumulate hook fires; the stage then gives each
gradient its parameter's placement as tensor parallelism's hook would (SP's norm weights hold
a ``Partial`` sum until then, which the clipping norm would count as replicated).
``tests/unit/pipeline/test_stage.py`` pins both (I+W == B, bit for bit on CPU, and what each
frees).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.distributed.tensor import DTensor

from loom.models import Transformer, TransformerArgs, build_model, reset_parameters
from loom.parallel import Parallelized
from loom.parallel.mixed_precision import accumulate
from loom.parallel.tensor import match_grad_placement
from loom.schedule.ir import Schedule

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# Autograd nodes the split plan reads (torch's generated names; ``_plan_split`` falls back to
# computing a parameter's gradient in I whenever the graph around it looks any other way).
_MATMULS = {"MmBackward0": "_saved_self", "AddmmBackward0": "_saved_mat1"}  # -> first operand
_CAST = "ToCopyBackward0"  # autocast's copy of a weight in the compute dtype
_LEAF = "torch::autograd::AccumulateGrad"  # its name(), unlike the generated nodes


@dataclass(eq=False)
class _DeferredMatmul:
    """One matmul ``inputs @ weight.t() (+ bias)`` whose weight gradient W computes.

    Until I runs it holds autograd's node; its pre-hook (``read``, run by I just before the node)
    keeps what autograd saved as the first operand (the layer input, 2-D, in the compute dtype)
    and the gradient of the node's output, and drops the node, so nothing else of the graph
    outlives I."""

    node: Node | None
    weight: nn.Parameter
    bias: nn.Parameter | None
    column_major: bool  # which branch autograd's mm_mat2_backward takes (weight.t() col-major)
    inputs: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    def read(self, grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        node, self.node = self.node, None
        # Detached: the unpacked input is an activation with a grad_fn, which would keep the
        # graph's nodes (and W's results) attached to it.
        self.inputs = getattr(node, _MATMULS[node.name()]).detach()
        self.grad = grad_outputs[0]

    def weight_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The gradients autograd's mm backward (and the casts of autocast) would produce."""
        if self.column_major:  # mm_mat2_backward: grad.t().mm(mat1).t(), then TBackward's .t()
            dw = self.grad.t().mm(self.inputs)
        else:
            dw = self.inputs.t().mm(self.grad).t()
        grads = [(self.weight, dw.to(self.weight.dtype))]
        if self.bias is not None:  # addmm's self gradient, summed to the bias's shape
            grads.append((self.bias, self.grad.sum(0).to(self.bias.dtype)))
        return grads


@dataclass
class _SplitPlan:
    """How one microbatch's I frees its graph and what its W computes (``_plan_split``)."""

    matmuls: list[_DeferredMatmul]
    eager: list[nn.Parameter]  # gradients computed (and accumulated) in I
    embedding: Node | None = None  # first stage: I stops at this node's input, W runs it
    embedding_weight: nn.Parameter | None = None
    embedding_grad: torch.Tensor | None = None  # the embedding output's gradient, from I

    def held(self) -> list[torch.Tensor]:
        """What this microbatch holds between I and W."""
        tensors = [t for m in self.matmuls for t in (m.inputs, m.grad) if t is not None]
        return tensors + ([self.embedding_grad] if self.embedding_grad is not None else [])


def _single_use_leaf(node: Node | None, indegree: dict[Node, int],
                     through: tuple[str, ...]) -> nn.Parameter | None:
    """The parameter at the end of ``node`` (passing first the nodes named ``through``, then an
    optional autocast copy), when every node on the way, the parameter's included, has exactly
    one consumer in the graph: then its gradient comes from this one use only."""
    for name in through + (_CAST,):
        if node is not None and node.name() == name:
            if indegree[node] != 1 or len(node.next_functions) != 1:
                return None
            node = node.next_functions[0][0]
        elif name != _CAST:
            return None
    if node is None or node.name() != _LEAF or indegree[node] != 1:
        return None
    if getattr(node.variable, "_backward_hooks", None):
        # A hook registered on the parameter (Tensor.register_hook) sees or changes its gradient
        # inside autograd; W's own matmul would bypass it, so autograd computes this one in I.
        # (Post-accumulate hooks, the reducer's, are not affected: the runtime flushes after W.)
        return None
    return node.variable


def _plan_split(output: torch.Tensor, params: Sequence[nn.Parameter], *,
                cut_embedding: bool) -> _SplitPlan:
    """Walk ``output``'s graph once: each parameter used once, as the transposed second operand
    of a matmul whose first operand needs a gradient (an ``nn.Linear``), is deferred to W; with
    ``cut_embedding`` an embedding's weight too; every other parameter is eager."""
    indegree: dict[Node, int] = {output.grad_fn: 0}
    stack, order = [output.grad_fn], []
    while stack:
        node = stack.pop()
        order.append(node)
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child in indegree:
                indegree[child] += 1
            else:
                indegree[child] = 1
                stack.append(child)
    wanted = {id(p) for p in params}
    matmuls: list[_DeferredMatmul] = []
    plan = _SplitPlan(matmuls, [])
    for node in order:
        name, edges = node.name(), node.next_functions
        if name in _MATMULS and edges[-2][0] is not None:  # the input path runs in I
            weight = _single_use_leaf(edges[-1][0], indegree, ("TBackward0",))
            if weight is None or id(weight) not in wanted:
                continue
            bias = None
            if name == "AddmmBackward0":
                bias = _single_use_leaf(edges[0][0], indegree, ())
                if bias is None or id(bias) not in wanted or bias.dim() != 1:
                    continue  # a shared or non-parameter addend: leave the whole node to I
            sizes, strides = node._saved_mat2_sym_sizes, node._saved_mat2_sym_strides
            column_major = strides[0] == 1 and strides[1] == sizes[0]
            matmuls.append(_DeferredMatmul(node, weight, bias, bool(column_major)))
        elif cut_embedding and name == "EmbeddingBackward0" and plan.embedding is None:
            weight = _single_use_leaf(edges[0][0], indegree, ())
            if weight is not None and id(weight) in wanted:
                plan.embedding, plan.embedding_weight = node, weight
    deferred = {id(p) for m in matmuls for p in (m.weight, m.bias) if p is not None}
    if plan.embedding_weight is not None:
        deferred.add(id(plan.embedding_weight))
    plan.eager = [p for p in params if id(p) not in deferred]
    return plan


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Add to ``.grad`` in place, as torch's ``stage_backward_weight`` does: the buffers of ZeRO-1
    (views of one flat tensor) stay, and no accumulate hook fires (the runtime flushes after W).
    A bf16 parameter with an fp32 ``main_grad`` (``loom.parallel.mixed_precision``) adds there."""
    if accumulate(param, grad):
        return
    if param.grad is None:
        param.grad = grad if grad.stride() == param.stride() else grad.contiguous()
    else:
        param.grad += grad


@dataclass
class _InFlight:
    """What one microbatch's backward needs: the stage input (a leaf when it needs a gradient),
    the output (or the loss on the last stage), and after I what W needs: the deferred matmuls
    (``plan``) or, on the retaining path, torch's saved gradients (``param_groups``)."""

    inputs: torch.Tensor
    output: torch.Tensor
    output_grad: torch.Tensor | None = None
    param_groups: list[dict[str, Any]] | None = None
    plan: _SplitPlan | None = None


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
    # I frees every activation W does not read (see the module docstring); off: the retaining
    # split, for blocks recomputed in full. DTensor parameters always take the retaining split.
    free_graph_after_input_grad: bool = True
    # Vocabulary parallelism across the pipeline (``loom.parallel.vocab_pipeline``): the first
    # stage takes the summed embedding (hidden states, whose gradient it returns) and the last
    # ends at the final norm, its output X going to every rank's output-layer shard
    vocab_parallel: bool = False
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

    @property
    def takes_tokens(self) -> bool:
        """The input is token ids (no gradient to return): the first stage, unless the
        embedding is vocabulary-parallel across the pipeline."""
        return self.is_first and not self.vocab_parallel

    @property
    def computes_loss(self) -> bool:
        """The output is the loss: the last stage, unless the output layer is
        vocabulary-parallel across the pipeline."""
        return self.is_last and not self.vocab_parallel

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward(self, microbatch: int, inputs: torch.Tensor, targets: torch.Tensor | None = None,
                loss_fn: LossFn | None = None, *, training: bool = True,
                documents: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run the slice. Returns the output (hidden states) or, on the last stage, the loss of
        ``loss_fn(logits, targets)`` (``computes_loss``; under vocabulary parallelism the
        normalised hidden states). With ``training`` the graph is kept for the backward.
        ``documents``: packed rows' (positions, document ids), for attention within documents."""
        positions, document_ids = documents if documents is not None else (self.positions, None)
        if not training:
            with torch.no_grad(), self.autocast():
                out = self.module(inputs, positions=positions, document_ids=document_ids)
            return loss_fn(out, targets) if self.computes_loss else out
        if not self.takes_tokens:  # a leaf, so I can ask autograd for its gradient
            inputs = inputs.detach().requires_grad_(True)
        with self.autocast():
            out = self.module(inputs, positions=positions, document_ids=document_ids)
        if not self.computes_loss and out._is_view():
            # Under sequence parallelism the output is a view of a DTensor's local shard;
            # torch's stage_backward_input detaches stage outputs in place, which views forbid.
            out = out.clone()
        if self.module.args.n_experts:
            aux = self.module.moe_aux_loss().detach()
            self.aux_loss_sum = aux if self.aux_loss_sum is None else self.aux_loss_sum + aux
        if self.computes_loss:
            out = loss_fn(out, targets)
        self._in_flight[microbatch] = _InFlight(inputs, out)
        return out

    def _frees_graph(self) -> bool:
        return self.free_graph_after_input_grad and not any(
            isinstance(p, DTensor) for p in self.module.parameters())

    def backward_input(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """I: the gradient w.r.t. the stage input (None on the first stage); W must follow."""
        state = self._in_flight[microbatch]
        state.output_grad = output_grad
        if self._frees_graph():
            plan = _plan_split(state.output, self.parameters(), cut_embedding=self.takes_tokens)
            if not self.takes_tokens or plan.embedding is not None:
                return self._input_grad_freeing(state, plan)
        if self.takes_tokens:
            return None  # token ids have no gradient; W does the whole backward
        grads = None if output_grad is None else [output_grad]
        dinputs, state.param_groups = stage_backward_input(
            [state.output], grads, [state.inputs], self.parameters())
        state.inputs = state.output = None  # type: ignore[assignment]  (W needs only the groups)
        return dinputs[0]

    def _input_grad_freeing(self, state: _InFlight, plan: _SplitPlan) -> torch.Tensor | None:
        """I without ``retain_graph``: the input gradient and the eager parameters' gradients;
        the deferred matmuls' pre-hooks keep what W needs (``_SplitPlan``)."""
        start = GradientEdge(plan.embedding, 0) if self.takes_tokens else state.inputs
        handles = [m.node.register_prehook(m.read) for m in plan.matmuls]
        try:
            grads = torch.autograd.grad(
                [state.output], [start, *plan.eager],
                None if state.output_grad is None else [state.output_grad], allow_unused=True)
        finally:
            for handle in handles:  # before the graph goes: the nodes must still be alive
                handle.remove()
        missed = [m for m in plan.matmuls if m.grad is None]
        for m in missed:
            m.node = None
        if missed:  # a matmul that I did not reach: its weight would get no gradient
            raise RuntimeError(f"stage {self.index}: the input-gradient pass did not reach the"
                               f" matmul of a {tuple(missed[0].weight.shape)} weight")
        for param, grad in zip(plan.eager, grads[1:]):
            if grad is not None:
                _accumulate(param, grad)
        state.plan, state.output_grad = plan, None
        state.inputs = state.output = None  # type: ignore[assignment]  (frees the graph)
        if self.takes_tokens:
            plan.embedding_grad = grads[0]
            return None
        return grads[0]

    def held_for_weight(self, microbatch: int) -> list[torch.Tensor]:
        """The tensors ``microbatch`` holds between its I and its W beyond what autograd saved
        (the deferred matmuls' inputs and output gradients, or on the retaining path the saved
        gradients at the intermediates), for the memory recorder."""
        state = self._in_flight.get(microbatch)
        if state is None:
            return []
        if state.plan is not None:
            return state.plan.held()
        return [g for group in state.param_groups or () for grads in group.get("grads") or ()
                for g in grads or () if g is not None]

    def backward_weight(self, microbatch: int) -> None:
        """W: accumulate the weight gradients of ``microbatch`` into ``.grad``; frees its state."""
        state = self._in_flight.pop(microbatch)
        plan = state.plan
        if plan is not None:
            with torch.no_grad():
                self._weight_grads(plan)
        elif self.takes_tokens:
            torch.autograd.backward(state.output, state.output_grad)
        else:
            params = self.parameters()
            stage_backward_weight(params, state.param_groups)
            # W set ``.grad`` itself, so no post-accumulate hook ran: a replicated weight whose
            # input is a sequence shard (SP's norms) still holds a Partial sum, which the
            # clipping norm would count as if replicated. Reduce it as B's hook would.
            for param in params:
                match_grad_placement(param)

    @staticmethod
    def _weight_grads(plan: _SplitPlan) -> None:
        """W of the freeing split: every deferred matmul's gradients, then the embedding's."""
        while plan.matmuls:  # popped: each matmul's tensors go as soon as its gradient is in
            for param, grad in plan.matmuls.pop().weight_grads():
                _accumulate(param, grad)
        if plan.embedding is not None:
            (grad,) = torch.autograd.grad([GradientEdge(plan.embedding, 0)],
                                          [plan.embedding_weight], [plan.embedding_grad])
            _accumulate(plan.embedding_weight, grad)

    def backward(self, microbatch: int, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        """B: one backward pass for the input and the weights; returns the input gradient."""
        state = self._in_flight.pop(microbatch)
        torch.autograd.backward(state.output, output_grad)  # loss: output_grad None means 1
        return None if self.takes_tokens else state.inputs.grad

    @property
    def holds_activations(self) -> bool:
        return bool(self._in_flight)


def build_stages(args: TransformerArgs, schedule: Schedule, layers: Sequence[range], rank: int,
                 device: torch.device | str, seed: int,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 ) -> dict[int, PipelineStage]:
    """The stages ``rank`` owns under ``schedule.placement``, with ``layers[model stage]`` each,
    made on the meta device and initialised by name, so every slice holds the full model's
    weights (and the copies of a stage on different routes start identical). A schedule with
    vocabulary passes (``Schedule.has_vocab_passes``) keeps the embedding and the head out of
    the stages (``loom.parallel.vocab_pipeline.VocabShard`` holds them): the last stage ends at
    the final norm."""
    stages = {}
    length = schedule.stages_per_route
    vocab = schedule.has_vocab_passes
    for index in schedule.stages_of(rank):
        module = build_model(args, device="meta", layer_ids=layers[index % length],
                             with_embedding=schedule.is_first(index) and not vocab,
                             with_head=schedule.is_last(index))
        if vocab and module.output is not None:
            module.output = nn.Identity()  # before any memory: the head rows are the shards'
            module.head_in_vocab_shards = True
        module.to_empty(device=device)
        reset_parameters(module, seed)  # a tied head starts as the embedding (seeded_name)
        stages[index] = PipelineStage(index, length, module, autocast, vocab_parallel=vocab)
    for route in range(schedule.num_routes if length > 1 and not vocab else 0):
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

    Vocabulary parallelism across the pipeline (``vocab``, a ``VocabShard``): ``tok_embeddings``
    and ``output`` are this rank's rows of them, under the full names; the last stage gives only
    its ``norm``. The rows of one name differ by rank: ``loom.train.full_state`` concatenates
    them in pp order.

    Routes (bidirectional schedules): ``replicas`` are the modules of this rank's stages whose
    copy on route 0 lives on another rank. After the runtime's copy sum they hold the same
    gradients as that copy, so ``tied_replicas`` lists their parameters too: the global norm
    counts each model parameter once, on the rank of its route-0 copy, and clipping scales the
    replicas by the same factor (the copies stay bit-identical).
    """

    def __init__(self, modules: Sequence[Transformer],
                 replicas: Sequence[Transformer] = (), vocab: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        self._tie_replica = False
        if vocab is not None:  # this rank's rows of the embedding and the head (VocabShard)
            self.tok_embeddings = vocab.tok_embeddings
        # by identity: a copy's tied head and embedding are one Parameter, listed once
        self._route_replicas = list({id(p): p for module in replicas
                                     for p in module.parameters()}.values())
        for module in modules:
            if module.tok_embeddings is not None:
                self.tok_embeddings = module.tok_embeddings
            for name, layer in module.layers.items():
                self.layers[name] = layer
            if module.output is not None and vocab is not None:
                self.norm = module.norm
            elif module.output is not None:
                if module.args.tie_embeddings and "tok_embeddings" not in self._modules:
                    self.tok_embeddings = _TiedHead(module.output.weight)
                    self._tie_replica = True
                self.norm, self.output = module.norm, module.output
        if vocab is not None:
            self.output = vocab.output

    def tied_replicas(self) -> list[nn.Parameter]:
        """Parameters another rank counts in the global norm: the tied head weight when this rank
        holds it without the embedding, and the route replicas' parameters (see the class)."""
        return ([self.output.weight] if self._tie_replica else []) + self._route_replicas

    def forward(self, *args: Any) -> None:  # pragma: no cover - a container, not a model
        raise RuntimeError("LocalStages holds a rank's pipeline stages; run them with the runtime")
