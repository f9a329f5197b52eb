"""Context parallelism (Ulysses, ring, hybrid, all-gather) is one process, split along the sequence.

Parity: the same seeded model and batches, trained 3 AdamW steps in fp32 on one process and on
cp = 2 and 4 ranks; the loss (mean of the cp ranks' local means) and every parameter's gradient
(averaged over cp) must match. The attention core alone is also compared (output, dQ, dK, dV).
Communication: the ledger's bytes per step must equal the analytical volume, ratio exactly 1.

The model has 8 query and 4 key/value heads (GQA), so every mode also checks that un-repeated
keys/values are moved and their gradients summed over the query heads they serve.
"""

import pytest
import torch
import torch.nn.functional as F

from loom.models.llama import Transformer, reset_parameters
from loom.models.layers import TransformerArgs, sdpa_causal
from loom.parallel import comm
from loom.parallel.comm import CommLedger
from loom.parallel.context import (CPLayout, ContextParallelAttention, apply_context_parallel,
                                   new_cp_groups, reduce_gradients_over_cp, sequence_positions,
                                   shard_sequence)

ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=128, vocab_size=64,
                       max_seq_len=64)
BATCH, SEQ, STEPS, SEED, LR = 2, 32, 3, 1234, 3e-3
FP32 = 4  # bytes per element
# Step 1 starts from identical weights: only summation order differs (blockwise softmax, the cp
# average of losses and gradients). Later steps: Adam turns rounding-level gradient differences
# into ~lr weight differences (see tests/dist/test_data_parallel.py), hence the looser bound.
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5

# (mode, cp, ulysses degree for hybrid): cp=2 hybrid is 1x2 by default (auto) and 2x1 when asked;
# both degenerate to one technique, so cp=4 (2x2) is the hybrid proper.
LAYOUTS = [("ulysses", 2, 0), ("ring", 2, 0), ("hybrid", 2, 0), ("hybrid", 2, 2),
           ("ulysses", 4, 0), ("ring", 4, 0), ("hybrid", 4, 2), ("allgather", 2, 0),
           ("allgather", 4, 0)]


def _batches():
    # One random batch, repeated: random tokens have no signal to learn across batches, but a
    # repeated batch is memorised, so the loss falls visibly (4.17 -> 3.47) and the test compares
    # runs that really trained.
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=g)
    return [(tokens[:, :-1], tokens[:, 1:])] * STEPS


def _model():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    reset_parameters(model, SEED)
    return model


