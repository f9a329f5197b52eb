"""Benchmark: ``data.packing = varlen`` steps vs ``concat`` steps at equal tokens, one process,
forward + backward of the ``tiny`` model (fp32, CPU).

A ``concat`` step is ``--microbatches`` microbatches of ``--micro`` rows of ``--seq-len``
tokens (windows of the token stream, the plain model, SDPA ``is_causal``). A ``varlen`` step has
the same token budget: ``global_batch_tokens = microbatches * micro * seq_len`` in microbatches
of ``tokens_per_microbatch = micro * seq_len``, each one row ``[1, T]`` of whole document pieces
(``loom.data.varlen``, split length ``--seq-len``) through ``Transformer(document_ids=...)``
(the CPU kernel: causal SDPA per piece, ``loom.models.document_attention``). Both steps sum the
token losses and divide by the step's tokens, as the trainer does. Steps are drawn by the real
loaders (``DistributedLoader``, ``VarlenLoader``), the same seed.

Two corpora: ``stdlib`` (the standard library's ``.py`` files, the first ``--max-bytes``, byte
tokens, real lengths) and ``short`` (log-normal lengths, median ``--short-median`` tokens, capped
at 32x the median: many documents per microbatch, the per-piece kernel's worst case).

Blocks of ``--steps`` steps alternate (concat, varlen, ...); the headline is the median over
adjacent pairs of time(varlen) / time(concat) per step, and the ratio of tokens/s (varlen counts
the predictions it holds, at most the budget). With ``--threads 1`` every kernel runs on the
calling thread, so its CPU time (``time.thread_time``) is measured beside the wall clock: on a
shared machine it counts this process's work, not the waits for a core.

    python bench/varlen.py [--threads 1] [--pairs 8] [--steps 2]

Writes ``bench/out/varlen.json``; results are in ``docs/benchmarks.md``.
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from loom.data.loader import DistributedLoader, GlobalBatchSampler  # noqa: E402
from loom.data.varlen import VarlenDocuments, VarlenLoader  # noqa: E402
from loom.models import build_model, preset, reset_parameters  # noqa: E402

import varlen_attention  # noqa: E402  (bench/, the script's own folder: the same corpora)


def stdlib_sets(seq_len: int, max_bytes: int, work: Path):
    return varlen_attention.stdlib_sets(seq_len, max_bytes, work, packing="varlen")


def short_sets(seq_len: int, median: int, n_tokens: int, work: Path, seed: int = 0):
    return varlen_attention.short_sets(seq_len, median, n_tokens, work, seed, VarlenDocuments)


def concat_step(model, micro: int):
    def step(batch) -> int:
        model.zero_grad(set_to_none=True)
        inputs, targets = batch
        for x, y in zip(inputs.split(micro), targets.split(micro)):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            (loss / targets.numel()).backward()
        return targets.numel()
    return step


def varlen_step(model):
    def step(batch) -> int:
        model.zero_grad(set_to_none=True)
        tokens = sum(mb.targets.numel() for mb in batch.microbatches)
        for mb in batch.microbatches:
            logits = model(mb.inputs, positions=mb.positions, document_ids=mb.document_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="sum")
            (loss / tokens).backward()
        return tokens
    return step


def measure(model, concat_set, varlen_set, args) -> dict:
    budget = args.micro * args.seq_len
    step_tokens = args.microbatches * budget
    concat = DistributedLoader(concat_set, GlobalBatchSampler(
        len(concat_set), args.microbatches * args.micro, seed=1))
    varlen = VarlenLoader(varlen_set, GlobalBatchSampler(len(varlen_set), 1, seed=1),
                          step_tokens, budget, args.balance)
    n = args.pairs * args.steps + 1
    sides = {"concat": (concat_step(model, args.micro), [concat.next_batch() for _ in range(n)]),
             "varlen": (varlen_step(model), [varlen.next_batch() for _ in range(n)])}
    wall: dict[str, list[float]] = {"concat": [], "varlen": []}
    cpu: dict[str, list[float]] = {"concat": [], "varlen": []}
    tokens: dict[str, list[int]] = {"concat": [], "varlen": []}
    for step, batches in sides.values():  # warm-up
        step(batches[-1])
    for p in range(args.pairs):
        for name, (step, batches) in sides.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            for b in batches[p * args.steps:(p + 1) * args.steps]:
                tokens[name].append(step(b))
            wall[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append((time.thread_time() - start_cpu) / args.steps)
    pieces = [len(set(mb.document_ids[0].tolist())) for b in sides["varlen"][1]
              for mb in b.microbatches]
    out = {"step_tokens_budget": step_tokens,
           "varlen_token_share": float(np.mean(tokens["varlen"])) / step_tokens,
           "pieces_per_microbatch": float(np.mean(pieces))}
    for clock, t in (("wall", wall), ("cpu", cpu)):
        ratios = [v / c for v, c in zip(t["varlen"], t["concat"])]
        per_s = {name: float(np.mean(tokens[name])) / statistics.median(t[name]) for name in t}
        out[clock] = {"ratio_varlen_over_concat": statistics.median(ratios),
                      "ratio_min": min(ratios), "ratio_max": max(ratios),
                      "concat_ms": 1e3 * statistics.median(t["concat"]),
                      "varlen_ms": 1e3 * statistics.median(t["varlen"]),
                      "concat_tokens_per_s": per_s["concat"],
                      "varlen_tokens_per_s": per_s["varlen"],
                      "tokens_per_s_varlen_over_concat": per_s["varlen"] / per_s["concat"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--micro", type=int, default=2, help="rows of seq-len per microbatch")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--balance", default="none", choices=("none", "tokens"))
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=4_000_000)
    parser.add_argument("--short-median", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(preset("tiny"), device="cpu")
    reset_parameters(model, seed=0)
    results = {"args": vars(args), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpora = {"stdlib": stdlib_sets(args.seq_len, args.max_bytes, work / "stdlib"),
                   "short": short_sets(args.seq_len, args.short_median, 2_000_000, work)}
        for name, (concat_set, varlen_set) in corpora.items():
            r = measure(model, concat_set, varlen_set, args)
            results[name] = r
            print(f"{name}: varlen steps hold {100 * r['varlen_token_share']:.1f}% of the"
                  f" {r['step_tokens_budget']}-token budget, {r['pieces_per_microbatch']:.2f}"
                  " document pieces per microbatch", flush=True)
            for clock in ("wall", "cpu"):
                c = r[clock]
                print(f"  {clock:4s} step time varlen/concat {c['ratio_varlen_over_concat']:.3f}"
                      f" (pairs {c['ratio_min']:.3f}-{c['ratio_max']:.3f}); tokens/s"
                      f" varlen/concat {c['tokens_per_s_varlen_over_concat']:.3f}; concat"
                      f" {c['concat_ms']:.0f} ms, varlen {c['varlen_ms']:.0f} ms per step",
                      flush=True)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "varlen.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
