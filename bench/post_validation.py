"""Benchmark: step time of the synchronous vs the post-validated optimizer step, pp = 4 on 4 ranks.

Both trainers live in the same 4 long-lived gloo ranks (``loom.testing.harness.WorkerPool``) and
train the same tiny model on the same batches: a 1F1B pipeline of 4 stages, one layer each. Steps
are paired and alternate: pair i runs a synchronous step and a post-validated step back to back,
the order flipping every pair, so machine noise (the box is shared) hits both alike. Each step is
preceded by a barrier; its time is from the earliest rank leaving the barrier to the last rank
finishing the step (one clock: ``perf_counter`` is system-wide). The optimizer-step phase (clip,
check, step; for post-validation also the rollback copy and any redo) is timed on every rank and
the slowest rank's is kept. Reported: medians, and the median of the per-pair ratios post / sync.

Two clip settings: ``grad_clip = 0`` (never clips: only the norm's non-finite check is waited
for, so no step is redone) and ``grad_clip = 1.0`` (clips every step of this short run: every
post-validated step is rolled back and redone: the worst case). At the end both trainers' weights
must be bit-identical, or the benchmark fails.

    python bench/post_validation.py [--pairs 30] [--warmup 3] [--seq-len 128]

Prints a markdown table and writes ``bench/out/post_validation.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent


def paired_steps(ctx, tables: dict, data_dir: str, pairs: int, warmup: int) -> dict:
    """Rank-local: build both trainers, warm up, then time ``pairs`` alternating pairs."""
    import torch
    import torch.distributed as dist

    from loom.config import from_dict
    from loom.train.trainer import Trainer

    trainers = {kind: Trainer(from_dict(table), data_dir, None, ctx)
                for kind, table in tables.items()}
    post_step = trainers["post"].optimizer_step  # the PostValidatedStep, before wrapping
    phase: dict[str, list[float]] = {kind: [] for kind in trainers}
    for kind, trainer in trainers.items():  # time the optimizer-step phase of every step
        inner = trainer.optimizer_step

        def timed(loss_sum, where, inner=inner, kind=kind):
            start = time.perf_counter()
            outcome = inner(loss_sum, where)
            phase[kind].append(time.perf_counter() - start)
            return outcome
        trainer.optimizer_step = timed
    spans: dict[str, list[tuple[float, float]]] = {kind: [] for kind in trainers}
    order = list(trainers)
    for i in range(warmup + pairs):
        for kind in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            start = time.perf_counter()
            trainers[kind].train_step()
            spans[kind].append((start, time.perf_counter()))
    out = {"spans": {k: v[warmup:] for k, v in spans.items()},
           "phase": {k: v[warmup:] for k, v in phase.items()},
           "rollbacks": post_step.rollbacks, "rollback_bytes": post_step.snapshot.nbytes(),
           "param_bytes": sum(p.numel() * p.element_size()
                              for p in trainers["post"].model.parameters())}
    params = [dict(t.model.named_parameters()) for t in trainers.values()]
    out["identical"] = all(torch.equal(params[0][n].view(torch.int32),
                                       params[1][n].view(torch.int32)) for n in params[0])
    return out


def summarise(results: list[dict]) -> dict:
    """Per pair: the step span over ranks (earliest start to latest end) and the slowest rank's
    optimizer-step phase, for both kinds."""
    kinds = ("sync", "post")
    n = len(results[0]["spans"]["sync"])
    step = {k: [max(r["spans"][k][i][1] for r in results)
                - min(r["spans"][k][i][0] for r in results) for i in range(n)] for k in kinds}
    phase = {k: [max(r["phase"][k][i] for r in results) for i in range(n)] for k in kinds}
    return {
        "step_median_s": {k: statistics.median(step[k]) for k in kinds},
        "phase_median_ms": {k: 1e3 * statistics.median(phase[k]) for k in kinds},
        "step_ratio_median": statistics.median(p / s for p, s in zip(step["post"], step["sync"])),
        "phase_ratio_median": statistics.median(p / s for p, s in zip(phase["post"],
                                                                       phase["sync"])),
        "post_faster_pairs": sum(p < s for p, s in zip(step["post"], step["sync"])),
        "pairs": n,
        "rollbacks": [r["rollbacks"] for r in results],
        "rollback_bytes_per_rank": [r["rollback_bytes"] for r in results],
        "param_bytes_per_rank": [r["param_bytes"] for r in results],
        "identical": all(r["identical"] for r in results),
        "raw_step_s": step,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()

    from loom.config import load_config
    from loom.data.loader import prepare_data
    from loom.testing.harness import WorkerPool
    from loom.testing.parity import layout_config

    steps = args.warmup + args.pairs
    base = {"model.preset": "tiny", "data.seq_len": args.seq_len, "data.max_bytes": 2_000_000,
            "train.global_batch_size": 8, "train.micro_batch_size": 1, "train.steps": steps,
            "parallel.schedule": "1f1b", "optim.warmup_steps": 2}
    rows = {}
    with tempfile.TemporaryDirectory() as data_dir:
        prepare_data(load_config(None, base).data, data_dir)
        pool = WorkerPool(4, pg_timeout_s=600)
        try:
            for clip in (0.0, 1.0):
                tables = {kind: layout_config({**base, "train.grad_clip": clip,
                                               "train.post_validation": kind == "post"}, 4, pp=4)
                          for kind in ("sync", "post")}
                results = pool.run(paired_steps, tables, data_dir, args.pairs, args.warmup,
                                   task_timeout_s=3600)
                rows[f"grad_clip={clip:g}"] = summarise(results)
        finally:
            pool.close()
    print("| setting | median step sync (s) | median step post (s) | median pair ratio post/sync"
          " | pairs post faster | optimizer phase sync / post (ms, slowest rank) | redone steps"
          " | bit-identical |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['step_median_s']['sync']:.4f} | {r['step_median_s']['post']:.4f} |"
              f" {r['step_ratio_median']:.3f} | {r['post_faster_pairs']}/{r['pairs']} |"
              f" {r['phase_median_ms']['sync']:.2f} / {r['phase_median_ms']['post']:.2f} |"
              f" {r['rollbacks'][0]} | {r['identical']} |")
    r = next(iter(rows.values()))
    print(f"rollback copy per rank: {r['rollback_bytes_per_rank']} bytes for"
          f" {r['param_bytes_per_rank']} bytes of parameters")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "post_validation.json").write_text(json.dumps(
        {"rows": rows, "command": "python " + " ".join(sys.argv)}, indent=1))
    return 0 if all(r["identical"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