def _train(model, shard, after_backward, average_loss, ledger=None):
    """3 AdamW steps; returns per-step loss, gradients and (if given) the ledger's records."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = {"loss": [], "grads": [], "comm": []}
    for inputs, targets in _batches():
        if ledger is not None:
            ledger.reset()
        (inputs, positions), (targets, _) = shard(inputs), shard(targets)
        logits = model(inputs, positions=positions)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # mean over local tokens
        loss.backward()
        after_backward()
        out["loss"].append(average_loss(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        if ledger is not None:
            out["comm"].append({k: vars(r).copy() for k, r in ledger.records.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def cp_training(ctx, mode, cp, ulysses):
    layout = CPLayout.from_mode(mode, cp, ulysses)
    groups = new_cp_groups([list(range(cp))], layout, ctx.rank)
    ledger = CommLedger()
    model = apply_context_parallel(_model(), groups, ledger)

    def average_loss(loss):  # the global mean: every rank holds the same number of tokens
        comm.all_reduce(loss, groups.cp, axis="cp")  # not in the ledger: logging only
        return (loss / cp).item()

    return _train(model, lambda t: shard_sequence(t, groups.cp_rank, layout),
                  lambda: reduce_gradients_over_cp(model, groups, ledger), average_loss, ledger)


@pytest.fixture(scope="module")
def reference():
    return _train(_model(), lambda t: (t, None), lambda: None, lambda loss: loss.item())


_runs = {}


@pytest.fixture(scope="module")
def runs(dist):
    def get(mode, cp, ulysses):
        key = (mode, cp, ulysses)
        if key not in _runs:
            _runs[key] = dist.run(cp, cp_training, mode, cp, ulysses)
        return _runs[key]
    return get


@pytest.mark.parametrize("mode, cp, ulysses", LAYOUTS)
def test_training_matches_one_process(runs, reference, mode, cp, ulysses):
    for rank, result in enumerate(runs(mode, cp, ulysses)):
        for step in range(STEPS):
            rtol, atol = (RTOL_FIRST, ATOL_FIRST) if step == 0 else (RTOL, ATOL)
            label = f"{mode} cp={cp} u={ulysses} rank {rank} step {step + 1}"
            torch.testing.assert_close(result["loss"][step], reference["loss"][step], rtol=rtol,
                                       atol=atol, msg=lambda m: f"{label} loss: {m}")
            assert result["grads"][step].keys() == reference["grads"][step].keys()
            for name, want in reference["grads"][step].items():
                torch.testing.assert_close(result["grads"][step][name], want, rtol=rtol,
                                           atol=atol, msg=lambda m: f"{label} {name}: {m}")


def _expected_comm(mode, cp, ulysses):
    """Analytical bytes per rank per training step (forward + backward), by (axis, op)."""
    layout = CPLayout.from_mode(mode, cp, ulysses)
    u, r, L = layout.ulysses, layout.ring, ARGS.n_layers
    N, K, Hd = ARGS.n_heads, ARGS.n_kv_heads, ARGS.head_dim
    s_local = SEQ // cp
    expected = {}
    if u > 1:
        # Per layer: forward all-to-alls of q [B,S/cp,N,Hd], k and v [B,S/cp,K,Hd] and the output
        # [B,S/cp,N,Hd]; backward the same four on the gradients. Each rank keeps 1/u of its own.
        payload = 2 * L * BATCH * s_local * (2 * N + 2 * K) * Hd * FP32
        expected[("cp", "all_to_all")] = (8 * L, payload, (u - 1) / u * payload)
    if r > 1 and layout.gather:
        # Per layer: the stacked keys and values of every rank [r,2,B,K,S/r,Hd] all-gathered in
        # forward and again in backward, and their fp32 gradients reduce-scattered once.
        gathered = r * 2 * BATCH * K * (SEQ // r) * Hd * FP32
        wire = (r - 1) / r * gathered
        expected[("cp", "all_gather")] = (2 * L, 2 * L * gathered, 2 * L * wire)
        expected[("cp", "reduce_scatter")] = (L, L * gathered, L * wire)
    elif r > 1:
        # Per layer: key+value block [2,B,K/u,S/r,Hd] sent r-1 times forward, r-1 times again in
        # backward, plus r-1 hops of the travelling dK/dV sum of the same size.
        block = 2 * BATCH * (K // u) * (SEQ // r) * Hd * FP32
        sends = 3 * (r - 1) * L
        expected[("cp", "send")] = (sends, sends * block, sends * block)
        expected[("cp", "recv")] = (sends, sends * block, 0.0)
    # Gradient average over cp: one all-reduce per parameter, 2 (cp-1)/cp of the bytes on the wire.
    params = sum(p.numel() for p in _model().parameters()) * FP32
    n_params = len(list(_model().parameters()))
    expected[("cp", "all_reduce")] = (n_params, params, 2 * (cp - 1) / cp * params)
    return expected


def test_the_loss_actually_moves(reference):
    # Guards the parity test against comparing two runs that did nothing.
    assert reference["loss"][-1] < reference["loss"][0] - 0.5


@pytest.mark.parametrize("mode, cp, ulysses", LAYOUTS)
def test_counted_bytes_equal_the_formulas(runs, mode, cp, ulysses):
    expected = _expected_comm(mode, cp, ulysses)
    for rank, result in enumerate(runs(mode, cp, ulysses)):
        for step, records in enumerate(result["comm"]):
            assert set(records) == set(expected), (rank, step)
            for key, (calls, payload, wire) in expected.items():
                got = records[key]
                assert got["calls"] == calls, (key, got)
                assert got["payload_bytes"] / payload == 1.0, (key, got, payload)
                if wire:
                    assert got["wire_bytes"] / wire == 1.0, (key, got, wire)
                else:
                    assert got["wire_bytes"] == 0.0


def cp_attention(ctx, mode, cp, ulysses):
    """Output and dQ/dK/dV of the cp core on this rank's shard of a seeded q/k/v."""
    layout = CPLayout.from_mode(mode, cp, ulysses)
    groups = new_cp_groups([list(range(cp))], layout, ctx.rank)
    q, k, v, dout = _attention_inputs()
    positions = sequence_positions(SEQ, groups.cp_rank, layout)
    local = [t[:, :, positions].detach().requires_grad_() for t in (q, k, v)]
    out = ContextParallelAttention(groups)(*local)
    out.backward(dout[:, :, positions])
    return positions, out.detach(), *(t.grad for t in local)


