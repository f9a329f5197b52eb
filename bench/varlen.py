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

``--ranks 4`` measures the balances instead: the real ``Trainer`` on 4 gloo ranks (one thread each,
``loom.testing.harness``), ``train.global_batch_tokens = 4 x --micro x --seq-len`` in microbatches
of ``--micro x --seq-len``: ``none`` and ``tokens`` as dp = 4 (each rank its own microbatch,
documents whole), ``static-cp4`` as cp = 4 (ring, every document zig-zag over the 4 ranks,
``tokens``' microbatches), ``zeppelin`` as cp = 4 (``data.balance = zeppelin``, the same
microbatches placed by ``loom.parallel.zeppelin_cp``: whole documents on one rank with no ring
traffic, long ones over a sub-ring of their own group, shards not padded) and ``zeppelin-step`` the
same with one microbatch of the step's ``4 x --micro x --seq-len`` tokens (the step's documents
placed over the 4 ranks at once; one bin of 4 budgets may take other pieces than 4 bins of one: its
losses can differ from the others' in the third digit). Per step: each rank's CPU time
(``time.thread_time``: its own compute; gloo's transfers run on other threads and a blocked wait
costs none), the compute imbalance max / mean over ranks, the step's wall time (the slowest rank)
and the most bytes a rank sent point to point over cp (the rings' hops, from the ``metrics.comm``
ledger; 0 for dp). On a machine with fewer free cores than ranks the wall time counts the ranks'
total work, not the slowest; the busiest rank's CPU time is then the step time 4 free cores would
give, less the waits between ranks (both are reported). Corpora: ``longtail`` (log-normal lengths,
median ``--tail-median`` tokens, max 32x the median, as text files) and ``stdlib``. ``--calibrate``
prints the tiled attention's time per flop over the linear modules'
(``zeppelin_cp.ATTENTION_SLOWDOWN``).

    python bench/varlen.py --ranks 4 [--seq-len 2048 --micro 1 --steps 3]

Writes ``bench/out/varlen.json`` (``varlen_ranks.json`` with ``--ranks``); results are in
``docs/benchmarks.md``.
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


# -- the balances on several ranks (--ranks) ---------------------------------------------------
BALANCE_LAYOUTS = {  # name: (data.balance, parallel degrees and mode)
    "none": ("none", {"parallel.dp_replicate": -1}),
    "tokens": ("tokens", {"parallel.dp_replicate": -1}),
    "static-cp4": ("tokens", {"parallel.cp": 4, "parallel.cp_mode": "ring",
                              "parallel.dp_replicate": 1}),
    "zeppelin": ("zeppelin", {"parallel.cp": 4, "parallel.cp_mode": "ring",
                              "parallel.dp_replicate": 1}),
    "zeppelin-step": ("zeppelin", {"parallel.cp": 4, "parallel.cp_mode": "ring",
                                   "parallel.dp_replicate": 1}),
}
# One microbatch of the whole step's tokens, placed over the 4 ranks at once (Zeppelin's
# placement of a step's sequences over all its ranks; one bin may fit other pieces than four)
WHOLE_STEP = ("zeppelin-step",)


