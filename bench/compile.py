"""Benchmark: ``train.compile = true`` on one rank, against Loom eager and a plain PyTorch loop.

Four training steps on the same ``tiny`` model (same seed, so the same weights), batch and
thread count, measured side by side in one process:

* ``plain``: the textbook loop of bench/single_rank.py (forward, cross entropy, backward,
  global-norm clipping, ``AdamW(foreach=True)``), eager: the baseline of issue 20's target
  (``loom`` compiled >= 1.1x its tokens/s);
* ``plain_compiled``: the same loop with each transformer block compiled as Loom compiles it
  (``torch.compile`` of the block's forward, inductor), optimizer unchanged;
* ``loom``: ``Trainer.train_step`` (data loader, schedule, clipping, LR schedule, fused AdamW);
* ``loom_compiled``: the same with ``train.compile = true``.

Compilation happens in the warm-up steps and is not timed (it is reported: the first step's
time). Blocks of steps alternate (A B C D A B C D ...) so machine noise hits all four alike; each
ratio is the median over rounds of the ratio within one round.

    python bench/compile.py [--steps-per-block 3] [--blocks 10] [--threads 2]

Writes ``bench/out/compile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from loom.config import load_config, resolve  # noqa: E402
from loom.data.loader import prepare_data  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402
from single_rank import plain_loop, time_block  # noqa: E402  (bench/ is the script's folder)

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("plain", "plain_compiled", "loom", "loom_compiled")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-per-block", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    total = args.blocks * args.steps_per_block + 10
    overrides = {"model.preset": "tiny", "train.steps": total,
                 "train.global_batch_size": args.batch, "train.micro_batch_size": args.batch,
                 "data.seq_len": args.seq_len, "data.max_bytes": 3_000_000,
                 "train.threads": args.threads}
    config = resolve(load_config(None, overrides), 1)
    compiled_config = resolve(load_config(None, {**overrides, "train.compile": True}), 1)
    with tempfile.TemporaryDirectory() as tmp:
        prepare_data(config.data, tmp)
        eager_trainer = Trainer(config, tmp)
        compiled_trainer = Trainer(compiled_config, tmp)
        batch = eager_trainer.loader.next_batch()
        steps = {"plain": plain_loop(config, batch, compiled=False),
                 "plain_compiled": plain_loop(config, batch, compiled=True),
                 "loom": eager_trainer.train_step, "loom_compiled": compiled_trainer.train_step}
        first_step_s = {}
        for name in NAMES:  # warm-up: compilation, allocator, optimizer state
            first_step_s[name] = time_block(steps[name], 1)
            time_block(steps[name], 2)
        times: dict[str, list[float]] = {name: [] for name in NAMES}
        for _ in range(args.blocks):
            for name in NAMES:
                times[name].append(time_block(steps[name], args.steps_per_block))
    tokens = args.batch * args.seq_len
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    # Blocks of one round share the machine's state, so the ratio within a round is the least
    # noisy comparison; the median over rounds is the headline.
    ratios = {name: statistics.median(p / t for p, t in zip(times["plain"], times[name]))
              for name in NAMES}
    ratios["loom_compiled_over_loom"] = statistics.median(
        e / c for e, c in zip(times["loom"], times["loom_compiled"]))
    result = {"tokens_per_step": tokens, "threads": args.threads, "block_step_times_s": times,
              "first_step_s": first_step_s, "median_tokens_per_s": tps,
              "speedup_over_plain_eager": ratios, "torch": torch.__version__,
              "command": "python " + " ".join(sys.argv)}
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile.json").write_text(json.dumps(result, indent=2))
    for name in NAMES:
        print(f"{name:>15}: {tps[name]:8,.0f} tokens/s   x{ratios[name]:.3f} of plain eager"
              f"   (first step {first_step_s[name]:.1f} s)")
    print(f"Loom compiled / Loom eager: x{ratios['loom_compiled_over_loom']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
