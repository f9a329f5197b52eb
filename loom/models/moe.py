"""Mixture-of-experts feed-forward (top-k softmax router, SwiGLU or GELU experts), single device.

``MoEFeedForward`` replaces ``FeedForward`` in the layers ``TransformerArgs.moe_layer`` selects.
Per token: router logits ``x W_r`` (D -> E), softmax in fp32, the top ``k`` experts, their weights
renormalised to sum to one (Mixtral; DeepSeekMoE keeps the raw probabilities:
``renormalize_top_k=False``); the output is ``sum_k w_k * expert_k(x)`` plus, when
``n_shared_experts > 0``, an always-active SwiGLU of hidden size ``n_shared * F_e`` (DeepSeekMoE's
shared experts, fused into one: a sum of SwiGLUs is one SwiGLU with the hidden dims concatenated).

**Routing group = one sequence** (one document with documents, below). Capacity and the
load-balancing statistics are computed per sequence (per row of the ``[B, S, D]`` input), never
over the batch. A sequence is never split by
data or expert parallelism or by microbatching, so every layout routes, drops and balances
exactly as one process does (parity tests depend on it; only context parallelism, which splits
sequences, would change the groups). The balancing loss is therefore the sequence-wise form of
DeepSeek-V3 (eq. 17-20), with the normalisation of Switch Transformer (eq. 4-6) / DeepSeekMoE:

    aux = mean over sequences of  E * sum_e f_e * P_e,
    f_e = (assignments of the sequence to expert e) / (S * k),  P_e = mean router prob of e,

so a perfectly balanced router scores 1.0 whatever E and k. f is a count (no gradient); the
gradient flows through P into the router. The trainer adds ``aux_loss_coef * aux_loss`` to its
objective; where no single objective sees every layer (pipeline stages), the layer itself adds the
loss's gradient in backward (``aux_loss_backward_scale``, through the combine weights).

**Sequences split over ranks** (context parallelism): a rank holds ``S/parts`` tokens of every
sequence. ``MoEFeedForward.sequence_statistics`` (set from outside, ``None`` by default) then
averages the two per-sequence statistics ``f`` and ``P`` (``[2, B, E]``, computed over the local
tokens) over the parts: the parts are equal shares, so the mean of the parts' ``f`` and ``P`` is
the whole sequence's, and the balancing loss is one process's on every part. Routing itself is
per token, so dropless routing needs nothing else. Capacity cannot be split this way (a queue
position depends on the order of all the sequence's tokens), so ``route`` refuses the pair.
Documents split over ranks (packed rows or varlen under cp) are not equal shares, so their
statistics are summed instead (``MoEFeedForward.document_counts``): each rank scatters its
tokens' assignments per expert and its token count by document id (run ordinals of the whole
row, equal on every part) and the parts' counts are summed; f is then the whole document's,
P stays per token, and the balancing loss is the same sum over tokens as below, each rank's
share of it taken over its own tokens.

**Documents as routing groups** (``data.packing = pack | varlen``: ``forward(x, documents)``
with the model's ``DocumentMask``). A row then holds several documents (and, packed, padding),
so the routing group is the *document*, as attention's is: a document's ``f`` and ``P``, and its
capacity ``ceil(capacity_factor * n_d * k / E)`` over its ``n_d`` tokens, are its own whatever
row, microbatch or rank it lands in. Padding (a negative id) chooses no expert, takes no queue
place and no part in any statistic. The balancing loss is then defined **per token**:

    aux_loss = sum over the tokens t of every document d of  E * sum_e f_{d,e} * p_{t,e}
             (= sum over documents of  n_d * E * sum_e f_{d,e} P_{d,e}),

a *sum* that the trainer divides by the step's real tokens (all ranks and microbatches), exactly
as it does the cross entropy: the step's value is the token-weighted mean of DeepSeek-V3's
sequence-wise loss over its documents, independent of how documents are spread over
microbatches and ranks. (A mean per microbatch or per row, then averaged, would weigh a short
microbatch's tokens more, and count padding.) Megatron's ``aux_loss`` and TorchTitan's
``batch_wise`` take ``f`` over all tokens of a microbatch (Megatron's ``global_aux_loss`` over
the data-parallel group too), which depends on how tokens are grouped into microbatches;
their ``seq_aux_loss`` / ``sequence_wise`` take it per row: the form here, with the document
as the sequence and the token weights made explicit. Rows without documents keep the mean over
sequences above.

**Capacity** (``capacity_factor > 0``): each expert takes at most ``C = ceil(capacity_factor * S
* k / E)`` assignments per sequence. Priority is GShard's: all first choices in token order, then
all second choices, and so on; assignments past C are dropped (that expert contributes nothing
to the token; the residual stream carries it). The kept weights are not renormalised.
``capacity_factor = 0`` is dropless: every assignment is computed.

Experts are ``GroupedExperts`` of the dense MLP's kind (SwiGLU, or GELU without ``w3``):
``w1``, ``w3`` ``[E, D, F]`` and ``w2`` ``[E, F, D]`` stacked
along dim 0, so expert parallelism shards dim 0 and keeps global parameter names. The expert
computation goes through ``MoEFeedForward.dispatcher(x_AD, counts_E, experts)`` (tokens sorted
by global expert id, counts per global expert); ``loom.parallel.expert`` swaps it for the
all-to-all version. ``forward`` is ``route_tokens`` then ``experts_output``, so tensor
parallelism can route on the full tokens and run the experts on its weight shards (passing the
``experts``/``shared`` callables) between its own collectives without re-implementing either.
Nothing here imports torch's distributed package.

Shape legend: B batch, S sequence, D model dim, E experts, K top-k, F expert hidden dim,
T tokens (B*S), A kept token-expert assignments.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.document_attention import DocumentMask
from loom.models.layers import FeedForward, TransformerArgs


class Routing(NamedTuple):
    """The router's decisions for one forward, assignments sorted by expert (stable)."""

    token_A: torch.Tensor  # flat token index (b * S + s) of each kept assignment
    expert_A: torch.Tensor  # its global expert id, non-decreasing
    weight_A: torch.Tensor  # its combine weight (fp32, differentiable)
    counts_E: torch.Tensor  # kept assignments per expert (int64)
    topi_BSK: torch.Tensor  # chosen experts before dropping
    keep_BSK: torch.Tensor  # False where capacity dropped the assignment
    aux_loss: torch.Tensor  # scalar balancing loss: mean over sequences, or with documents
    # the sum over their tokens of each token's term (the caller divides by the step's tokens)


