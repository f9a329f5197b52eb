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
traffic, long ones over a sub-ring of their own group, shards not padded), ``zeppelin-dp`` as
dp = 4, cp = 1 (``data.balance = zeppelin`` over the data-parallel ranks: every rank runs the
4 ranks' microbatches merged, placed over the 4 dp ranks), ``zeppelin-dp-remap`` the same
with the remapping layer (``data.zeppelin_remap``: linear modules on an equal split) and
``zeppelin-step`` the
same with one microbatch of the step's ``4 x --micro x --seq-len`` tokens (the step's documents
placed over the 4 ranks at once; one bin of 4 budgets may take other pieces than 4 bins of one: its
losses can differ from the others' in the third digit). Per step: each rank's CPU time
(``time.thread_time``: its own compute; gloo's transfers run on other threads and a blocked wait
costs none), the compute imbalance max / mean over ranks, the step's wall time (the slowest rank)
and the most bytes a rank sent point to point over cp (the rings' hops, from the ``metrics.comm``
ledger; 0 for none and tokens; zeppelin-dp's sub-rings over dp ranks count there too). On a
machine with fewer free cores than ranks the wall time counts the ranks' total work, not the
slowest; the busiest rank's CPU time is then the step time 4 free cores would give, less the
waits between ranks (both are reported). Corpora (``--corpora``, comma-separated):
``longtail`` (log-normal lengths, median ``--tail-median`` tokens, max 32x the median, as text
files, split at ``--seq-len``), ``longtail-long`` (long-context: median ``--long-median`` = 256,
sigma ``--long-sigma`` = 1.5, max 32x = 8192, split at 8192 so documents stay whole and a step is
4 x 8192 tokens: a few long documents hold most of the attention work, more than a rank's fair
share) and ``stdlib``. ``--calibrate``
prints the costs the placement uses (``zeppelin_placement.KERNEL_SLOWDOWN``, ``TILE_SLOWDOWN``,
``RING_SLOWDOWN``; ``calibrate``), alone with ``--corpora ""``.

    python bench/varlen.py --ranks 4 [--seq-len 2048 --micro 1 --steps 3]
    python bench/varlen.py --ranks 4 --micro 1 --steps 3 --corpora longtail-long --long-seed 1
    python bench/varlen.py --ranks 4 --seq-len 2048 --micro 1 --balances tokens,zeppelin-dp

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
    # dp = 4, cp = 1: every rank runs the 4 ranks' i-th microbatches merged, placed over the
    # 4 dp ranks (short documents whole on one, long ones over a sub-ring of dp ranks)
    "zeppelin-dp": ("zeppelin", {"parallel.dp_replicate": -1}),
    # the same with the remapping layer: the linear modules on an equal split of each merged
    # microbatch, q, k, v and the attention output moved by all-to-alls (data.zeppelin_remap)
    "zeppelin-dp-remap": ("zeppelin", {"parallel.dp_replicate": -1, "data.zeppelin_remap": True}),
}
# One microbatch of the whole step's tokens, placed over the 4 ranks at once (Zeppelin's
# placement of a step's sequences over all its ranks; one bin may fit other pieces than four)
WHOLE_STEP = ("zeppelin-step",)


def write_long_tail(directory: Path, median: int, n_tokens: int, seed: int = 0,
                    sigma: float = 1.0) -> None:
    """Text files of log-normal lengths (median ``median`` bytes, ``sigma``, capped at 32x)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(median), sigma, n_tokens // median), 2, 32 * median)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     \n", dtype=np.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(lengths.astype(np.int64)):
        (directory / f"d{i:05d}.txt").write_bytes(rng.choice(letters, int(n)).tobytes())


CORPORA = ("longtail", "longtail-long", "stdlib")


def balance_corpus(name: str, work: Path, args) -> tuple[dict, int]:
    """A ``--ranks`` corpus's config entries and its split length. ``longtail``: log-normal
    lengths of median ``--tail-median`` bytes, sigma 1, capped at 32x, split at ``--seq-len``;
    ``longtail-long`` (long-context): median ``--long-median``, sigma ``--long-sigma``, capped at
    32x, split at ``max(--seq-len, 32 x --long-median)`` so every document stays whole and one
    can fill a microbatch, seed ``--long-seed``; ``stdlib``: the standard library's ``.py``
    files (the first ``--max-bytes``), split at ``--seq-len``."""
    if name == "stdlib":
        return ({"data.source": "stdlib", "data.extensions": ".py",
                 "data.max_bytes": args.max_bytes}, args.seq_len)
    source = work / f"{name}_src"
    if name == "longtail":
        write_long_tail(source, args.tail_median, args.tail_tokens)
        return {"data.source": str(source), "data.extensions": ".txt"}, args.seq_len
    if name == "longtail-long":
        write_long_tail(source, args.long_median, args.long_tokens, args.long_seed,
                        args.long_sigma)
        return ({"data.source": str(source), "data.extensions": ".txt"},
                max(args.seq_len, 32 * args.long_median))
    raise ValueError(f"--corpora: {name!r} is none of {', '.join(CORPORA)}")


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


def measure_balances(corpus: dict, data_dir: str, seq_len: int, args, registry) -> dict:
    """Every ``BALANCE_LAYOUTS`` row on one corpus, split length ``seq_len``."""
    from loom.testing.parity import layout_config
    budget = args.micro * seq_len
    base = {**corpus, "data.seq_len": seq_len, "data.packing": "varlen",
            "data.tokens_per_microbatch": budget, "train.global_batch_tokens": 4 * budget,
            "model.preset": "tiny", "model.max_seq_len": max(1024, seq_len),
            "train.steps": args.steps + 1, "train.eval_every": 0, "optim.warmup_steps": 1,
            "metrics.comm": True}
    rows = {}
    chosen = [b for b in args.balances.split(",") if b] or list(BALANCE_LAYOUTS)
    for name in chosen:
        balance, degrees = BALANCE_LAYOUTS[name]
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
        print(f"  {name:17s} imbalance {r['imbalance']:.2f}  busiest rank CPU"
              f" {r['busiest_cpu_s']:.2f} s  mean {r['mean_cpu_s']:.2f} s  wall"
              f" {r['wall_s']:.2f} s  cp sent (busiest rank) {r['cp_sent_mb_max']:.1f} MiB",
              flush=True)
    return rows


def calibrate(reps: int = 2) -> dict:
    """The attention costs per flop over the linear modules' (one thread, ``tiny``, forward and
    backward), what ``zeppelin_placement.KERNEL_SLOWDOWN`` and ``TILE_SLOWDOWN`` hold, and a grouped
    document's tiles over the same document whole (``RING_SLOWDOWN``, ``ring_over_whole``).

    The model's own kernel: the model on rows of ``T`` tokens (1024, 2048, 4096) cut into ``k``
    whole documents (1, 4, 16), each on the CPU document attention (causal SDPA per document),
    CPU seconds fitted by least squares to ``fixed + a T + b pairs + c k`` (``pairs`` the causal
    query-key pairs, ``sum s(s+1)/2``; ``c`` a document's Python and launch): ``a`` is the linear
    modules' seconds per token, ``b`` the kernel's per pair. The masked tiles: the ring engine's
    fp32 tiles (``block_forward`` / ``block_backward``) of 128-token documents, per computed pair.
    Each is divided by its flops (``model_token_costs`` with a slowdown of 1)."""
    from dataclasses import replace as with_fields
    from loom.parallel.context_documents import block_backward, block_forward, document_tiles
    from loom.parallel.zeppelin_placement import model_token_costs
    args = with_fields(preset("tiny"), max_seq_len=4096)
    model = build_model(args, device="cpu")
    reset_parameters(model, seed=0)

    def seconds(fn, n: int) -> float:
        fn()
        start = time.thread_time()
        for _ in range(n):
            fn()
        return (time.thread_time() - start) / n

    rows, times = [], []
    for T in (1024, 2048, 4096):
        x = torch.randint(0, 300, (1, T))
        for k in (1, 4, 16):
            s = T // k
            ids, pos = (torch.arange(T) // s)[None], (torch.arange(T) % s)[None]

            def step() -> None:
                model(x, positions=pos, document_ids=ids).float().sum().backward()
            rows.append([1.0, T, k * s * (s + 1) / 2, k])
            times.append(seconds(step, reps))
    (fixed, per_token, per_pair, per_document), *_ = np.linalg.lstsq(
        np.array(rows), np.array(times), rcond=None)

    S, doc = 512, 128
    q, k_, v = torch.randn(1, 8, S, 32), torch.randn(1, 4, S, 32), torch.randn(1, 4, S, 32)
    run_ids, run_pos = np.repeat(np.arange(S // doc), doc), np.tile(np.arange(doc), S // doc)
    tiles = document_tiles(run_ids, run_pos, run_ids, run_pos, torch.device("cpu"))

    def attention() -> None:
        out, lse = block_forward(q, k_, v, tiles)
        block_backward(q, k_, v, out, torch.randn_like(out), lse, tiles)
    per_tile_pair = seconds(attention, 5 * reps) / (S * doc) * args.n_layers
    ring = ring_over_whole(4096, 4, seconds, reps)

    flops = model_token_costs(args, attention_slowdown=1.0)
    linear_per_flop = per_token / flops.linear
    return {"kernel_slowdown": float(per_pair / flops.attention / linear_per_flop),
            "tile_slowdown": float(per_tile_pair / flops.attention / linear_per_flop),
            "ring_slowdown": ring,
            "linear_s_per_token": float(per_token), "kernel_s_per_pair": float(per_pair),
            "s_per_document": float(per_document), "fixed_s": float(fixed),
            "fit_residual_max": float(np.max(np.abs(np.array(rows) @ np.array(
                [fixed, per_token, per_pair, per_document]) - np.array(times))))}


def ring_over_whole(n: int, g: int, seconds, reps: int) -> float:
    """A document of ``n`` tokens zig-zag over a group of ``g``: rank 0's attention on the
    engine's tiles (its own causal tile, then full tiles against each member's chunks, merged;
    forward and backward, one layer) over a ``g``-th of the whole document's on the model's
    causal kernel."""
    from loom.data.zeppelin import UNIT, Partition, Ranks
    from loom.parallel.context_documents import (block_backward, block_forward, document_tiles,
                                                 merge_masked)
    plan = Partition("ring", (n,), (0,), (g,), Ranks(g, g), UNIT)
    held = [plan.token_indices(r) for r in range(g)]  # global index = position (one document)
    cpu = torch.device("cpu")
    tiles = [document_tiles(np.zeros(len(held[0]), np.int64), held[0],
                            np.zeros(len(held[m]), np.int64), held[m], cpu, own_keys=m == 0)
             for m in range(g)]
    q = torch.randn(1, 8, len(held[0]), 32)
    kv = [(torch.randn(1, 4, len(h), 32), torch.randn(1, 4, len(h), 32)) for h in held]

    def tiled() -> None:
        out, lse = block_forward(q, *kv[0], tiles[0])
        for m in range(1, g):
            if tiles[m]:
                out, lse = merge_masked(out, lse, *block_forward(q, *kv[m], tiles[m]))
        dout = torch.randn_like(out)
        for m in range(g):
            if tiles[m]:
                block_backward(q, *kv[m], out, dout, lse, tiles[m])
    qkv = [torch.randn(1, 8, n, 32, requires_grad=True) for _ in range(3)]

    def whole() -> None:
        out = F.scaled_dot_product_attention(*qkv, is_causal=True)
        out.backward(torch.ones_like(out))
    return float(seconds(tiled, 2 * reps) * g / seconds(whole, reps))


def balances_main(args) -> int:
    from loom.data.loader import prepare_data as prepare
    from loom.config import DataConfig as Data
    from loom.testing.harness import PoolRegistry
    import varlen as this  # noqa: PLW0406  (the pool pickles rank_steps by module name)
    results: dict = {"args": vars(args), "torch": torch.__version__}
    if args.calibrate:
        results["calibration"] = c = calibrate()
        print(f"seconds per flop over the linear modules': the model's kernel"
              f" {c['kernel_slowdown']:.2f}, the masked tiles {c['tile_slowdown']:.2f};"
              f" a document over 4 ranks / whole {c['ring_slowdown']:.2f}"
              f" (fit: {1e6 * c['linear_s_per_token']:.1f} us per token,"
              f" {1e9 * c['kernel_s_per_pair']:.1f} ns per causal pair,"
              f" {1e3 * c['s_per_document']:.2f} ms per document, worst residual"
              f" {1e3 * c['fit_residual_max']:.0f} ms)", flush=True)
    registry = PoolRegistry()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            for name in [c for c in args.corpora.split(",") if c]:  # "": --calibrate only
                corpus, seq_len = balance_corpus(name, work, args)
                data_dir = work / f"{name}_data"
                prepare(Data(source=corpus["data.source"],
                             extensions=(corpus["data.extensions"],), seq_len=seq_len,
                             max_bytes=corpus.get("data.max_bytes", 0)), data_dir)
                print(f"{name} (split length {seq_len}):", flush=True)
                results[name] = measure_balances(corpus, str(data_dir), seq_len, args, registry)
                results[name] = this.with_speedups(results[name])
    finally:
        registry.close()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "varlen_ranks.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def with_speedups(rows: dict) -> dict:
    """Each balance's step time (wall and busiest CPU) relative to zeppelin's and to
    zeppelin-dp's, where they ran."""
    for ref in ("zeppelin", "zeppelin-dp"):
        if ref not in rows:
            continue
        tag = ref.replace("-", "_")
        for r in rows.values():
            r[f"{tag}_speedup_wall"] = r["wall_s"] / rows[ref]["wall_s"]
            r[f"{tag}_speedup_busiest_cpu"] = r["busiest_cpu_s"] / rows[ref]["busiest_cpu_s"]
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
    parser.add_argument("--corpora", default="longtail,stdlib",
                        help=f"--ranks: comma-separated, of {', '.join(CORPORA)}")
    parser.add_argument("--long-median", type=int, default=256)
    parser.add_argument("--long-sigma", type=float, default=1.5)
    parser.add_argument("--long-tokens", type=int, default=600_000)
    parser.add_argument("--long-seed", type=int, default=0)
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--balances", default="",
                        help=f"--ranks: comma-separated rows, of {', '.join(BALANCE_LAYOUTS)}"
                        " (default: all)")
    args = parser.parse_args()
    unknown = [b for b in args.balances.split(",") if b and b not in BALANCE_LAYOUTS]
    if unknown:
        parser.error(f"--balances: {unknown} not among {', '.join(BALANCE_LAYOUTS)}")
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
