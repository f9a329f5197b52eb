"""Specifications for loom.models.moe: routing, balancing loss, capacity, and the MoE presets."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from loom.models import (PRESETS, active_parameter_count, build_model, parameter_count, preset,
                         reset_parameters)
from loom.models.document_attention import DocumentMask
from loom.models.moe import GroupedExperts, MoEFeedForward, capacity, route
from loom.models.presets import layer_parameter_count

torch.set_num_threads(1)


def moe_args(**changes):
    return dataclasses.replace(preset("tiny-moe"), **changes)


def naive_moe(moe: MoEFeedForward, x_BSD: torch.Tensor, keep_BSK=None) -> torch.Tensor:
    """The formula, token by token: sum over kept top-k of w_k * SwiGLU_{e_k}(x) (+ shared)."""
    probs = moe.router(x_BSD).float().softmax(-1)
    topw, topi = probs.topk(moe.top_k, dim=-1)
    if moe.renormalize:
        topw = topw / topw.sum(-1, keepdim=True)
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    out = torch.zeros_like(x_BSD)
    B, S, _ = x_BSD.shape
    for b in range(B):
        for s in range(S):
            x = x_BSD[b, s]
            for k in range(moe.top_k):
                if keep_BSK is not None and not keep_BSK[b, s, k]:
                    continue
                e = topi[b, s, k]
                out[b, s] += topw[b, s, k] * ((F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e])
    if moe.shared is not None:
        out = out + moe.shared(x_BSD)
    return out


# The naive path multiplies one token's vector at a time, the layer whole row blocks: only the
# summation order differs, on outputs of mean magnitude ~10 (weights ~N(0, 0.3)).
RTOL, ATOL = 1e-5, 1e-5


def make_moe(seed: int = 0, **changes) -> MoEFeedForward:
    torch.manual_seed(seed)
    moe = MoEFeedForward(moe_args(**changes))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


# --------------------------------------------------------------------------------------------
# Router


def test_top_k_picks_the_largest_probabilities_and_renormalises() -> None:
    logits = torch.log(torch.tensor([[[0.1, 0.5, 0.3, 0.1]]]))  # probabilities after softmax
    r = route(logits, top_k=2)
    assert r.topi_BSK.tolist() == [[[1, 2]]]
    # 0.3/0.8 and 0.5/0.8
    assert torch.allclose(r.weight_A.sort().values, torch.tensor([0.375, 0.625]))
    raw = route(logits, top_k=2, renormalize=False)
    assert torch.allclose(raw.weight_A.sort().values, torch.tensor([0.3, 0.5]))


def test_assignments_are_sorted_by_expert_with_counts() -> None:
    logits = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    r = route(logits, top_k=2)
    assert torch.equal(r.expert_A, r.expert_A.sort(stable=True).values)
    assert r.counts_E.sum() == 2 * 8 * 2 and r.counts_E.tolist() == torch.bincount(
        r.topi_BSK.flatten(), minlength=4).tolist()
    # token_A / expert_A are exactly the (token, choice) pairs of the router.
    pairs = sorted(zip(r.token_A.tolist(), r.expert_A.tolist()))
    want = sorted((t, e) for t, row in enumerate(r.topi_BSK.view(16, 2).tolist()) for e in row)
    assert pairs == want


def test_aux_loss_on_a_hand_example() -> None:
    # One sequence, 2 tokens, E = 2, top-1. Token 0: p = (0.8, 0.2) -> expert 0; token 1:
    # p = (0.6, 0.4) -> expert 0. f = (1, 0), P = (0.7, 0.3): aux = 2 * (1 * 0.7 + 0 * 0.3) = 1.4.
    logits = torch.log(torch.tensor([[[0.8, 0.2], [0.6, 0.4]]]))
    assert route(logits, top_k=1).aux_loss.item() == pytest.approx(1.4)
    # Balanced: token 1 prefers expert 1 -> f = (0.5, 0.5), P = (0.5, 0.5): aux = 1.0 (the minimum).
    balanced = torch.log(torch.tensor([[[0.8, 0.2], [0.2, 0.8]]]))
    assert route(balanced, top_k=1).aux_loss.item() == pytest.approx(1.0)
    # The loss is a mean over sequences (routing groups): stacking both gives the average.
    both = torch.cat([logits, balanced])
    assert route(both, top_k=1).aux_loss.item() == pytest.approx(1.2)


def test_aux_loss_gradient_reaches_the_router_probabilities_only() -> None:
    logits = torch.randn(1, 6, 4, requires_grad=True)
    route(logits, top_k=2).aux_loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_capacity_drops_later_assignments_first_choices_before_second() -> None:
    # 4 tokens, E = 2, top-2: every token picks both experts. C = ceil(0.5 * 4 * 2 / 2) = 2.
    # Token 0..3 first choices: 0, 0, 1, 0; second choices: 1, 1, 0, 1.
    # Expert 0 queue (slot-major): t0, t1, t3 (first), t2 (second) -> keeps t0, t1.
    # Expert 1 queue: t2 (first), then t0, t1, t3 (second) -> keeps t2, t0.
    p = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    r = route(torch.log(p).unsqueeze(0), top_k=2, capacity_factor=0.5)
    assert capacity(4, 2, 2, 0.5) == 2
    assert r.keep_BSK[0].tolist() == [[True, True], [True, False], [True, False], [False, False]]
    assert r.counts_E.tolist() == [2, 2]
    assert sorted(zip(r.token_A.tolist(), r.expert_A.tolist())) == [(0, 0), (0, 1), (1, 0), (2, 1)]


def test_capacity_is_per_sequence() -> None:
    # The same sequence twice drops the same assignments in both copies.
    logits = torch.randn(1, 16, 4, generator=torch.Generator().manual_seed(3)).expand(3, -1, -1)
    r = route(logits, top_k=2, capacity_factor=1.0)
    assert not r.keep_BSK.all()
    assert torch.equal(r.keep_BSK[0], r.keep_BSK[1]) and torch.equal(r.keep_BSK[0], r.keep_BSK[2])
    per_expert = [(r.topi_BSK[0][r.keep_BSK[0]] == e).sum().item() for e in range(4)]
    assert max(per_expert) <= capacity(16, 4, 2, 1.0) == 8


def test_dropless_is_the_default_and_keeps_everything() -> None:
    assert capacity(32, 4, 2, 0.0) == 0
    r = route(torch.randn(2, 32, 4), top_k=2)
    assert r.keep_BSK.all() and r.counts_E.sum() == 2 * 32 * 2


# --------------------------------------------------------------------------------------------
# The layer


@pytest.mark.parametrize("changes", [{}, {"n_shared_experts": 0}, {"renormalize_top_k": False},
                                     {"top_k": 1}], ids=["shared", "no-shared", "raw", "top1"])
def test_dropless_layer_equals_the_weighted_sum_of_experts(changes) -> None:
    moe = make_moe(**changes)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(moe(x), naive_moe(moe, x), rtol=RTOL, atol=ATOL)
    assert moe.aux_loss is not None and moe.aux_loss.ndim == 0


def test_capacity_layer_skips_exactly_the_dropped_assignments() -> None:
    moe = make_moe(capacity_factor=1.0)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    out = moe(x)
    keep = moe.routing.keep_BSK
    assert not keep.all(), "the example must drop something"
    torch.testing.assert_close(out, naive_moe(moe, x, keep), rtol=RTOL, atol=ATOL)


def test_grouped_experts_run_each_group_through_its_expert() -> None:
    experts = GroupedExperts(3, 4, 5)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(6, 4)
    y = experts(x, [2, 0, 4])
    e2 = (F.silu(x[2:] @ experts.w1[2]) * (x[2:] @ experts.w3[2])) @ experts.w2[2]
    torch.testing.assert_close(y[2:], e2)


def test_moe_model_forward_backward_and_aux_loss() -> None:
    args = moe_args()
    model = build_model(args, device="cpu")
    reset_parameters(model, seed=0)
    assert [args.moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert type(model.layers["0"].feed_forward).__name__ == "FeedForward"
    tokens = torch.randint(args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    aux = model.moe_aux_loss()
    layers = [model.layers[str(i)].feed_forward.aux_loss for i in (1, 2, 3)]
    torch.testing.assert_close(aux, sum(layers))
    assert 1.0 <= aux.item() / 3 < 2.0  # near-uniform router at init
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + args.aux_loss_coef * aux
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.layers["1"].feed_forward.router.weight.grad.abs().sum() > 0


def test_dense_model_has_no_aux_loss() -> None:
    model = build_model(preset("debug"), device="cpu")
    assert model.moe_aux_loss().item() == 0.0


def test_moe_every_and_dense_layers_select_the_moe_layers() -> None:
    args = moe_args(n_layers=6, moe_every=2, n_dense_layers=2)
    assert [i for i in range(6) if args.moe_layer(i)] == [3, 5]
    assert not any(preset("debug").moe_layer(i) for i in range(4))


def test_expert_weights_are_seeded_by_name_and_scaled() -> None:
    args = moe_args(n_layers=8)
    model = build_model(args, device="cpu")
    reset_parameters(model, seed=0)
    w = dict(model.named_parameters())
    residual_std = 0.02 / math.sqrt(2 * args.n_layers)
    w2 = w["layers.1.feed_forward.experts.w2"]
    assert abs(w2.std().item() - residual_std) < 0.1 * residual_std
    assert abs(w["layers.1.feed_forward.shared.w2.weight"].std().item() - residual_std) < (
        0.15 * residual_std)
    assert abs(w["layers.1.feed_forward.experts.w1"].std().item() - 0.02) < 0.002
    assert not torch.equal(w["layers.1.feed_forward.experts.w1"],
                           w["layers.2.feed_forward.experts.w1"])


# --------------------------------------------------------------------------------------------
# Presets and counts


@pytest.mark.parametrize("args", [moe_args(), moe_args(moe_every=2, n_dense_layers=0),
                                  moe_args(n_shared_experts=0, expert_ffn_dim=0)],
                         ids=["tiny-moe", "every-2", "no-shared"])
def test_parameter_count_equals_the_real_count(args) -> None:
    model = build_model(args)
    assert parameter_count(args) == sum(p.numel() for p in model.parameters())
    dense = sum(p.numel() for n, p in model.named_parameters() if "experts." not in n)
    routed_per_layer = 3 * args.dim * (args.expert_ffn_dim or args.ffn_dim)
    moe_layers = sum(args.moe_layer(i) for i in range(args.n_layers))
    assert active_parameter_count(args) == dense + moe_layers * args.top_k * routed_per_layer


def test_layer_parameter_count_per_layer() -> None:
    args = moe_args()  # layer 0 dense, layers 1-3 MoE
    model = build_model(args)
    for i in range(args.n_layers):
        layer = model.layers[str(i)]
        assert layer_parameter_count(args, i) == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("name, total, active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),      # Mixtral paper §2
    ("deepseek-moe-16b", 16.4e9, 2.8e9),   # DeepSeekMoE paper, Table 3 / §5
])
def test_moe_presets_match_published_sizes(name, total, active) -> None:
    args = PRESETS[name]
    assert abs(parameter_count(args) - total) / total < 0.01
    assert abs(active_parameter_count(args) - active) / active < 0.02
    assert sum(p.numel() for p in build_model(args).parameters()) == parameter_count(args)


def test_dense_presets_have_equal_total_and_active_counts() -> None:
    for name in ("tiny", "debug", "llama3-8b"):
        assert active_parameter_count(PRESETS[name]) == parameter_count(PRESETS[name])


def test_aux_loss_backward_scale_equals_adding_the_loss_to_the_objective() -> None:
    """Pipeline stages cannot add the balancing loss to the last stage's loss; the layer adds its
    gradient in backward instead. Both give the same gradient of every parameter, bit for bit."""
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    coef = 0.25

    def gradients(in_layer: bool) -> dict[str, torch.Tensor]:
        model = build_model(moe_args(vocab_size=64, max_seq_len=32), device="cpu")
        reset_parameters(model, 3)
        for module in model.modules():
            if isinstance(module, MoEFeedForward):
                module.aux_loss_backward_scale = coef if in_layer else 0.0
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        if not in_layer:
            loss = loss + coef * model.moe_aux_loss()
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    in_layer, in_objective = gradients(True), gradients(False)
    router = "layers.1.feed_forward.router.weight"
    assert in_objective[router].abs().max() > 0
    for name, grad in in_objective.items():
        assert torch.equal(in_layer[name], grad), name


def test_split_sequences_average_their_statistics_to_the_whole_sequences_loss() -> None:
    """Context parallelism's seam, in one process: each half of every sequence routes its own
    tokens; ``sequence_statistics`` averages (f, P) over the halves with an identity backward
    (as ``context.SequenceStatisticsMean`` does over cp). Each half's balancing loss is then the
    whole sequences', and the mean of the halves' gradients (the cp gradient average) is the
    whole sequences' gradient."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, 4, generator=g, requires_grad=True)
    whole = route(logits, top_k=2)
    (want,) = torch.autograd.grad(whole.aux_loss, logits)

    halves = logits.chunk(2, dim=1)
    stats = []  # each half's own (f, P), detached: what the all-reduce receives from peers
    for half in halves:
        route(half.detach(), 2, sequence_statistics=lambda s: stats.append(s.detach()) or s)
    mean = torch.stack(stats).mean(0)
    grads = []
    for half in halves:
        part = route(half, 2, sequence_statistics=lambda s: s + (mean - s).detach())
        torch.testing.assert_close(part.aux_loss, whole.aux_loss, rtol=1e-6, atol=0)
        grads.append(torch.autograd.grad(part.aux_loss, half, retain_graph=True)[0])
    torch.testing.assert_close(torch.cat(grads, dim=1) / 2, want, rtol=1e-6, atol=1e-8)
    # Capacity needs whole sequences (queue positions follow all of a sequence's tokens).
    with pytest.raises(ValueError, match="capacity_factor=1.0 needs whole sequences"):
        route(halves[0], 2, capacity_factor=1.0, sequence_statistics=lambda s: s)


