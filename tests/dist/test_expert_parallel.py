"""Expert parallelism is one process with the experts sharded and the batch split over ep.

Parity: the same seeded MoE model (2 MoE layers, 4 experts top-2, one shared expert) and batch,
3 AdamW steps in fp32 on one process and on ep = 2 and 4 ranks, dropless and with a capacity
factor that drops assignments. The loss (cross entropy + coef * balancing loss, averaged over the
ep ranks), every gradient (each rank's expert shard against the same rows of the one-process
gradient) and the router's choices and drops per token must match. Communication: the ledger's
bytes per step equal the formulas below, computed from the one-process routing, ratio exactly 1.
A 4-rank run folds the axes (dp_replicate=2 x ep=2, DDP on the dense part) as the trainer will.
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.models.llama import Transformer, reset_parameters
from loom.models.layers import TransformerArgs
from loom.models.moe import MoEFeedForward
from loom.parallel import comm
from loom.parallel.comm import CommLedger
from loom.parallel.expert import (apply_expert_parallel, clip_grad_norm, expert_parameter_names,
                                  gather_expert_weights, reduce_gradients)

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=64,
                       max_seq_len=64, n_experts=4, top_k=2, expert_ffn_dim=64,
                       n_shared_experts=1, aux_loss_coef=0.1)
BATCH, SEQ, STEPS, SEED, LR = 4, 32, 3, 1234, 3e-3
CAPACITY = 1.0  # C = ceil(1.0 * 32 * 2 / 4) = 16 assignments per expert per sequence: drops some
FP32, INT64 = 4, 8
# Step 1 starts from identical weights: only summation order differs (the ep average of losses
# and dense gradients, expert gradients summed in another order). Later steps: Adam turns
# rounding-level gradient differences into ~lr weight differences (see test_data_parallel.py).
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
LAYOUTS = [(2, 0.0), (2, CAPACITY), (4, 0.0), (4, CAPACITY)]


def _args(capacity_factor):
    return dataclasses.replace(ARGS, capacity_factor=capacity_factor)


def _batch():
    # One random batch, repeated: it is memorised, so the loss falls and the runs really train.
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _model(capacity_factor):
    model = Transformer(_args(capacity_factor))
    reset_parameters(model, SEED)
    return model


@functools.cache
def _expert_names():
    return frozenset(expert_parameter_names(_model(0.0)))


def _moes(model):
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def _train(model, rows, after_backward, average_loss, ledger=None):
    """3 AdamW steps on ``rows`` of the batch; per-step loss, gradients, routing, comm records."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = {"loss": [], "grads": [], "routing": [], "comm": []}
    inputs, targets = (t[rows] for t in _batch())
    for _ in range(STEPS):
        if ledger is not None:
            ledger.reset()
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss = loss + ARGS.aux_loss_coef * model.moe_aux_loss()
        loss.backward()
        after_backward()
        if ledger is not None:
            out["comm"].append({k: vars(r).copy() for k, r in ledger.records.items()})
        out["loss"].append(average_loss(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["routing"].append([(m.routing.topi_BSK, m.routing.keep_BSK) for m in _moes(model)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def ep_training(ctx, ep, capacity_factor):
    group = dist.group.WORLD
    ledger = CommLedger()
    model = _model(capacity_factor)
    ep_record = apply_expert_parallel(model, group, ledger)
    initial = gather_expert_weights(model, ep_record)  # before the ledger is reset by step 1
    per_rank = BATCH // ep

    def average_loss(loss):  # every rank holds the same number of tokens and sequences
        comm.all_reduce(loss, group, axis="ep")  # not in the ledger: logging only
        return (loss / ep).item()

    def after_backward():
        reduce_gradients(model, ep_record)

    out = _train(model, slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank), after_backward,
                 average_loss, ledger)
    out["clip_norm"] = clip_grad_norm(model, 0.0, ep_record).item()
    out["initial_experts"] = initial
    return out


_references, _runs = {}, {}


def _reference(capacity_factor):
    if capacity_factor not in _references:
        model = _model(capacity_factor)
        out = _train(model, slice(None), lambda: None, lambda loss: loss.item())
        out["clip_norm"] = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None]).item()
        _references[capacity_factor] = out
    return _references[capacity_factor]


@pytest.fixture(scope="module")
def runs(dist):
    def get(ep, capacity_factor):
        if (ep, capacity_factor) not in _runs:
            _runs[ep, capacity_factor] = dist.run(ep, ep_training, ep, capacity_factor)
        return _runs[ep, capacity_factor]
    return get


def _shard(name, full, ep, rank):
    """The rows of a one-process gradient that ep rank ``rank`` holds."""
    if name not in _expert_names():
        return full
    shard = ARGS.n_experts // ep
    return full[rank * shard:(rank + 1) * shard]


def test_capacity_example_really_drops_and_the_loss_moves():
    dropped = sum((~keep).sum().item() for _, keep in _reference(CAPACITY)["routing"][0])
    assert dropped > 0
    assert all(keep.all() for _, keep in _reference(0.0)["routing"][0])
    losses = _reference(0.0)["loss"]
    assert losses[-1] < losses[0] - 0.2


@pytest.mark.parametrize("ep, capacity_factor", LAYOUTS)
def test_training_matches_one_process(runs, ep, capacity_factor):
    reference = _reference(capacity_factor)
    per_rank = BATCH // ep
    for rank, result in enumerate(runs(ep, capacity_factor)):
        for step in range(STEPS):
            rtol, atol = (RTOL_FIRST, ATOL_FIRST) if step == 0 else (RTOL, ATOL)
            label = f"ep={ep} capacity={capacity_factor} rank {rank} step {step + 1}"
            torch.testing.assert_close(result["loss"][step], reference["loss"][step], rtol=rtol,
                                       atol=atol, msg=lambda m: f"{label} loss: {m}")
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            for layer, ((topi, keep), (want_topi, want_keep)) in enumerate(
                    zip(result["routing"][step], reference["routing"][step])):
                assert torch.equal(topi, want_topi[rows]), f"{label} layer {layer} choices"
                assert torch.equal(keep, want_keep[rows]), f"{label} layer {layer} drops"
            assert result["grads"][step].keys() == reference["grads"][step].keys()
            for name, full in reference["grads"][step].items():
                torch.testing.assert_close(result["grads"][step][name],
                                           _shard(name, full, ep, rank), rtol=rtol, atol=atol,
                                           msg=lambda m: f"{label} {name}: {m}")


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_shards_are_cut_from_the_seeded_full_value(runs, ep):
    reference = dict(_model(0.0).named_parameters())
    for result in runs(ep, 0.0):
        assert result["initial_experts"].keys() == _expert_names()
        for name, full in result["initial_experts"].items():
            assert torch.equal(full, reference[name]), name  # bit for bit


@pytest.mark.parametrize("ep, capacity_factor", LAYOUTS)
def test_gradient_norm_counts_each_expert_shard_once(runs, ep, capacity_factor):
    want = _reference(capacity_factor)["clip_norm"]
    for result in runs(ep, capacity_factor):
        assert result["clip_norm"] == pytest.approx(want, rel=1e-4)


def _expected_comm(ep, capacity_factor, step):
    """Analytical bytes of one rank per training step (forward + backward), by (axis, op)."""
    E, D, per_rank, local = ARGS.n_experts, ARGS.dim, BATCH // ep, ARGS.n_experts // ep
    expected = []
    dense = [p for n, p in _model(capacity_factor).named_parameters() if n not in _expert_names()]
    dense_bytes = sum(p.numel() for p in dense) * FP32
    for rank in range(ep):
        calls = payload = wire = 0
        for topi, keep in _reference(capacity_factor)["routing"][step]:
            # counts[j, e]: kept assignments of rank j's sequences to expert e.
            counts = torch.stack([torch.bincount(topi[j * per_rank:(j + 1) * per_rank][
                keep[j * per_rank:(j + 1) * per_rank]], minlength=E) for j in range(ep)])
            mine = slice(rank * local, (rank + 1) * local)
            a_out = counts[rank].sum().item()  # rows this rank dispatches
            a_in = counts[:, mine].sum().item()  # rows its experts receive
            a_self = counts[rank, mine].sum().item()  # rows that never leave the rank
            # Forward: counts (E int64), dispatch (a_out rows), combine (a_in rows); backward:
            # combine reversed (a_out rows), dispatch reversed (a_in rows). A rank keeps its own.
            calls += 5
            payload += E * INT64 + 2 * (a_out + a_in) * D * FP32
            wire += E * INT64 * (ep - 1) / ep + 2 * (a_out + a_in - 2 * a_self) * D * FP32
        entry = {("ep", "all_to_all"): (calls, payload, wire)}
        # Dense gradients averaged over ep: one all-reduce each, 2 (ep-1)/ep of the bytes.
        entry[("ep", "all_reduce")] = (len(dense), dense_bytes, 2 * (ep - 1) / ep * dense_bytes)
        expected.append(entry)
    return expected


@pytest.mark.parametrize("ep, capacity_factor", LAYOUTS)
def test_counted_bytes_equal_the_formulas(runs, ep, capacity_factor):
    for step in range(STEPS):
        expected = _expected_comm(ep, capacity_factor, step)
        for rank, result in enumerate(runs(ep, capacity_factor)):
            records = result["comm"][step]
            assert set(records) == set(expected[rank]), (rank, step)
            for key, (calls, payload, wire) in expected[rank].items():
                got = records[key]
                assert got["calls"] == calls, (key, got)
                assert got["payload_bytes"] / payload == 1.0, (key, got, payload)
                assert got["wire_bytes"] / wire == 1.0, (key, got, wire)


def folded_training(ctx):
    """dp_replicate=2 x ep=2, wired as the trainer should: attention and every replicated weight
    average over the 4 data-parallel ranks (Loom's ``GradientReducer`` on the flattened dp mesh,
    given only the dense parameters); each expert shard is held by 2 ranks (one per dp_replicate
    coordinate), summed over them and divided by dp x ep = 4 (``reduce_gradients(dense=False)``)."""
    from loom.parallel.data import GradientReducer
    from loom.topology import RankGrid, build_mesh

    grid = RankGrid({"dp_replicate": 2, "ep": 2})
    meshes = build_mesh(grid, "cpu")
    model = _model(CAPACITY)
    ep_record = apply_expert_parallel(model, meshes.root["ep"].get_group())
    experts = expert_parameter_names(model)
    dense = [p for n, p in model.named_parameters() if n not in experts]
    reducer = GradientReducer(dense, meshes.dp.get_group(), meshes.dp.size())
    row = grid.index(ctx.rank, "dp_replicate", "ep")  # the loader splits the batch over dp x ep
    inputs, targets = (t[row:row + 1] for t in _batch())
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    (loss + ARGS.aux_loss_coef * model.moe_aux_loss()).backward()
    reducer.finish()
    reduce_gradients(model, ep_record,
                     dp_group=meshes.root["dp_replicate"].get_group(), dense=False)
    return grid.index(ctx.rank, "ep"), {n: p.grad for n, p in model.named_parameters()}


def test_folded_dp_x_ep_with_the_gradient_reducer_matches_one_process(dist):
    reference = _reference(CAPACITY)["grads"][0]
    for ep_rank, grads in dist.run(4, folded_training):
        for name, full in reference.items():
            torch.testing.assert_close(grads[name], _shard(name, full, 2, ep_rank),
                                       rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                       msg=lambda m: f"dp2 x ep2 {name}: {m}")
