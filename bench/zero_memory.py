"""ZeRO memory: measured model-state bytes per rank vs the ZeRO paper's formulas, and the memory
estimator (loom/train/memory.py) vs measured tensor bytes for several layouts.

    python bench/zero_memory.py                 # writes bench/out/zero_memory.json, prints tables
    python bench/zero_memory.py --peak          # only the allocator-level peak table
    python bench/zero_memory.py --peak zero2    # only its rows whose name contains "zero2"
    python bench/zero_memory.py --bf16          # bf16 parameters, fp32 masters: ZeRO-1/2/3, d 4
    python bench/zero_memory.py --peak-bf16     # the peak table in bf16 at every ZeRO stage
    python bench/zero_memory.py --loss-path     # one rank at a vocabulary of 128,256
    python bench/zero_memory.py --cp-allgather  # cp 2, ring vs all-gather, seq 4096

Model state = the bytes of every distinct storage held by parameters, gradients and optimizer
state after one optimizer step (deduplicated by storage: ZeRO-1/2 parameters are views of flat
buckets, a ZeRO-1 rank's slice is a view of them, FSDP2's freed unsharded parameters have 0-byte
storages). fp32 training on CPU, so the formulas use fp32 parameters and gradients with fp32 Adam:
(4 + 4 + 8)Ψ, stage 1 (4 + 4)Ψ + 8Ψ/d, stage 2 4Ψ + 12Ψ/d, stage 3 16Ψ/d — the same totals as
the paper's mixed-precision (2 + 2 + 12)Ψ at every stage (Loom keeps fp32 weights as the masters).

Forward peak = model state + the activations saved for backward at the end of one microbatch's
forward (saved-tensor hooks; storages deduplicated, parameters and their gathered copies
excluded), with one microbatch per step, against the estimator's instant of the most saved
activations, in tensor bytes.

Peak (``--peak``) = the allocator-level peak of step 2, from the profiler's record of every CPU
tensor allocation and free (``measure_peak``), against ``estimate_memory``'s total (its worst
instant of the worst rank), with gradient accumulation and pipelines; reported without what the
collectives allocate inside their own calls (gloo's staging copies, which NCCL does not make),
and with it.
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
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(table), data_dir, None, ctx)
    trainer.train_step()
    model, zero = trainer.model, trainer.zero
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
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), trainer._compute_context():
        (stage,) = trainer.pipeline.stages.values()  # pp = 1: one stage, the whole model
        loss = trainer.loss_fn(stage.module(inputs[:micro], positions=positions), targets[:micro])
        pieces = [getattr(t, "_local_tensor", t) for t in saved]
        pieces = [t for t in pieces if _ptr(t) not in exclude and t.dtype.is_floating_point]
        act_bytes = _storages(pieces)
    loss.backward()  # keep collectives matched (FSDP2 reduce-scatters)
    psi = sum(t.numel() for t in trainer.named_gradients().values())
    return {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes, "state": state_bytes,
            "activations": act_bytes, "psi": psi}


def _live_curve(trace_path: str, window: tuple[float, float]) -> dict[str, int]:
    """Live bytes at the window's start and the most live during it, from a profiler trace's CPU
    allocation events: a running sum of every allocation and of the frees of blocks allocated
    since the profile began (all of the trainer's, which is built inside it). ``*_no_staging``
    leaves out what the collectives allocate inside their own calls (gloo's staging: its
    reduce-scatter clones the input, its all-gather allocates the output twice; NCCL has none).
    ``window[0]`` may be a single instant (the start and peak are then the live bytes there)."""
    trace = json.loads(Path(trace_path).read_text())["traceEvents"]
    # the collective calls (c10d::) and gloo's own work on its threads; not its point-to-point
    # sends and receives, whose spans cover the compute they overlap
    staging = [(e["tid"], e["ts"], e["ts"] + e.get("dur", 0)) for e in trace
               if e.get("ph") == "X" and e["name"].startswith(("c10d::", "gloo:"))
               and e["name"] not in ("gloo:send", "gloo:recv")]
    events = [e for e in trace
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    events.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    sizes: dict[int, tuple[int, bool]] = {}
    live = [0, 0]  # all, without staging
    out = {}
    for event in events:
        nbytes, addr, ts = event["args"]["Bytes"], event["args"]["Addr"], event["ts"]
        if not out and ts >= window[0]:
            out = {"start": live[0], "peak": live[0], "start_no_staging": live[1],
                   "peak_no_staging": live[1]}
        if nbytes > 0:
            staged = any(t == event.get("tid") and a <= ts <= b for t, a, b in staging)
            sizes[addr] = (nbytes, staged)
            live[0] += nbytes
            live[1] += 0 if staged else nbytes
        elif addr in sizes:
            size, staged = sizes.pop(addr)
            live[0] -= size
            live[1] -= 0 if staged else size
        if out and ts <= window[1]:
            out["peak"] = max(out["peak"], live[0])
            out["peak_no_staging"] = max(out["peak_no_staging"], live[1])
    return out


def _state_tensors(trainer) -> dict[str, list]:
    """The trainer's parameters, fp32 masters (bf16's ``master_weight``; ZeRO-1/2's fp32 slices;
    FSDP2's sharded parameters are the model's), gradients (``.grad``, ``main_grad``, ZeRO-1/2's
    buffers and slices of every stage's reducer, the masters' ``.grad``) and optimizer state."""
    import torch

    from loom.parallel.zero import ZeroShardedOptimizer

    params = list(trainer.model.parameters())
    masters = [p.master_weight for p in params if hasattr(p, "master_weight")]
    masters += [p for g in trainer.optimizer.param_groups for p in g["params"]
                if not any(p is q for q in params)]  # ZeRO-1/2's slices (fp32: views)
    grads = [t for p in params + masters
             for t in (p.grad, getattr(p, "main_grad", None)) if t is not None]
    # the stages' ZeRO-1/2 buffers and the vocabulary rows' (parallel.vocab_parallel_pp)
    rows = getattr(trainer.pipeline, "vocab_reducer", None)
    for reducer in [s.applied.reducer for s in trainer.pipeline.stages.values()] + [rows]:
        if isinstance(reducer, ZeroShardedOptimizer):
            grads += [t for b in reducer.buckets for t in (b.grad_flat, b.grad_shard)
                      if t is not None]
    opt = [v for state in trainer.optimizer.state.values() for v in state.values()
           if torch.is_tensor(v) and v.numel() > 1]
    return {"params": params, "masters": masters, "grads": grads, "optimizer": opt}


def _model_state(trainer) -> int:
    """Distinct storages of parameters, masters, gradients and optimizer state."""
    return _storages([t for tensors in _state_tensors(trainer).values() for t in tensors])


def measure_peak(ctx, table, data_dir, trace_dir):
    """Allocator-level peak of step 2 (step 1 creates the optimizer state): every CPU tensor
    allocation and free, recorded by the profiler from before the trainer is built. What is not
    training state (the data set, RoPE tables, the harness's own) is the live bytes once the
    trainer is built minus its parameters then; the peak is step 2's most live minus that."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    from loom.config import from_dict
    from loom.train.trainer import Trainer

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer = Trainer(from_dict(table), data_dir, None, ctx)
        gc.collect()
        built = _model_state(trainer)  # the parameters (no gradients or optimizer state yet)
        with torch.profiler.record_function("loom_built"):
            pass
        trainer.train_step()
        gc.collect()
        state = _model_state(trainer)
        torch.distributed.barrier()
        with torch.profiler.record_function("loom_step_2"):
            trainer.train_step()
        torch.distributed.barrier()
    path = f"{trace_dir}/rank{ctx.rank}.json"
    prof.export_chrome_trace(path)
    spans = {e["name"]: e for e in json.loads(Path(path).read_text())["traceEvents"]
             if e.get("name") in ("loom_built", "loom_step_2") and e.get("ph") == "X"}
    step = spans["loom_step_2"]
    at_built = _live_curve(path, (spans["loom_built"]["ts"], spans["loom_built"]["ts"]))
    curve = _live_curve(path, (step["ts"], step["ts"] + step["dur"]))
    Path(path).unlink()
    other = at_built["start"] - built  # not training state
    other_no_staging = at_built["start_no_staging"] - built
    return {"state": state, "other": other, "peak": curve["peak"] - other,
            "peak_no_staging": curve["peak_no_staging"] - other_no_staging}


def measure_bf16_state(ctx, table, data_dir):
    """Model state per rank after one step with ``train.dtype = bf16``: distinct storages of the
    bf16 parameters, the fp32 masters (``master_weight``; ZeRO-1/2's slices; FSDP2's sharded
    parameters are the model's), every gradient buffer (``.grad``, ``main_grad``, ZeRO-1/2's
    buffers and slices, the masters' ``.grad``) and the optimizer's moments."""
    from loom.config import from_dict
    from loom.train.trainer import Trainer

    trainer = Trainer(from_dict(table), data_dir, None, ctx)
    trainer.train_step()
    parts = _state_tensors(trainer)
    return {**{name: _storages(tensors) for name, tensors in parts.items()},
            "state": _storages([t for tensors in parts.values() for t in tensors]),
            "psi": sum(p.numel() for p in parts["params"])}


def bf16_formula(stage: int, psi: int, d: int, grad_bytes: int) -> float:
    """The ZeRO paper's model state with 2-byte parameters, ``grad_bytes`` gradients and 12
    bytes of fp32 master and moments: 2Ψ + gΨ + 12Ψ/N, 2Ψ + (g + 12)Ψ/N, 16Ψ/N (ZeRO-3 keeps
    FSDP2's fp32 sharded parameters and gradients: (4 + 4 + 8)Ψ/N, which is also the paper's)."""
    return {1: 2 * psi + grad_bytes * psi + 12 * psi / d,
            2: 2 * psi + (grad_bytes + 12) * psi / d, 3: 16 * psi / d}[stage]


def bf16_table(registry, resolved, data_dir) -> list[dict]:
    """Measured bf16 model state per rank at ZeRO-1/2/3 over dp_shard 4 vs the formulas and
    the estimator's model state (bf16 and fp32 gradient reductions)."""
    from loom.config import to_dict
    from loom.train.memory import memory_instants

    rows = []
    print("| stage | grads | Ψ | measured bytes/rank | formula | measured/formula |"
          " estimator | estimator/measured |")
    for reduce in ("bf16", "fp32"):
        for stage in (1, 2, 3):
            config = resolved(4, dp_shard=4, zero_stage=stage, **{
                "train.dtype": "bf16", "train.grad_reduce_dtype": reduce,
                "train.micro_batch_size": 4})
            m = registry.run(4, measure_bf16_state, to_dict(config), str(data_dir))[0]
            f = bf16_formula(stage, m["psi"], 4, 2 if reduce == "bf16" else 4)
            est = min(memory_instants(config), key=lambda e: e.activations).model_state
            rows.append({"stage": stage, "grad_reduce_dtype": reduce, **m, "formula": f,
                         "estimator": est})
            print(f"| {stage} | {reduce} | {m['psi']:,} | {m['state']:,} | {f:,.0f} |"
                  f" {m['state'] / f:.4f} | {est:,.0f} | {est / m['state']:.4f} |", flush=True)
    return rows


def formula(stage: int, psi: int, d: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / d, 2: 4 * psi + 12 * psi / d,
            3: 16 * psi / d}[stage]


PEAK_LAYOUTS = [  # (name, ranks, overrides): global batch 16, so m = 16 / (dp x micro)
    ("single", 1, {"train.micro_batch_size": 16}),
    ("zero1-dp2 m=4", 2, {"dp_shard": 2, "zero_stage": 1, "train.micro_batch_size": 2}),
    ("zero2-dp4 m=1", 4, {"dp_shard": 4, "zero_stage": 2, "train.micro_batch_size": 4}),
    ("zero2-dp4 m=4", 4, {"dp_shard": 4, "zero_stage": 2, "train.micro_batch_size": 1}),
    ("zero3-dp4 m=1", 4, {"dp_shard": 4, "zero_stage": 3, "train.micro_batch_size": 4}),
    ("zero3-dp4 m=4", 4, {"dp_shard": 4, "zero_stage": 3, "train.micro_batch_size": 1}),
    ("zero3-dp4 unsharded after forward m=1", 4, {"dp_shard": 4, "zero_stage": 3,
                                                  "reshard_after_forward": False,
                                                  "train.micro_batch_size": 4}),
    ("zero3-dp4 unsharded after forward m=4", 4, {"dp_shard": 4, "zero_stage": 3,
                                                  "reshard_after_forward": False,
                                                  "train.micro_batch_size": 1}),
    ("pp2 x zero3-dp2 1f1b held m=4", 4, {"pp": 2, "dp_shard": 2, "zero_stage": 3,
                                          "reshard_after_forward": False,
                                          "train.micro_batch_size": 2}),
    ("pp2 x zero3-dp2 1f1b per-mb m=4", 4, {"pp": 2, "dp_shard": 2, "zero_stage": 3,
                                            "train.micro_batch_size": 2}),
    ("pp2 x zero3-dp2 zbv held m=4", 4, {"pp": 2, "dp_shard": 2, "zero_stage": 3,
                                         "schedule": "zbv", "reshard_after_forward": False,
                                         "train.micro_batch_size": 2}),
    ("pp2 x zero2-dp2 1f1b m=4", 4, {"pp": 2, "dp_shard": 2, "zero_stage": 2,
                                     "train.micro_batch_size": 2}),
    # ZeRO-2's gradient saving at the peak, against ZeRO-1 on the same layout: 1 MiB buckets
    # (the 12.6 MiB tiny model in ~13 of them, as a 25 MB bucket divides a 330 MB model)
    ("zero1-dp4 m=1", 4, {"dp_shard": 4, "zero_stage": 1, "train.micro_batch_size": 4}),
    ("zero2-dp4 m=1 1MiB buckets", 4, {"dp_shard": 4, "zero_stage": 2,
                                       "train.micro_batch_size": 4, "train.grad_bucket_mb": 1}),
    ("zero1-dp4 m=4", 4, {"dp_shard": 4, "zero_stage": 1, "train.micro_batch_size": 1}),
    ("zero2-dp4 m=4 1MiB buckets", 4, {"dp_shard": 4, "zero_stage": 2,
                                       "train.micro_batch_size": 1, "train.grad_bucket_mb": 1}),
    ("zero2-dp4 m=4 1MiB buckets, reduce every microbatch", 4, {
        "dp_shard": 4, "zero_stage": 2, "train.micro_batch_size": 1, "train.grad_bucket_mb": 1,
        "train.grad_reduce_every_microbatch": True}),
    ("zero3-dp4 m=4, reduce every microbatch", 4, {
        "dp_shard": 4, "zero_stage": 3, "train.micro_batch_size": 1,
        "train.grad_reduce_every_microbatch": True}),
    ("pp2 x zero2-dp2 1f1b m=4 1MiB buckets", 4, {"pp": 2, "dp_shard": 2, "zero_stage": 2,
                                                  "train.micro_batch_size": 2,
                                                  "train.grad_bucket_mb": 1}),
    # vocabulary parallelism across the pipeline (loom.parallel.vocab_pipeline) against the same
    # pipeline with the head on the last stage, at a vocabulary of 8192 (the tiny preset's 320
    # makes the head's share invisible): every rank holds V/2 rows of the embedding and head and
    # each microbatch's exp-logits between its S and T
    ("pp2 1f1b m=4 vocab 8192", 2, {"pp": 2, "model.vocab_size": 8192,
                                    "train.micro_batch_size": 4}),
    ("pp2 vocab-pp 1f1b m=4 vocab 8192", 2, {"pp": 2, "vocab_parallel_pp": True,
                                             "model.vocab_size": 8192,
                                             "train.micro_batch_size": 4}),
    ("pp2 zbv m=4 vocab 8192", 2, {"pp": 2, "schedule": "zbv", "model.vocab_size": 8192,
                                   "train.micro_batch_size": 4}),
    ("pp2 vocab-pp zbv m=4 vocab 8192", 2, {"pp": 2, "schedule": "zbv",
                                            "vocab_parallel_pp": True,
                                            "model.vocab_size": 8192,
                                            "train.micro_batch_size": 4}),
    # the split with ZeRO on dp_shard (issue 22, vocab_pipeline.data_parallel_rows): ZeRO-1's
    # rows whole with their optimizer state sliced; ZeRO-3's rows sharded at rest, gathered for
    # the whole step (GatheredRows) with their unsharded gradients until the reduce-scatter
    ("pp2 x zero1-dp2 vocab-pp 1f1b m=4 vocab 8192", 4, {
        "pp": 2, "dp_shard": 2, "zero_stage": 1, "vocab_parallel_pp": True,
        "model.vocab_size": 8192, "train.micro_batch_size": 2}),
    ("pp2 x zero3-dp2 vocab-pp 1f1b per-mb m=4 vocab 8192", 4, {
        "pp": 2, "dp_shard": 2, "zero_stage": 3, "vocab_parallel_pp": True,
        "model.vocab_size": 8192, "train.micro_batch_size": 2}),
    ("pp2 x zero3-dp2 vocab-pp 1f1b held m=4 vocab 8192", 4, {
        "pp": 2, "dp_shard": 2, "zero_stage": 3, "vocab_parallel_pp": True,
        "reshard_after_forward": False, "model.vocab_size": 8192,
        "train.micro_batch_size": 2}),
]


# issue 20: the estimator's bf16 peak at every ZeRO stage (``--peak-bf16``), one and four
# microbatches
BF16_PEAK_LAYOUTS = [row for row in PEAK_LAYOUTS if row[0] in (
    "single", "zero1-dp4 m=1", "zero1-dp4 m=4", "zero2-dp4 m=1", "zero2-dp4 m=4",
    "zero3-dp4 m=1", "zero3-dp4 m=4")]


# issue 20: the loss path at a large vocabulary (``--loss-path``), one rank, one microbatch: the
# step peaks in the cross entropy's backward (the fp32 log-probabilities, nll_loss's gradient
# and the logits' fp32 gradient, ``loom.formulas.memory.loss_backward_bytes``)
LARGE_VOCAB = {"model.n_layers": 1, "model.vocab_size": 128256, "train.global_batch_size": 1,
               "train.micro_batch_size": 1}
LOSS_PATH_LAYOUTS = [
    ("vocab 128256 seq 1024 1 layer bf16", 1, {**LARGE_VOCAB, "data.seq_len": 1024,
                                               "train.dtype": "bf16"}),
    ("vocab 128256 seq 512 2 layers fp32", 1, {**LARGE_VOCAB, "data.seq_len": 512,
                                               "model.n_layers": 2, "train.dtype": "fp32"}),
]


# all-gather context parallelism's transient buffers (``allgather_attention_bytes``): the same
# 2-layer model and step under the ring and under all-gather, cp 2, one 4096-token row per step
# (2048 per rank), fp32 and bf16 autocast; the estimate prices all-gather's gathered keys and
# values, not the ring's travelling blocks (both modes' peaks: the loss's backward)
CP_LAYOUTS = [(f"cp2 {mode} seq4096 {dtype}", 2, {
    "cp": 2, "cp_mode": mode, "model.n_layers": 2, "model.max_seq_len": 4096,
    "data.seq_len": 4096, "train.global_batch_size": 1, "train.micro_batch_size": 1,
    "train.dtype": dtype}) for dtype in ("fp32", "bf16_autocast") for mode in ("ring", "allgather")]


def main() -> None:
    from loom.config import load_config, resolve, to_dict
    from loom.data.loader import prepare_data
    from loom.testing.harness import PoolRegistry
    from loom.train.memory import estimate_memory, memory_instants

    out_dir = ROOT / "bench" / "out"
    data_dir = out_dir / "zero_memory_data"
    prepare_data(load_config(None, {k: v for k, v in BASE.items() if k.startswith("data.")}).data,
                 data_dir)  # reuses the files when the recipe matches
    registry = PoolRegistry(pg_timeout_s=300.0)

    def resolved(world, **over):
        overrides = {**BASE, **{k: v for k, v in over.items() if "." in k}}
        overrides.update({f"parallel.{k}": v for k, v in over.items() if "." not in k})
        overrides.setdefault("train.micro_batch_size",
                             BASE["train.global_batch_size"] // max(1, world // over.get("tp", 1)))
        return resolve(load_config(None, overrides), world)

    def run(world, **over):
        config = resolved(world, **over)
        return config, registry.run(world, measure, to_dict(config), str(data_dir))[0]

    if "--bf16" in sys.argv:  # only the bf16 model-state table
        results = json.loads((out_dir / "zero_memory.json").read_text()) \
            if (out_dir / "zero_memory.json").exists() else {}
        results["bf16_state"] = bf16_table(registry, resolved, data_dir)
        registry.close()
        (out_dir / "zero_memory.json").write_text(json.dumps(results, indent=1))
        return

    if "--peak-bf16" in sys.argv:  # the allocator-level table at every ZeRO stage in bf16
        results = json.loads((out_dir / "zero_memory.json").read_text()) \
            if (out_dir / "zero_memory.json").exists() else {}
        results["peak_bf16"] = peak_table(registry, resolved, data_dir, estimate_memory,
                                          layouts=BF16_PEAK_LAYOUTS,
                                          extra={"train.dtype": "bf16"})
        registry.close()
        (out_dir / "zero_memory.json").write_text(json.dumps(results, indent=1))
        return

    if "--loss-path" in sys.argv:  # the large-vocabulary rows (about 2.5 GB each)
        results = json.loads((out_dir / "zero_memory.json").read_text()) \
            if (out_dir / "zero_memory.json").exists() else {}
        results["loss_path"] = peak_table(registry, resolved, data_dir, estimate_memory,
                                          layouts=LOSS_PATH_LAYOUTS)
        registry.close()
        (out_dir / "zero_memory.json").write_text(json.dumps(results, indent=1))
        return

    if "--cp-allgather" in sys.argv:  # ring vs all-gather under cp 2
        results = json.loads((out_dir / "zero_memory.json").read_text()) \
            if (out_dir / "zero_memory.json").exists() else {}
        rows = peak_table(registry, resolved, data_dir, estimate_memory, layouts=CP_LAYOUTS)
        registry.close()
        for ring, gather in zip(rows[::2], rows[1::2]):
            est = gather["estimated"] - ring["estimated"]
            got = gather["measured_peak"] - ring["measured_peak"]
            print(f"{gather['layout']} - ring: measured {got:,} B, estimated {est:,.0f} B")
        results["cp_allgather"] = rows
        (out_dir / "zero_memory.json").write_text(json.dumps(results, indent=1))
        return

    if "--peak" in sys.argv:  # only the allocator-level table
        results = json.loads((out_dir / "zero_memory.json").read_text()) \
            if (out_dir / "zero_memory.json").exists() else {}
        fresh = peak_table(registry, resolved, data_dir, estimate_memory)
        registry.close()
        names = {row["layout"] for row in fresh}  # a filtered run replaces only its rows
        results["peak"] = [row for row in results.get("peak", []) if row["layout"] not in names]
        results["peak"] += fresh
        (out_dir / "zero_memory.json").write_text(json.dumps(results, indent=1))
        return

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
        # the instant of the most saved activations: the end of the one microbatch's forward
        est = max(memory_instants(config), key=lambda e: (e.activations, e.total))
        predicted = est.model_state + est.activations
        measured = m["state"] + m["activations"]
        results["estimator"].append({"layout": name, "world": world, "estimated": predicted,
                                     "estimate": est.components(), "measured": measured, **m})
        print(f"| {name} | {world} | {predicted:,.0f} | {measured:,} |"
              f" {predicted / measured:.4f} |", flush=True)
    results["peak"] = peak_table(registry, resolved, data_dir, estimate_memory)
    registry.close()
    (out_dir / "zero_memory.json").write_text(json.dumps(results, indent=1))


def peak_table(registry, resolved, data_dir, estimate_memory, layouts=None,
               extra=None) -> list[dict]:
    """The estimator's peak (its worst rank) vs the allocator-level peak of step 2 on the worst
    measured rank, without and with gloo's staging inside the collectives; ``layouts``
    (default ``PEAK_LAYOUTS``) each with the ``extra`` overrides."""
    import tempfile

    from loom.config import to_dict

    rows = []
    print("\n| layout | estimated peak (B) | largest at the peak | measured peak (B) |"
          " estimated/measured | with gloo staging (B) |")
    with tempfile.TemporaryDirectory() as trace_dir:
        only = [a for a in sys.argv[1:] if not a.startswith("--")]
        for name, world, over in layouts or PEAK_LAYOUTS:
            if only and not any(word in name for word in only):
                continue
            config = resolved(world, **over, **(extra or {}))
            measured = registry.run(world, measure_peak, to_dict(config), str(data_dir),
                                    trace_dir)
            est = estimate_memory(config)
            peak = max(m["peak_no_staging"] for m in measured)
            raw = max(m["peak"] for m in measured)
            rows.append({"layout": name, "world": world, "estimate": est.components(),
                         "estimated": est.total, "estimate_rank": est.rank,
                         "notes": list(est.notes), "measured": measured,
                         "measured_peak": peak, "measured_peak_with_staging": raw})
            print(f"| {name} | {est.total:,.0f} (rank {est.rank}) | {est.largest()[0]} |"
                  f" {peak:,} | {est.total / peak:.3f} | {raw:,} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
