"""ZeRO memory: measured model-state bytes per rank vs the ZeRO paper's formulas, and the memory
estimator (loom/train/memory.py) vs measured tensor bytes for several layouts.

    python bench/zero_memory.py                 # writes bench/out/zero_memory.json, prints tables

Model state = the bytes of every distinct storage held by parameters, gradients and optimizer
state after one optimizer step (deduplicated by storage: ZeRO-1/2 parameters are views of flat
buckets, a ZeRO-1 rank's slice is a view of them, FSDP2's freed unsharded parameters have 0-byte
storages). fp32 training on CPU, so the formulas use fp32 parameters and gradients with fp32 Adam:
(4 + 4 + 8)Ψ, stage 1 (4 + 4)Ψ + 8Ψ/d, stage 2 4Ψ + 12Ψ/d, stage 3 16Ψ/d — the same totals as
the paper's mixed-precision (2 + 2 + 12)Ψ at every stage (Loom keeps fp32 weights as the masters).

Peak = model state + the activations saved for backward at the end of one microbatch's forward
(saved-tensor hooks; storages deduplicated, parameters and their gathered copies excluded), with
one microbatch per step (no accumulation): exactly what the estimator models, in tensor bytes
(not allocator or process RSS, which CPU cannot report per tensor).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = {"model.preset": "tiny", "data.seq_len": 64, "data.max_bytes": 300_000,
        "data.extensions": ".py", "train.global_batch_size": 16, "optim.warmup_steps": 1,
        "train.eval_every": 0}


def _ptr(t) -> int | None:
    """The storage address of a (local) tensor; None once freed (FSDP2 resizes to 0 bytes)."""
    storage = getattr(t, "_local_tensor", t).untyped_storage()
    try:
        return storage.data_ptr() if storage.nbytes() else None
    except RuntimeError:
        return None


def _storages(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        ptr = _ptr(t)
        if ptr is not None:
            nbytes = getattr(t, "_local_tensor", t).untyped_storage().nbytes()
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


def measure(ctx, table, data_dir):
    import torch

    from loom.config import from_dict
    from loom.parallel.zero import zero_of
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(table), data_dir, None, ctx)
    trainer.train_step()
    model, zero = trainer.model, zero_of(trainer.model)
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    if zero is not None:
        grads = [b.grad_flat if b.grad_flat is not None else b.grad_shard for b in zero.buckets]
    opt = [v for state in trainer.optimizer.state.values() for v in state.values()
           if torch.is_tensor(v) and v.numel() > 1]
    p_bytes, g_bytes, o_bytes = _storages(params), _storages(grads), _storages(opt)
    state_bytes = _storages(params + grads + opt)
    # saved activations of one microbatch's forward (+ loss)
    saved: list[torch.Tensor] = []
    exclude = {_ptr(t) for t in [*params, *model.buffers()]}

    def pack(t):
        saved.append(t)
        return t

    inputs, targets = trainer.loader.next_batch()
    inputs, targets, positions = trainer._shard_sequence(inputs, targets)
    micro = trainer.config.train.micro_batch_size
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trainer._counting():
        loss = trainer.loss_fn(model(inputs[:micro], positions=positions), targets[:micro])
        pieces = [getattr(t, "_local_tensor", t) for t in saved]
        pieces = [t for t in pieces if _ptr(t) not in exclude and t.dtype.is_floating_point]
        act_bytes = _storages(pieces)
    loss.backward()  # keep collectives matched (FSDP2 reduce-scatters)
    psi = sum(t.numel() for t in trainer.named_gradients().values())
    return {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes, "state": state_bytes,
            "activations": act_bytes, "psi": psi}


def formula(stage: int, psi: int, d: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / d, 2: 4 * psi + 12 * psi / d,
            3: 16 * psi / d}[stage]


def main() -> None:
    from loom.config import load_config, resolve, to_dict
    from loom.data.loader import prepare_data
    from loom.testing.harness import PoolRegistry
    from loom.train.memory import estimate_memory

    out_dir = ROOT / "bench" / "out"
    data_dir = out_dir / "zero_memory_data"
    prepare_data(load_config(None, {k: v for k, v in BASE.items() if k.startswith("data.")}).data,
                 data_dir)  # reuses the files when the recipe matches
    registry = PoolRegistry(pg_timeout_s=300.0)

    def run(world, **over):
        overrides = {**BASE, **{k: v for k, v in over.items() if "." in k}}
        overrides.update({f"parallel.{k}": v for k, v in over.items() if "." not in k})
        overrides.setdefault("train.micro_batch_size",
                             BASE["train.global_batch_size"] // max(1, world // over.get("tp", 1)))
        config = resolve(load_config(None, overrides), world)
        return config, registry.run(world, measure, to_dict(config), str(data_dir))[0]

    results = {"state": [], "estimator": []}
    print("| stage | d | Ψ | measured bytes/rank | formula | measured/formula |")
    for d in (2, 4, 8):
        for stage in (0, 1, 2, 3):
            over = {"dp_shard": d, "zero_stage": stage} if stage else {"dp_replicate": d}
            _, m = run(d, **over)
            f = formula(stage, m["psi"], d)
            results["state"].append({"stage": stage, "d": d, **m, "formula": f})
            print(f"| {stage or 'DP'} | {d} | {m['psi']:,} | {m['state']:,} | {f:,.0f} |"
                  f" {m['state'] / f:.4f} |", flush=True)

    layouts = [("single", 1, {}), ("dp2", 2, {"dp_replicate": 2}),
               ("zero1-dp2", 2, {"dp_shard": 2, "zero_stage": 1}),
               ("zero2-dp4", 4, {"dp_shard": 4, "zero_stage": 2}),
               ("zero3-dp4", 4, {"dp_shard": 4}),
               ("zero3-dp2-tp2", 4, {"dp_shard": 2, "tp": 2}),
               ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}),
               ("recompute-full", 1, {"train.recompute": "full"}),
               ("recompute-selective", 1, {"train.recompute": "selective"}),
               ("recompute-every2", 1, {"train.recompute": "every_k"})]
    print("\n| layout | ranks | estimated (B) | measured (B) | estimated/measured |")
    for name, world, over in layouts:
        config, m = run(world, **over)
        est = estimate_memory(config)
        predicted = est.model_state + est.activations
        measured = m["state"] + m["activations"]
        results["estimator"].append({"layout": name, "world": world, "estimated": predicted,
                                     "estimate": est.components(), "measured": measured, **m})
        print(f"| {name} | {world} | {predicted:,.0f} | {measured:,} |"
              f" {predicted / measured:.4f} |", flush=True)
    registry.close()
    (out_dir / "zero_memory.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
