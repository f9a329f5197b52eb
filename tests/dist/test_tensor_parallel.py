"""Tensor, sequence and vocabulary parallelism are one process, split.

Each rank builds the one-process reference and the TP model from the same seed, trains both for
3 AdamW steps (fp32, global-norm clipping) on the same batch, and compares the loss and every
parameter's full gradient (TP gradients all-gathered). A second group of tests counts the bytes
one step moves over ``tp`` and compares them with the analytical formula written in the test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom.models import Transformer, TransformerArgs, build_model, reset_parameters
from loom.parallel.comm import CommLedger
from loom.parallel.tensor import (apply_tensor_parallel, clip_grad_norm, full_named_gradients,
                                  TensorParallel, load_shard)
from loom.parallel.vocab import cross_entropy
from loom.topology import RankGrid, build_mesh

STEPS, SEED, LR, CLIP = 3, 1234, 3e-3, 1.0
B, S = 2, 32
# Step 1 starts from bit-identical weights: only the summation order differs (row-parallel partial
# sums added by the all-reduce, the vocab-parallel softmax denominators) ~1e-7 relative.
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
# Later steps: Adam divides each element by its own RMS, so a gradient element at rounding level
# can move its weight by ~lr either way and perturb the next gradients (see test_data_parallel).
RTOL, ATOL = 1e-4, 1e-5


def tiny(n_kv_heads: int = 2, **kw) -> TransformerArgs:
    return TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, ffn_dim=128,
                           vocab_size=128, max_seq_len=S, **kw)


def _batch(args: TransformerArgs, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, args.vocab_size, (B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _tp_mesh(world: int):
    return build_mesh(RankGrid({"tp": world}), "cpu").root["tp"]


def _train(model, loss_fn, grads_fn, clip_fn, args, counting=None) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    record: dict[str, list] = {"loss": [], "grad_norm": [], "grads": []}
    for step in range(STEPS):
        inputs, targets = _batch(args, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        record["grad_norm"].append(float(clip_fn(model)))
        record["loss"].append(float(loss))
        record["grads"].append(grads_fn(model))
        optimizer.step()
    return record


def _reference(args: TransformerArgs) -> dict:
    model = Transformer(args)
    reset_parameters(model, SEED)
    return _train(model, cross_entropy, lambda m: {n: p.grad.clone() for n, p in
                                                   m.named_parameters()},
                  lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP), args)


def parity_body(ctx, args: TransformerArgs, sp: bool, vp: bool, meta_init: bool) -> dict:
    mesh = _tp_mesh(ctx.world_size)
    if meta_init:  # parallelize on meta, then every rank loads its shard of the seeded value
        model = build_model(args, device="meta")
        apply_tensor_parallel(model, mesh, sequence_parallel=sp, vocab_parallel=vp)
        model.to_empty(device="cpu")
        reset_parameters(model, SEED, load=load_shard)
    else:
        model = Transformer(args)
        reset_parameters(model, SEED)
        apply_tensor_parallel(model, mesh, sequence_parallel=sp, vocab_parallel=vp)
    tp = TensorParallel(mesh, sp, vp, None)
    got = _train(model, tp.loss, full_named_gradients,
                 lambda m: clip_grad_norm(m.parameters(), CLIP, tp=tp), args)
    return {"got": got, "ref": _reference(args)}


def _assert_parity(ref: dict, got: dict, label: str) -> None:
    for step in range(STEPS):
        rtol, atol = (RTOL_FIRST, ATOL_FIRST) if step == 0 else (RTOL, ATOL)
        where = f"{label} step {step + 1}"
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(got[key][step]), torch.tensor(ref[key][step]),
                                       rtol=rtol, atol=atol, msg=lambda m: f"{where} {key}: {m}")
        assert set(got["grads"][step]) == set(ref["grads"][step]), where
        for name, expected in ref["grads"][step].items():
            torch.testing.assert_close(got["grads"][step][name], expected, rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"{where} grad of {n}: {m}")


@pytest.mark.parametrize("world, kv, sp, vp, meta, tie", [
    (2, 2, False, False, False, False),  # tp=2, GQA (2 query heads per kv head)
    (4, 4, False, False, False, False),  # tp=4
    (2, 2, True, False, False, False),   # tp=2 + sequence parallel
    (2, 2, False, True, True, False),    # vocab-parallel embedding + head + fused CE, meta init
    (2, 2, True, True, False, True),     # everything at once, head tied to the embedding
])
def test_tensor_parallel_matches_one_process(dist, world, kv, sp, vp, meta, tie):
    results = dist.run(world, parity_body, tiny(kv, tie_embeddings=tie), sp, vp, meta)
    for rank, result in enumerate(results):
        label = f"tp={world} sp={sp} vocab={vp} rank {rank}"
        _assert_parity(result["ref"], result["got"], label)
    assert results[0]["ref"]["loss"][-1] < results[0]["ref"]["loss"][0]  # training did something


# -- communication volume ----------------------------------------------------------------------
def comm_body(ctx, args: TransformerArgs, sp: bool, vp: bool) -> dict:
    """One forward + backward; the ledger's records of each half, as plain dicts."""
    ledger = CommLedger()
    model = Transformer(args)
    reset_parameters(model, SEED)
    mesh = _tp_mesh(ctx.world_size)
    apply_tensor_parallel(model, mesh, sequence_parallel=sp, vocab_parallel=vp, ledger=ledger)
    tp = TensorParallel(mesh, sp, vp, ledger)
    inputs, targets = _batch(args, 0)
    halves = {}
    with tp.counting():  # forward and backward must both run inside it
        loss = tp.loss(model(inputs), targets)
        halves["forward"] = {k: dataclasses.asdict(r) for k, r in ledger.records.items()}
        ledger.reset()
        loss.backward()
        halves["backward"] = {k: dataclasses.asdict(r) for k, r in ledger.records.items()}
    return halves


