"""Sequence parallelism keeps its saved linear inputs sharded, and changes nothing else.

Under SP the q/k/v and w1/w3 linears save the all-gathered ``[b, s, h]`` block input for their
weight gradients. ``keep_saved_inputs_sharded`` (applied by ``parallelize``) keeps only this rank's
sequence slice and all-gathers it again in backward. Specification, on 2 and 4 TP ranks:

* the gradients are bit-identical to the same model without it (the gather rebuilds the very
  values that were saved);
* the bytes saved for backward drop by exactly ``(1 - 1/t)`` of the gathered input per block part
  (two parts per layer), and what the hooks hold is exactly the slice;
* backward issues exactly one more all-gather of ``b·s·h`` elements per block part, on ``tp``.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from loom.models import Transformer, TransformerArgs, reset_parameters
from loom.parallel.comm import CommLedger
from loom.parallel.sequence_saved import keep_saved_inputs_sharded
from loom.parallel.tensor import TensorParallel, apply_tensor_parallel, full_named_gradients
from loom.topology import RankGrid, build_mesh

B, S, SEED = 2, 32, 7
ARGS = TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, vocab_size=128,
                       max_seq_len=S)


def _saved_bytes(model: torch.nn.Module, forward, savers) -> tuple[torch.Tensor, int]:
    """``forward()``'s output and the bytes of the distinct non-parameter storages the
    transformer blocks saved for backward during it (with what the SP hooks hold)."""
    def local(t: torch.Tensor) -> torch.Tensor:  # an async collective's result: its waited data
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.trigger_wait() if hasattr(t, "trigger_wait") else t

    skip = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {local(b).untyped_storage().data_ptr() for b in model.buffers()}
    seen: dict[int, int] = {}
    inside = []

    def pack(t):
        storage = local(t).untyped_storage()
        if inside and storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    for saver in savers:
        saver.observe = pack
    def enter(*_) -> None:
        inside.append(1)

    def leave(*_) -> None:
        inside.pop()

    hooks = [h for block in model.layers.values()
             for h in (block.register_forward_pre_hook(enter), block.register_forward_hook(leave))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    for h in hooks:
        h.remove()
    return out, sum(seen.values()) + sum(s.held_bytes for s in savers)


def body(ctx, sharded: bool) -> dict:
    mesh = build_mesh(RankGrid({"tp": ctx.world_size}), "cpu").root["tp"]
    model = Transformer(ARGS)
    reset_parameters(model, SEED)
    ledger = CommLedger()
    apply_tensor_parallel(model, mesh, sequence_parallel=True, vocab_parallel=True, ledger=ledger)
    savers = keep_saved_inputs_sharded(model.layers.values(), mesh, ledger) if sharded else []
    tp = TensorParallel(mesh, True, True, ledger)
    tokens = torch.randint(0, ARGS.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(1))
    with tp.counting():
        logits, saved = _saved_bytes(model, lambda: model(tokens[:, :-1]), savers)
        loss = tp.loss(logits, tokens[:, 1:])
        forward_gathers = ledger.get("tp", "all_gather").calls
        loss.backward()
    return {"loss": float(loss), "grads": full_named_gradients(model), "saved": saved,
            "held": [s.held_bytes for s in savers],
            "backward_gathers": ledger.get("tp", "all_gather").calls - forward_gathers,
            "backward_gather_bytes": ledger.get("tp", "all_gather").payload_bytes}


@pytest.mark.parametrize("t", [2, 4])
def test_saved_inputs_are_sharded_and_gradients_unchanged(dist, t):
    plain = dist.run(t, body, False)
    sharded = dist.run(t, body, True)
    x_bytes = B * S * ARGS.dim * 4  # one gathered block input, fp32
    parts = 2 * ARGS.n_layers
    for rank, (p, s) in enumerate(zip(plain, sharded)):
        assert s["loss"] == p["loss"], rank
        assert set(s["grads"]) == set(p["grads"])
        for name, grad in p["grads"].items():
            assert torch.equal(s["grads"][name], grad), f"rank {rank}: gradient of {name}"
        assert s["held"] == [x_bytes // t] * parts, rank
        assert p["saved"] - s["saved"] == parts * x_bytes * (t - 1) // t, rank
        assert s["backward_gathers"] - p["backward_gathers"] == parts, rank
        assert s["backward_gather_bytes"] - p["backward_gather_bytes"] == parts * x_bytes, rank