def test_a_document_routes_as_it_would_alone_and_padding_nowhere():
    """With documents (packed rows, varlen microbatches) the routing groups are the documents:
    each keeps what it would keep alone, capacity included; padding (a negative id) takes no
    expert and no queue place; the balancing loss is the sum over tokens of each one's term,
    i.e. each document's own loss times its tokens."""
    torch.manual_seed(0)
    logits = torch.randn(2, 12, 4)
    ids = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3, [2] * 3 + [3] * 9])
    for capacity_factor in (0.0, 0.5, 1.0):
        routed = route(logits, 2, capacity_factor, documents=DocumentMask(ids))
        total = torch.zeros(())
        for row, begin, end in ((0, 0, 5), (0, 5, 9), (1, 0, 3), (1, 3, 12)):
            alone = route(logits[row:row + 1, begin:end], 2, capacity_factor)
            assert torch.equal(alone.keep_BSK[0], routed.keep_BSK[row, begin:end])
            total = total + alone.aux_loss * (end - begin)
        assert not routed.keep_BSK[0, 9:].any()  # padding: no expert, no queue place
        assert routed.counts_E.sum() == int(routed.keep_BSK.sum())
        torch.testing.assert_close(routed.aux_loss, total)
    # capacity 0.5 drops inside a document (the case is not trivial)
    assert not route(logits, 2, 0.5, documents=DocumentMask(ids)).keep_BSK[1].all()