def expected_tp_volume(t: int, L: int, b: int, s: int, h: int, sp: bool,
                       vp: bool) -> dict[str, dict[tuple[str, str], tuple[int, float]]]:
    """(calls, wire elements per rank) per (axis, op), forward and backward, one microbatch.

    Megatron (2021, §3.1): per layer 2 all-reduces forward + 2 backward of b·s·h, each moving
    2(t-1)/t·b·s·h elements: 8·b·s·h·(t-1)/t per layer. Megatron-SP (Korthikanti 2022, §4.2.2):
    each all-reduce becomes an all-gather + reduce-scatter, (t-1)/t·b·s·h each — the same volume.
    The ends (embedding, head, loss) and the SP norm-weight gradients are Loom-specific, derived
    in ``loom/parallel/tensor.py`` and ``vocab.py``.
    """
    act = b * s * h
    ar, ag_rs = 2 * (t - 1) / t, (t - 1) / t  # ring wire factors (comm.py)
    fwd: dict[tuple[str, str], tuple[int, float]] = {}
    bwd: dict[tuple[str, str], tuple[int, float]] = {}

    def add(half, op, calls, elements, factor):
        c, e = half.get(("tp", op), (0, 0.0))
        half[("tp", op)] = (c + calls, e + calls * elements * factor)

    if not sp:
        add(fwd, "all_reduce", 2 * L, act, ar)   # wo, w2 outputs
        add(bwd, "all_reduce", 2 * L, act, ar)   # attention, MLP input gradients
        if vp:
            add(fwd, "all_reduce", 1, act, ar)   # vocab-parallel embedding output
            add(bwd, "all_reduce", 1, act, ar)   # head input gradient
    else:
        for half in (fwd, bwd):                  # forward AG before / RS after; backward reversed
            add(half, "all_gather", 2 * L, act, ag_rs)
            add(half, "reduce_scatter", 2 * L, act, ag_rs)
        add(fwd, "all_gather", 1, act, ag_rs)    # head input, sequence -> full
        add(bwd, "all_gather", 1, act, ag_rs)    # embedding output gradient, shard -> full
        if vp:
            add(fwd, "reduce_scatter", 1, act, ag_rs)  # embedding partial sums -> sequence shard
            add(bwd, "reduce_scatter", 1, act, ag_rs)  # head input gradient partial sums
        add(bwd, "all_reduce", 2 * L + 1, h, ar)       # norm-weight gradients (partial over s)
    if vp:  # fused cross entropy: MAX of b·s, then SUM of [sum_exp, target logit] (2·b·s)
        add(fwd, "all_reduce", 1, b * s, ar)
        add(fwd, "all_reduce", 1, 2 * b * s, ar)
    return {"forward": fwd, "backward": bwd}


@pytest.mark.parametrize("world, kv, sp, vp", [
    (2, 2, False, False), (4, 4, False, False), (2, 2, True, False), (4, 4, True, False),
    (2, 2, False, True), (2, 2, True, True),
])
def test_tensor_parallel_bytes_match_the_formula(dist, world, kv, sp, vp):
    args = tiny(kv)
    expected = expected_tp_volume(world, args.n_layers, B, S, args.dim, sp, vp)
    for rank, halves in enumerate(dist.run(world, comm_body, args, sp, vp)):
        for half in ("forward", "backward"):
            got, want = halves[half], expected[half]
            assert set(got) == set(want), f"rank {rank} {half}: ops {sorted(got)} != {sorted(want)}"
            for key, (calls, elements) in want.items():
                record = got[key]
                ratio = record["wire_bytes"] / (elements * 4)  # fp32
                assert record["calls"] == calls, f"rank {rank} {half} {key}: {record}"
                assert round(ratio, 2) == 1.00 and abs(ratio - 1) < 1e-12, (
                    f"rank {rank} {half} {key}: measured/formula = {ratio}")
        if not sp and not vp:  # Megatron's per-layer total, 8·b·s·h·(t-1)/t elements, as written
            total = sum(r["wire_bytes"] for half in halves.values() for r in half.values())
            megatron = args.n_layers * 8 * B * S * args.dim * (world - 1) / world * 4
            assert total / megatron == 1.0