def capacity(seq_len: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Assignments one expert accepts per sequence; 0 means unlimited (dropless)."""
    if capacity_factor <= 0:
        return 0
    return math.ceil(capacity_factor * seq_len * top_k / n_experts)


# ``[2, B, E]`` (f, P) of this rank's part of each sequence -> their mean over the parts (the
# whole sequences'), differentiable in P; see the module docstring. Context parallelism sets it.
SequenceStatistics = Callable[[torch.Tensor], torch.Tensor]


class DocumentCounts(Protocol):
    """Documents split over ranks (context parallelism; module docstring): this rank's counts
    per document -> the whole documents'. Context parallelism sets it."""

    def slots(self, documents: DocumentMask) -> int:
        """Document slots per row, the same on every part: one more than the largest document
        id (ids are run ordinals of the whole row, equal on every part)."""

    def __call__(self, counts_BDX: torch.Tensor) -> torch.Tensor:
        """``[B, slots, X]`` counts of this rank's tokens -> their sum over the parts."""


def route(logits_BSE: torch.Tensor, top_k: int, capacity_factor: float = 0.0,
          renormalize: bool = True,
          sequence_statistics: SequenceStatistics | None = None,
          documents: DocumentMask | None = None,
          document_counts: DocumentCounts | None = None) -> Routing:
    """Top-k routing with per-sequence capacity and balancing loss (see the module docstring).
    ``sequence_statistics``: the rows are parts of longer sequences; it averages f and P over
    the parts (dropless only). ``documents``: the rows' documents are the routing groups, the
    padding routed nowhere, the balancing loss a sum over tokens (module docstring);
    ``document_counts``: those documents are parts of documents split over ranks, whose
    assignment and token counts it sums (dropless only)."""
    B, S, E = logits_BSE.shape
    probs_BSE = logits_BSE.float().softmax(dim=-1)  # fp32 router as Mixtral / Switch
    topw_BSK, topi_BSK = probs_BSE.topk(top_k, dim=-1)
    if renormalize:
        topw_BSK = topw_BSK / topw_BSK.sum(dim=-1, keepdim=True)
    onehot_BSKE = F.one_hot(topi_BSK, E)
    if documents is not None and document_counts is not None:
        if capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} needs whole documents (a"
                             " queue position depends on the order of all of a document's"
                             " tokens); split documents route dropless only")
        keep_BSK, aux_loss = _split_document_groups(onehot_BSKE, probs_BSE, documents,
                                                    document_counts)
        return _assignments(topi_BSK, topw_BSK, keep_BSK, aux_loss, E)
    if documents is not None:
        if sequence_statistics is not None:
            raise ValueError("documents split over ranks need their counts summed over the"
                             " parts (document_counts); sequence statistics average equal"
                             " shares of whole rows")
        keep_BSK, aux_loss = _document_groups(onehot_BSKE, probs_BSE, documents,
                                              capacity_factor)
        return _assignments(topi_BSK, topw_BSK, keep_BSK, aux_loss, E)
    f_BE = onehot_BSKE.sum(dim=(1, 2)).float() / (S * top_k)
    P_BE = probs_BSE.mean(dim=1)
    if sequence_statistics is not None:
        if capacity_factor > 0:
            raise ValueError(f"capacity_factor={capacity_factor} needs whole sequences (a queue"
                             " position depends on the order of all of a sequence's tokens);"
                             " split sequences route dropless only (capacity_factor = 0)")
        f_BE, P_BE = sequence_statistics(torch.stack([f_BE, P_BE])).unbind(0)
    aux_loss = (E * (f_BE * P_BE).sum(dim=-1)).mean()

    keep_BSK = torch.ones_like(topi_BSK, dtype=torch.bool)
    cap = capacity(S, E, top_k, capacity_factor)
    if cap:
        # Queue position of each assignment at its expert, slot-major (first choices first).
        onehot_BAE = onehot_BSKE.transpose(1, 2).reshape(B, top_k * S, E)
        position_BA = ((onehot_BAE.cumsum(dim=1) - 1) * onehot_BAE).sum(dim=-1)
        keep_BSK = (position_BA < cap).view(B, top_k, S).transpose(1, 2)

    return _assignments(topi_BSK, topw_BSK, keep_BSK, aux_loss, E)


