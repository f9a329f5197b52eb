"""The model-family fields under tensor and context parallelism are one process, split.

Tensor parallelism (tp = 2): a model with every per-head feature at once (q/k/v biases, q/k
RMSNorm, an explicit head dim, a sliding window) trains 3 AdamW steps on one process and on two
TP ranks, from the same seeded weights; the loss and every parameter's full gradient must agree.
The biases are split with their column-parallel weights; the q/k norm weights are replicated and
their gradient (a partial sum over each rank's heads) is all-reduced: a missing reduction shows
as a gradient off by the other rank's share. Biases start at zero and norms at one, so step 1
checks their gradients and steps 2-3 check forwards that use the trained values.

Context parallelism: Ulysses (cp = 2) sees the whole sequence for its heads and applies the
sliding window exactly; the local logits and the cp-averaged gradients of one forward/backward
must equal one process's. (The ring's and all-gather's window: ``test_context_window.py``.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from loom.models import TransformerArgs, build_model, reset_parameters
from loom.parallel.context import (CPLayout, apply_context_parallel, new_cp_groups,
                                   reduce_gradients_over_cp, shard_sequence)
from loom.parallel.tensor import (apply_tensor_parallel, clip_grad_norm, full_named_gradients,
                                  TensorParallel, load_shard)
from loom.parallel.vocab import cross_entropy
from loom.topology import RankGrid, build_mesh

SEED, LR, STEPS, CLIP = 1234, 3e-3, 3, 1.0
B, S = 2, 32
# As tests/dist/test_tensor_parallel.py: step 1 differs by summation order only; later steps
# let Adam turn rounding-level gradient differences into ~lr weight differences.
RTOL_FIRST, ATOL_FIRST = 1e-5, 1e-6
RTOL, ATOL = 1e-4, 1e-5
ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128,
                       max_seq_len=S, qkv_bias=True, qk_norm=True, head_dim_override=24,
                       sliding_window=8)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (B, S + 1),
                           generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, loss_fn, grads_fn, clip_fn) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    record: dict[str, list] = {"loss": [], "grads": []}
    for step in range(STEPS):
        inputs, targets = _batch(step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        clip_fn(model)
        record["loss"].append(float(loss.detach()))
        record["grads"].append(grads_fn(model))
        optimizer.step()
    return record


def _reference() -> dict:
    model = build_model(ARGS, device="cpu")
    reset_parameters(model, SEED)
    return _train(model, cross_entropy,
                  lambda m: {n: p.grad.clone() for n, p in m.named_parameters()},
                  lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))


def tp_body(ctx, sp: bool, meta_init: bool) -> dict:
    mesh = build_mesh(RankGrid({"tp": ctx.world_size}), "cpu").root["tp"]
    model = build_model(ARGS, device="meta" if meta_init else "cpu")
    if meta_init:  # shards loaded from the full seeded values
        apply_tensor_parallel(model, mesh, sequence_parallel=sp, vocab_parallel=False)
        model.to_empty(device="cpu")
        reset_parameters(model, SEED, load=load_shard)
    else:
        reset_parameters(model, SEED)
        apply_tensor_parallel(model, mesh, sequence_parallel=sp, vocab_parallel=False)
    tp = TensorParallel(mesh, sp, False, None)
    got = _train(model, tp.loss, full_named_gradients,
                 lambda m: clip_grad_norm(m.parameters(), CLIP, tp=tp))
    return {"got": got, "ref": _reference()}


@pytest.mark.parametrize("sp, meta_init", [(False, True), (True, False)])
def test_tensor_parallel_with_biases_qk_norms_and_a_window_matches_one_process(dist, sp,
                                                                               meta_init):
    for rank, result in enumerate(dist.run(2, tp_body, sp, meta_init)):
        ref, got = result["ref"], result["got"]
        for step in range(STEPS):
            rtol, atol = (RTOL_FIRST, ATOL_FIRST) if step == 0 else (RTOL, ATOL)
            where = f"tp=2 sp={sp} rank {rank} step {step + 1}"
            torch.testing.assert_close(got["loss"][step], ref["loss"][step], rtol=rtol, atol=atol)
            assert got["grads"][step].keys() == ref["grads"][step].keys(), where
            for name, want in ref["grads"][step].items():
                torch.testing.assert_close(got["grads"][step][name], want, rtol=rtol, atol=atol,
                                           msg=lambda m, n=name: f"{where} grad of {n}: {m}")
    names = ref["grads"][0]
    assert "layers.0.attention.q_norm.weight" in names and "layers.0.attention.wk.bias" in names


def _perturbed_model():
    model = build_model(ARGS, device="cpu")
    reset_parameters(model, SEED)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # biases and norms off zero / one, so the forward uses them
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def _forward_backward(model, inputs, targets, positions=None):
    logits = model(inputs, positions=positions)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach()


def ulysses_body(ctx) -> dict:
    layout = CPLayout.from_mode("ulysses", ctx.world_size)
    groups = new_cp_groups([list(range(ctx.world_size))], layout, ctx.rank)
    model = apply_context_parallel(_perturbed_model(), groups)
    inputs, targets = _batch(0)
    (local_in, positions), (local_targets, _) = (shard_sequence(inputs, groups.cp_rank, layout),
                                                 shard_sequence(targets, groups.cp_rank, layout))
    logits = _forward_backward(model, local_in, local_targets, positions)
    reduce_gradients_over_cp(model, groups)
    return {"positions": positions, "logits": logits,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def test_ulysses_applies_the_sliding_window_exactly(dist):
    reference = _perturbed_model()
    inputs, targets = _batch(0)
    logits = _forward_backward(reference, inputs, targets)
    windowless = dataclasses.replace(ARGS, sliding_window=0)
    full = build_model(windowless, device="cpu")
    full.load_state_dict(reference.state_dict())
    assert (full(inputs).detach() - logits)[:, 8:].abs().max() > 1e-3  # the window matters
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for rank, result in enumerate(dist.run(2, ulysses_body)):
        torch.testing.assert_close(result["logits"], logits[:, result["positions"]],
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        for name, want in grads.items():
            # cp averages the two halves' mean losses: the one-process mean, same token count
            torch.testing.assert_close(result["grads"][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