def write_long_tail(directory: Path, median: int, n_tokens: int, seed: int = 0) -> None:
    """Text files of log-normal lengths (median ``median`` bytes, sigma 1, capped at 32x)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), 1.0, n_tokens // median), 2, 32 * median)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     \n", dtype=np.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(lengths.astype(np.int64)):
        (directory / f"d{i:05d}.txt").write_bytes(rng.choice(letters, int(n)).tobytes())


def rank_steps(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """On every rank: one warm-up step, then ``steps`` timed ones (CPU and wall), and the bytes
    the rank sent point to point over cp in each (ring hops: ``metrics.comm``'s ledger)."""
    from loom.config import from_dict
    from loom.train.trainer import Trainer
    import torch.distributed as dist
    torch.set_num_threads(1)
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    trainer.train_step()
    cpu, wall, losses, sent = [], [], [], []
    for _ in range(steps):
        trainer.ledger.reset()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.thread_time()
        losses.append(trainer.train_step()["loss"])
        cpu.append(time.thread_time() - start_cpu)
        dist.barrier()
        wall.append(time.perf_counter() - start)
        sent.append(trainer.ledger.get("cp", "send").payload_bytes)
    return {"cpu": cpu, "wall": wall, "loss": losses, "cp_sent": sent}


def measure_balances(corpus: dict, data_dir: str, args, registry) -> dict:
    from loom.testing.parity import layout_config
    budget = args.micro * args.seq_len
    base = {**corpus, "data.seq_len": args.seq_len, "data.packing": "varlen",
            "data.tokens_per_microbatch": budget, "train.global_batch_tokens": 4 * budget,
            "model.preset": "tiny", "model.max_seq_len": max(1024, args.seq_len),
            "train.steps": args.steps + 1, "train.eval_every": 0, "optim.warmup_steps": 1,
            "metrics.comm": True}
    rows = {}
    for name, (balance, degrees) in BALANCE_LAYOUTS.items():
        per_microbatch = budget * (args.ranks if name in WHOLE_STEP else 1)
        config = layout_config({**base, "data.balance": balance, **degrees,
                                "data.tokens_per_microbatch": per_microbatch}, args.ranks)
        got = registry.run(args.ranks, rank_steps, config, data_dir, args.steps,
                           task_timeout_s=1800)
        cpu = np.array([r["cpu"] for r in got])  # [rank, step]
        wall = np.array([r["wall"] for r in got]).max(axis=0)
        imbalance = cpu.max(axis=0) / cpu.mean(axis=0)
        rows[name] = {"imbalance": float(np.median(imbalance)),
                      "busiest_cpu_s": float(np.median(cpu.max(axis=0))),
                      "mean_cpu_s": float(np.median(cpu.mean(axis=0))),
                      "wall_s": float(np.median(wall)), "loss": got[0]["loss"],
                      "cp_sent_mb_max": float(np.median(
                          np.array([r["cp_sent"] for r in got]).max(axis=0))) / 2**20}
        r = rows[name]
        print(f"  {name:11s} imbalance {r['imbalance']:.2f}  busiest rank CPU"
              f" {r['busiest_cpu_s']:.2f} s  mean {r['mean_cpu_s']:.2f} s  wall"
              f" {r['wall_s']:.2f} s  cp sent (busiest rank) {r['cp_sent_mb_max']:.1f} MiB",
              flush=True)
    return rows


def calibrate() -> float:
    """The tiled attention's seconds per flop over the linear modules' (one thread, tiny)."""
    from loom.parallel.context_documents import block_backward, block_forward, document_tiles
    from loom.parallel.zeppelin_cp import model_token_costs
    args = preset("tiny")
    model = build_model(args, device="cpu")
    reset_parameters(model, seed=0)
    T = 1024
    x = torch.randint(0, 300, (1, T))
    ids, pos = (torch.arange(T) // 8)[None], (torch.arange(T) % 8)[None]  # attention ~ nil

    def linear() -> None:
        model(x, positions=pos, document_ids=ids).float().sum().backward()

    S, doc = 512, 128
    q, k, v = torch.randn(1, 8, S, 32), torch.randn(1, 4, S, 32), torch.randn(1, 4, S, 32)
    run_ids, run_pos = np.repeat(np.arange(S // doc), doc), np.tile(np.arange(doc), S // doc)
    tiles = document_tiles(run_ids, run_pos, run_ids, run_pos, torch.device("cpu"))

    def attention() -> None:
        out, lse = block_forward(q, k, v, tiles)
        block_backward(q, k, v, out, torch.randn_like(out), lse, tiles)

    def seconds(fn, n: int) -> float:
        fn()
        start = time.thread_time()
        for _ in range(n):
            fn()
        return (time.thread_time() - start) / n

    costs = model_token_costs(args, attention_slowdown=1.0)
    linear_rate = costs.linear * T / seconds(linear, 3)
    attention_rate = costs.attention / args.n_layers * S * doc / seconds(attention, 5)
    return linear_rate / attention_rate


def balances_main(args) -> int:
    from loom.data.loader import prepare_data as prepare
    from loom.config import DataConfig as Data
    from loom.testing.harness import PoolRegistry
    import varlen as this  # noqa: PLW0406  (the pool pickles rank_steps by module name)
    results: dict = {"args": vars(args), "torch": torch.__version__}
    if args.calibrate:
        results["attention_slowdown"] = calibrate()
        print(f"tiled attention / linear, seconds per flop: {results['attention_slowdown']:.2f}")
    registry = PoolRegistry()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            write_long_tail(work / "longtail_src", args.tail_median, args.tail_tokens)
            corpora = {"longtail": {"data.source": str(work / "longtail_src"),
                                    "data.extensions": ".txt"},
                       "stdlib": {"data.source": "stdlib", "data.extensions": ".py",
                                  "data.max_bytes": args.max_bytes}}
            for name, corpus in corpora.items():
                data_dir = work / f"{name}_data"
                prepare(Data(source=corpus["data.source"],
                             extensions=(corpus["data.extensions"],), seq_len=args.seq_len,
                             max_bytes=corpus.get("data.max_bytes", 0)), data_dir)
                print(f"{name}:", flush=True)
                results[name] = measure_balances(corpus, str(data_dir), args, registry)
                results[name] = this.with_speedups(results[name])
    finally:
        registry.close()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "varlen_ranks.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def with_speedups(rows: dict) -> dict:
    """Each balance's step time (wall and busiest CPU) relative to zeppelin's."""
    for r in rows.values():
        r["zeppelin_speedup_wall"] = r["wall_s"] / rows["zeppelin"]["wall_s"]
        r["zeppelin_speedup_busiest_cpu"] = r["busiest_cpu_s"] / rows["zeppelin"]["busiest_cpu_s"]
    return rows


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
    parser.add_argument("--ranks", type=int, default=0,
                        help="4: the balances on 4 ranks (module docstring)")
    parser.add_argument("--tail-median", type=int, default=64)
    parser.add_argument("--tail-tokens", type=int, default=400_000)
    parser.add_argument("--calibrate", action="store_true")
    args = parser.parse_args()
    if args.ranks:
        if args.ranks != 4:
            parser.error("--ranks: 4 (static cp and zeppelin run cp = 4)")
        return balances_main(args)
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
