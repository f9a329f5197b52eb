"""The balance vocabulary parallelism across the pipeline buys: memory and time of every rank.

A small model with a large vocabulary (V = 32768, dim 128, 4 layers: the embedding and the head
are 4.2 M parameters each against 0.6 M in the blocks) trains with 1F1B on p local ranks (gloo,
CPU), m = 8 microbatches of 2 x 128 tokens, with and without ``parallel.vocab_parallel_pp`` (the
first and last stage holding the embedding and the head, or every rank V/p rows of both and the
S/T passes of ``loom.schedule.vocab_passes``). Every configuration runs in a fresh pool of
processes; per rank it reports:

* parameter bytes (exact: what the rank's ``LocalStages`` holds);
* peak RSS growth over training: ``ru_maxrss`` after the steps minus the resident set after the
  trainer was built (the gradients, Adam's two moments, the activations and logits of the step's
  microbatches in flight, and allocator slack: a process-level, not a tensor-level, figure);
* CPU time per step: the process's user + system time over the timed steps, per step (the
  work a rank does, whatever the cores it shares; gloo's waits block and cost little);
* compute time per step: the sum of the rank's action durations (``PipelineRecorder``: F, B and
  the S / T passes, without waiting for messages; the embedding's partial lookups and their
  backward at the step's edges are outside the actions and not counted), median over the timed
  steps: wall clock, so it stretches when more ranks compute at once than there are cores;
* the step's wall time (the same on every rank: the step ends with an all-reduce).

    python bench/vocab_pipeline.py [--pp 2 4] [--steps 4]
    python bench/vocab_pipeline.py --pp 2 --tp 2  # composed with tensor parallelism

``--tp t`` runs every configuration on p x t ranks: the stages' blocks Megatron-split over tp;
without vocabulary parallelism across the pipeline the embedding and the head are split over
tp on the first and last stage (``parallel.vocab_parallel``, Megatron's vocab-parallel head);
with it every rank holds V/(p t) rows of both. Parameter bytes are each rank's local shards.
    python bench/vocab_pipeline.py --simulate     # the simulator's view, no processes

``--simulate`` replays 1F1B with the output layer on the last stage (its F and B heavier by
``head`` and ``2 head`` stage-F units, the embedding free) against the paper's 1F1B variant
(``vocab_1f1b``, one extra warm-up forward) whose S and T cost head / p and 2 head / p on every
rank, with a message time of 0.05 between ranks: makespan, and the busiest and idlest ranks.

Writes ``bench/out/vocab_pipeline.json``. The machine's CPU is shared (the ranks are processes on
the same cores, with whatever else runs): the compute times include that contention, the
parameter bytes do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = {"model.dim": 128, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 4,
         "model.ffn_dim": 384, "model.vocab_size": 32768, "model.max_seq_len": 128}
MICRO, MICROBATCHES, SEQ = 2, 8, 128
DATA = {"data.seq_len": SEQ, "data.max_bytes": 400_000, "data.extensions": ".py"}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(ctx, config_table: dict, data_dir: str, steps: int) -> dict:
    """On every rank: build the trainer, train one warm-up step and ``steps`` timed ones."""
    import torch

    from loom.config import from_dict
    from loom.pipeline.profile import PipelineRecorder
    from loom.train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(from_dict(config_table), Path(data_dir), None, ctx)
    built = _rss_bytes()
    params = sum(getattr(p, "_local_tensor", p).numel() * p.element_size()  # tp: local shard
                 for p in trainer.model.parameters())
    trainer.train_step()  # warm-up: Adam's states, the allocator's pools
    recorder = PipelineRecorder(ctx.rank)
    trainer.pipeline.recorder = recorder
    usage = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        trainer.train_step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime) / steps
    peak = after.ru_maxrss * 1024
    compute = [sum(end - start for _, start, end in step.actions)
               for step in recorder.profile.steps]
    walls = [step.end - step.begin for step in recorder.profile.steps]
    ops: dict[str, float] = {}
    for step in recorder.profile.steps:
        for token, start, end in step.actions:
            op = token.lstrip("0123456789")[0]
            ops[op] = ops.get(op, 0.0) + (end - start) / len(recorder.profile.steps)
    return {"rank": ctx.rank, "pp_rank": trainer.pipeline.pp_rank, "param_bytes": params,
            "rss_growth": peak - built,
            "compute_s": statistics.median(compute), "wall_s": statistics.median(walls),
            "cpu_s": cpu,
            "compute_by_op_s": ops, "schedule": trainer.pipeline.schedule.name}


def run(pp: int, vocab: bool, data_dir: str, steps: int, tp: int = 1) -> list[dict]:
    from loom.testing.harness import WorkerPool
    from loom.testing.parity import layout_config

    config = layout_config({**MODEL, **DATA, "model.preset": "debug", "train.steps": steps + 1,
                            "train.micro_batch_size": MICRO,
                            "train.global_batch_size": MICRO * MICROBATCHES,
                            "parallel.schedule": "1f1b", "parallel.vocab_parallel_pp": vocab,
                            "metrics.tensorboard": False}, pp * tp, pp=pp, tp=tp)
    pool = WorkerPool(pp * tp, pg_timeout_s=600.0)
    try:
        return pool.run(measure, config, data_dir, steps, task_timeout_s=1800.0)
    finally:
        pool.close()


def simulated() -> list[dict]:
    """The simulator's makespans and per-rank busy time, with and without the passes."""
    from fractions import Fraction

    from loom.schedule.cost import StageCosts
    from loom.schedule.families import get
    from loom.schedule.simulate import simulate
    from loom.schedule.vocab_passes import vocab_1f1b

    rows = []
    latency = Fraction(1, 20)
    for pp in (4, 8):
        m = 4 * pp
        for head in (Fraction(1, 2), Fraction(1), Fraction(2)):
            last = [0] * (pp - 1) + [head]
            plain = simulate(get("1f1b")(pp, m), StageCosts.per_stage(
                [1 + h for h in last], [1 + h for h in last], [1 + h for h in last],
                latency=latency))
            vocab = simulate(vocab_1f1b(pp, m), StageCosts.uniform(1, 1, 1, latency=latency),
                             vocab_costs=(head / pp, 2 * head / pp))
            rows.append({"pp": pp, "m": m, "head": float(head),
                         "makespan": [float(plain.makespan), float(vocab.makespan)],
                         "busy_min_max": [[float(min(r.busy)), float(max(r.busy))]
                                          for r in (plain, vocab)],
                         "peak_units": [float(max(r.peak_memory)) for r in (plain, vocab)]})
            row = rows[-1]
            print(f"p={pp} m={m} head={float(head):g}: makespan {row['makespan'][0]:.1f} ->"
                  f" {row['makespan'][1]:.1f} ({row['makespan'][1] / row['makespan'][0] - 1:+.1%}),"
                  f" busy min/max {row['busy_min_max'][0]} -> {row['busy_min_max'][1]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (p x tp ranks)")
    parser.add_argument("--simulate", action="store_true")
    args = parser.parse_args()
    if args.simulate:
        simulated()
        return
    from loom.data.loader import prepare_data

    class Data:  # the byte-level standard library corpus of the tests, 128-token rows
        source, extensions, tokenizer, bpe_vocab_size = "stdlib", (".py",), "byte", 2048
        seq_len, val_fraction, max_bytes = SEQ, 0.05, 400_000

    results = []
    with tempfile.TemporaryDirectory() as data_dir:
        prepare_data(Data(), Path(data_dir))
        for pp in args.pp:
            for vocab in (False, True):
                began = time.perf_counter()
                ranks = run(pp, vocab, data_dir, args.steps, args.tp)
                results.append({"pp": pp, "tp": args.tp, "vocab_parallel_pp": vocab,
                                "ranks": ranks,
                                "bench_s": time.perf_counter() - began})
                print(f"pp={pp} tp={args.tp} vocab_parallel_pp={vocab} ({ranks[0]['schedule']}): "
                      f"step {ranks[0]['wall_s'] * 1e3:.0f} ms")
                for r in ranks:
                    print(f"  rank {r['rank']} (pp {r['pp_rank']}): params"
                          f" {r['param_bytes'] / 2**20:6.1f} MiB, "
                          f"RSS growth {r['rss_growth'] / 2**20:6.1f} MiB, CPU "
                          f"{r['cpu_s'] * 1e3:6.0f} ms, compute {r['compute_s'] * 1e3:6.0f} ms "
                          + " ".join(f"{op}={t * 1e3:.0f}" for op, t in
                                     sorted(r["compute_by_op_s"].items())))
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    name = "vocab_pipeline.json" if args.tp == 1 else f"vocab_pipeline_tp{args.tp}.json"
    (out / name).write_text(json.dumps(
        {"model": MODEL, "micro_batch": MICRO, "microbatches": MICROBATCHES, "seq_len": SEQ,
         "load": os.getloadavg(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