def _attention_inputs():
    g = torch.Generator().manual_seed(7)
    shape_q, shape_kv = (BATCH, 8, SEQ, 16), (BATCH, 4, SEQ, 16)
    return (torch.randn(shape_q, generator=g), torch.randn(shape_kv, generator=g),
            torch.randn(shape_kv, generator=g), torch.randn(shape_q, generator=g))


@pytest.mark.parametrize("mode, cp, ulysses", [("ulysses", 4, 0), ("ring", 4, 0), ("hybrid", 4, 2),
                                               ("ring", 2, 0), ("allgather", 4, 0)])
def test_attention_core_matches_sdpa(dist, mode, cp, ulysses):
    q, k, v, dout = (t.requires_grad_() for t in _attention_inputs())
    want = sdpa_causal(q, k, v)
    want.backward(dout.detach())
    got = [torch.zeros_like(t) for t in (want, q, k, v)]
    for positions, *local in dist.run(cp, cp_attention, mode, cp, ulysses):
        for full, part in zip(got, local):
            full[:, :, positions] = part
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, w, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                   msg=lambda m: f"{mode} cp={cp} {name}: {m}")


def ddp_over_dp_x_cp(ctx):
    """The trainer's wiring: data parallelism over the flattened dp x cp group averages the
    gradients that ``reduce_gradients_over_cp`` would, and over dp as well; each dp slice is
    sharded over cp."""
    from loom.parallel.data import GradientReducer
    from loom.topology import RankGrid, build_mesh

    grid = RankGrid({"dp_replicate": 2, "cp": 2})
    meshes = build_mesh(grid, "cpu")
    layout = CPLayout.from_mode("ring", 2)
    groups = new_cp_groups(grid.groups("cp"), layout, ctx.rank)
    model = apply_context_parallel(_model(), groups)
    reducer = GradientReducer(list(model.parameters()), meshes.dp_cp.get_group(),
                              meshes.dp_cp.size())
    inputs, targets = _batches()[0]
    row = grid.index(ctx.rank, "dp_replicate")  # the data loader splits the batch over dp only
    (inputs, positions), (targets, _) = (shard_sequence(t[row:row + 1], groups.cp_rank, layout)
                                         for t in (inputs, targets))
    F.cross_entropy(model(inputs, positions=positions).flatten(0, 1), targets.flatten()).backward()
    reducer.finish()
    return {n: p.grad for n, p in model.named_parameters()}


def test_ddp_over_flattened_dp_and_cp_matches_one_process(dist, reference):
    for grads in dist.run(4, ddp_over_dp_x_cp):
        for name, want in reference["grads"][0].items():
            torch.testing.assert_close(grads[name], want, rtol=RTOL_FIRST, atol=ATOL_FIRST,
                                       msg=lambda m: f"dp2 x cp2 {name}: {m}")