def _document_groups(onehot_BSKE: torch.Tensor, probs_BSE: torch.Tensor,
                     documents: DocumentMask,
                     capacity_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep_BSK, aux_loss)`` with each document a routing group (module docstring): the
    per-sequence rules, with a document's sums taken between its first and last token."""
    B, S, K, E = onehot_BSKE.shape
    real_BS = documents.real_BS
    onehot_BSKE = onehot_BSKE * real_BS[:, :, None, None]  # padding chooses nothing
    first_BS, last_BS = documents.run_bounds
    tokens_BS = (last_BS - first_BS + 1).clamp(min=1)  # n_d, at every token of d

    def at(t_BSKE: torch.Tensor, index_BS: torch.Tensor) -> torch.Tensor:
        return t_BSKE.gather(1, index_BS[:, :, None, None].expand_as(t_BSKE))

    # Inclusive running count per (slot, expert) inside the row, restarted at each document.
    running_BSKE = onehot_BSKE.cumsum(dim=1)
    before_BSKE = at(running_BSKE, first_BS) - at(onehot_BSKE, first_BS)
    within_BSKE = running_BSKE - before_BSKE
    total_BSKE = at(running_BSKE, last_BS) - before_BSKE  # the document's, per slot

    f_BSE = total_BSKE.sum(dim=2).float() / (tokens_BS[:, :, None] * K)
    term_BS = E * (f_BSE * probs_BSE).sum(dim=-1)
    aux_loss = (term_BS * real_BS).sum()

    keep_BSK = real_BS[:, :, None].expand(B, S, K)
    if capacity_factor > 0:
        # GShard's slot-major queue inside the document: the earlier slots' assignments to
        # the expert, then this slot's up to this token
        earlier_BSKE = total_BSKE.cumsum(dim=2) - total_BSKE
        position_BSK = ((within_BSKE - 1 + earlier_BSKE) * onehot_BSKE).sum(dim=-1)
        cap_BS = torch.ceil(tokens_BS.double() * capacity_factor * K / E).long()
        keep_BSK = keep_BSK & (position_BSK < cap_BS[:, :, None])
    return keep_BSK, aux_loss


