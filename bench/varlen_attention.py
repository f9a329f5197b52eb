"""Benchmark: document-masked attention (``data.packing = "pack"``) vs ``concat`` at equal
tokens, one process, forward + backward of the ``tiny`` model (fp32, CPU).

Both sides run the same model on batches of the same shape (``--batch`` rows of ``--seq-len``
tokens): ``concat`` rows are windows of the token stream through the plain model (SDPA
``is_causal``), ``pack`` rows are whole documents (``loom.data.packing``) through
``Transformer(document_ids=...)`` (the CPU kernel: causal SDPA per document,
``loom.models.document_attention``). Two corpora:

* ``stdlib``: the standard library's ``.py`` files (the first ``--max-bytes``), byte tokens,
  their real lengths;
* ``short``: synthetic documents with log-normal lengths (median ``--short-median`` tokens,
  capped at 32x the median), many per row: the worst case for the per-document kernel.

Blocks of ``--steps`` steps alternate (concat, pack, concat, ...) over the same sequence of
batch indices; the headline is the median over adjacent block pairs of time(pack) /
time(concat) (target from issue 17: <= 1.10). With ``--threads 1`` every kernel runs on the
calling thread, so its CPU time (``time.thread_time``) is measured beside the wall clock: on a
shared machine it counts this process's work and not the waits for a core. Real tokens/s counts
non-padding tokens only.

    python bench/varlen_attention.py [--threads 1] [--pairs 12] [--steps 2]

Writes ``bench/out/varlen_attention.json``; results are in ``docs/benchmarks.md``.
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

from loom.config import DataConfig  # noqa: E402
from loom.data.loader import PackedSequences, prepare_data  # noqa: E402
from loom.data.packing import IGNORE_INDEX, PackedDocuments, offsets_from_eos  # noqa: E402
from loom.models import build_model, preset, reset_parameters  # noqa: E402


def stdlib_sets(seq_len: int, max_bytes: int, work: Path, packing: str = "pack"):
    """The standard library's .py files as concatenated rows and as ``packing``'s documents."""
    files = prepare_data(DataConfig(source="stdlib", extensions=(".py",), seq_len=seq_len,
                                      max_bytes=max_bytes), work)
    return files.train_set(seq_len), files.train_set(seq_len, packing=packing)


def short_sets(seq_len: int, median: int, n_tokens: int, work: Path, seed: int = 0,
               documents: type = PackedDocuments):
    """A synthetic long tail (log-normal lengths, max 32x the median) as concatenated rows and
    as ``documents`` (``PackedDocuments`` or ``loom.data.varlen.VarlenDocuments``)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, n_tokens // median), 2, 32 * median)
    lengths = lengths.astype(np.int64)
    eos = 300
    tokens = rng.integers(0, eos, int(lengths.sum())).astype(np.uint16)
    tokens[np.cumsum(lengths) - 1] = eos
    path = work / "short.bin"
    tokens.tofile(path)
    return (PackedSequences(path, seq_len, "uint16"),
            documents(tokens, offsets_from_eos(tokens, eos), seq_len))


def step_fn(model, packed: bool):
    def step(batch) -> None:
        model.zero_grad(set_to_none=True)
        if packed:
            logits = model(batch.inputs, positions=batch.positions,
                           document_ids=batch.document_ids)
            targets = batch.targets
        else:
            inputs, targets = batch
            logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return step


def measure(model, concat_set, pack_set, batch: int, pairs: int, steps: int,
            seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    draws = [(rng.integers(0, len(concat_set), batch), rng.integers(0, len(pack_set), batch))
             for _ in range(pairs * steps)]
    sides = {"concat": (step_fn(model, False), concat_set, 0),
             "pack": (step_fn(model, True), pack_set, 1)}
    times: dict[str, list[float]] = {"concat": [], "pack": []}
    cpu: dict[str, list[float]] = {"concat": [], "pack": []}
    real = []
    for name, (step, ds, k) in sides.items():  # warm-up
        step(ds.batch(draws[0][k]))
    for p in range(pairs):
        for name, (step, ds, k) in sides.items():
            batches = [ds.batch(d[k]) for d in draws[p * steps:(p + 1) * steps]]
            if name == "pack":
                real += [int((b.targets != IGNORE_INDEX).sum()) for b in batches]
            start, start_cpu = time.perf_counter(), time.thread_time()
            for b in batches:
                step(b)
            times[name].append((time.perf_counter() - start) / steps)
            cpu[name].append((time.thread_time() - start_cpu) / steps)
    slots = batch * pack_set.seq_len
    out = {"real_token_share": float(np.mean(real)) / slots,
           "pieces_per_row": float(np.diff(pack_set.layout.row_start).mean())}
    for clock, t in (("wall", times), ("cpu", cpu)):
        ratios = [p / c for p, c in zip(t["pack"], t["concat"])]
        out[clock] = {
            "ratio_pack_over_concat": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "concat_ms": 1e3 * statistics.median(t["concat"]),
            "pack_ms": 1e3 * statistics.median(t["pack"]),
            "concat_tokens_per_s": slots / statistics.median(t["concat"]),
            "pack_real_tokens_per_s": float(np.mean(real)) / statistics.median(t["pack"]),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=12)
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
        for name, (concat_set, pack_set) in corpora.items():
            r = measure(model, concat_set, pack_set, args.batch, args.pairs, args.steps)
            results[name] = r
            print(f"{name}: real tokens {100 * r['real_token_share']:.1f}% of pack's slots,"
                  f" {r['pieces_per_row']:.2f} document pieces per row", flush=True)
            for clock in ("wall", "cpu"):
                c = r[clock]
                print(f"  {clock:4s} pack/concat {c['ratio_pack_over_concat']:.3f} (pairs"
                      f" {c['ratio_min']:.3f}-{c['ratio_max']:.3f}); concat {c['concat_ms']:.0f}"
                      f" ms, pack {c['pack_ms']:.0f} ms per step", flush=True)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "varlen_attention.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