def _split_document_groups(onehot_BSKE: torch.Tensor, probs_BSE: torch.Tensor,
                           documents: DocumentMask,
                           counts: DocumentCounts) -> tuple[torch.Tensor, torch.Tensor]:
    """``_document_groups`` (dropless) where a rank holds parts of documents: each token's
    document is its id (a run ordinal of the whole row, ``loom.parallel.context_documents``),
    the document's per-expert assignments and its token count are this rank's, scattered by
    id and summed over the parts (counts, so exact in fp32, and no gradient: f is a count)."""
    B, S, K, E = onehot_BSKE.shape
    real_BS = documents.real_BS
    slots = counts.slots(documents)
    id_BS = documents.document_ids.long().clamp(min=0)
    # per token: its assignments per expert, then 1 (the token itself); padding adds nothing
    mine_BSX = torch.cat([onehot_BSKE.sum(dim=2), torch.ones_like(onehot_BSKE[:, :, 0, :1])],
                         dim=-1).float() * real_BS[:, :, None]
    local_BDX = mine_BSX.new_zeros(B, slots, E + 1).scatter_add_(
        1, id_BS[:, :, None].expand(B, S, E + 1), mine_BSX)
    whole_BSX = counts(local_BDX).gather(1, id_BS[:, :, None].expand(B, S, E + 1))
    f_BSE = whole_BSX[:, :, :E] / (whole_BSX[:, :, E:].clamp(min=1) * K)
    term_BS = E * (f_BSE * probs_BSE).sum(dim=-1)
    aux_loss = (term_BS * real_BS).sum()
    return real_BS[:, :, None].expand(B, S, K), aux_loss


def _assignments(topi_BSK: torch.Tensor, topw_BSK: torch.Tensor, keep_BSK: torch.Tensor,
                 aux_loss: torch.Tensor, E: int) -> Routing:
    """The kept assignments in token order, then stably sorted by expert."""
    top_k = topi_BSK.shape[-1]
    kept = keep_BSK.flatten().nonzero().squeeze(1)
    kept = kept[torch.argsort(topi_BSK.flatten()[kept], stable=True)]
    expert_A = topi_BSK.flatten()[kept]
    return Routing(token_A=kept // top_k, expert_A=expert_A, weight_A=topw_BSK.flatten()[kept],
                   counts_E=torch.bincount(expert_A, minlength=E), topi_BSK=topi_BSK,
                   keep_BSK=keep_BSK, aux_loss=aux_loss)


class GroupedExperts(nn.Module):
    """Experts with stacked weights, the dense MLP's kind (``TransformerArgs.mlp``): SwiGLU
    ``w2(silu(w1 x) * w3 x)`` or, ``gated=False``, GELU ``w2(gelu(w1 x))`` (tanh approximation,
    as ``layers.FeedForward``; GPT-style MoE: GShard's, Megatron's GPT without ``--swiglu``),
    which has no ``w3``. May hold a contiguous shard of the experts (EP)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, gated: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        if gated:
            self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.gated = gated

    def forward(self, x_AD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by (local) expert, ``counts[e]`` rows for expert e, in order."""
        outs = []
        for e, x in enumerate(x_AD.split(counts)):  # a loop: CPU has no grouped GEMM
            if self.gated:
                hidden = F.silu(x @ self.w1[e]) * (x @ self.w3[e])
            else:
                hidden = F.gelu(x @ self.w1[e], approximate="tanh")
            outs.append(hidden @ self.w2[e])
        return torch.cat(outs)


# (rows, counts per global expert, experts) -> rows; ``experts`` is a ``GroupedExperts`` or any
# callable with its ``(x_AD, counts)`` signature (tensor parallelism passes its local shards).
Dispatcher = Callable[[torch.Tensor, torch.Tensor, Callable], torch.Tensor]


def local_dispatch(x_AD: torch.Tensor, counts_E: torch.Tensor,
                   experts: GroupedExperts) -> torch.Tensor:
    """Every expert is local: compute each group of rows with its expert."""
    return experts(x_AD, counts_E.tolist())


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the combine weights; their backward also starts the balancing loss's backward
    with gradient ``scale`` (the role of Megatron's ``MoEAuxLossAutoScaler``). The loss value is
    unchanged; the gradient is that of ``loss + scale * aux_loss``."""

    @staticmethod
    def forward(ctx, weight_A: torch.Tensor, aux_loss: torch.Tensor,
                scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return weight_A.view_as(weight_A)

    @staticmethod
    def backward(ctx, grad_A: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_A, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoEFeedForward(nn.Module):
    """Routed experts (+ optional shared experts); sets ``self.aux_loss`` on every forward."""

    def __init__(self, args: TransformerArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.capacity_factor, self.renormalize = args.capacity_factor, args.renormalize_top_k
        hidden = args.expert_ffn_dim or args.ffn_dim
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.n_experts, args.dim, hidden, args.mlp == "swiglu")
        shared_args = dataclasses.replace(args, ffn_dim=args.n_shared_experts * hidden)
        self.shared = FeedForward(shared_args) if args.n_shared_experts else None
        # The seam for expert parallelism (a plain callable, not a submodule).
        self.dispatcher: Dispatcher = local_dispatch
        self.aux_loss: torch.Tensor | None = None
        # > 0: the balancing loss's gradient, times this, joins backward inside the layer
        # (``_AuxLossGradient``), for callers that cannot add it to the loss (pipeline stages:
        # only the last one holds the loss). 0: the caller adds ``aux_loss`` to its objective.
        self.aux_loss_backward_scale = 0.0
        self.routing: Routing | None = None  # the last forward's decisions (tests, metrics)
        # The seams for sequences and documents split over ranks (callables, not submodules).
        self.sequence_statistics: SequenceStatistics | None = None
        self.document_counts: DocumentCounts | None = None

    def forward(self, x_BSD: torch.Tensor,
                documents: DocumentMask | None = None) -> torch.Tensor:
        return self.experts_output(x_BSD, self.route_tokens(x_BSD, documents))

    def route_tokens(self, x_BSD: torch.Tensor,
                     documents: DocumentMask | None = None) -> Routing:
        """The router's decisions for ``x_BSD`` (whole sequences; ``documents``: the rows'
        documents as routing groups); recorded on the module."""
        routing = route(self.router(x_BSD), self.top_k, self.capacity_factor, self.renormalize,
                        self.sequence_statistics, documents, self.document_counts)
        self.aux_loss, self.routing = routing.aux_loss, routing
        if self.aux_loss_backward_scale and torch.is_grad_enabled():
            weight_A = _AuxLossGradient.apply(routing.weight_A, routing.aux_loss,
                                              self.aux_loss_backward_scale)
            routing = routing._replace(weight_A=weight_A)
        return routing

    def experts_output(self, x_BSD: torch.Tensor, routing: Routing,
                       experts: Callable | None = None,
                       shared: Callable | None = None) -> torch.Tensor:
        """``sum_k w_k expert_k(x)`` over the kept assignments, plus the shared experts.

        The second seam (after ``dispatcher``): ``experts`` and ``shared`` default to this
        module's; tensor parallelism passes callables over its local weight shards, which makes
        the result this rank's partial sum.
        """
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        experts = self.experts if experts is None else experts
        y_AD = self.dispatcher(x_TD[routing.token_A], routing.counts_E, experts)
        y_AD = y_AD * routing.weight_A.unsqueeze(1).to(y_AD.dtype)
        # under autocast the experts' output is bf16 while the residual stream stays fp32
        out_TD = torch.zeros_like(x_TD).index_add(0, routing.token_A, y_AD.to(x_TD.dtype))
        out_BSD = out_TD.view(B, S, D)
        shared = self.shared if shared is None else shared
        if shared is not None:
            out_BSD = out_BSD + shared(x_BSD)
        return out_BSD


def set_aux_loss_backward_scale(model: nn.Module, scale: float) -> None:
    """Make every MoE layer of ``model`` add ``scale`` x its balancing loss's gradient in backward
    (``MoEFeedForward.aux_loss_backward_scale``); 0 turns it off."""
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            module.aux_loss_backward_scale = scale
