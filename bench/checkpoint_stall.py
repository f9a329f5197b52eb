"""Time training is blocked per checkpoint save, synchronous vs asynchronous
(``checkpoint.async_save``).

    python bench/checkpoint_stall.py [--saves 4] [--every 2] [--dim 512] [--layers 8]

One process on the CPU, a ~36M-parameter model (a checkpoint of ~0.43 GB: fp32 weights and
AdamW's two moments). Each mode trains and saves every ``--every`` steps. The stall of a save is
the wall time of ``Trainer.save_checkpoint``: for a synchronous save the whole write and commit;
for an asynchronous one the barrier, the small files and DCP's staging copy to CPU memory, plus
any wait for the previous background write. Also reported: the median step time (async: the
steps that ran during a write) and, for async, the background time from the save call to the
commit. Writes ``bench/out/checkpoint_stall.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    from loom.config import load_config, resolve
    from loom.data.loader import prepare_data
    from loom.train.trainer import Trainer

    overrides = {"model.dim": args.dim, "model.n_layers": args.layers, "model.n_heads": 8,
                 "model.n_kv_heads": 8, "model.ffn_dim": 3 * args.dim,
                 "model.vocab_size": 8192, "data.seq_len": 64, "data.max_bytes": 400_000,
                 "data.tokenizer": "byte", "train.global_batch_size": 4,
                 "train.micro_batch_size": 4, "train.eval_every": 0,
                 "train.steps": 2 + args.saves * args.every, "checkpoint.keep": 2,
                 "checkpoint.async_save": mode == "async", "metrics.tensorboard": False}
    config = resolve(load_config(None, overrides), 1)
    data_dir = workdir / "data"
    if not data_dir.exists():
        prepare_data(config.data, data_dir)
    trainer = Trainer(config, data_dir, workdir / mode)
    for _ in range(2):  # warm-up
        trainer.train_step()
    stalls, steps, background = [], [], []
    for _ in range(args.saves):
        for _ in range(args.every):
            start = time.perf_counter()
            trainer.train_step()
            steps.append(time.perf_counter() - start)
        start = time.perf_counter()
        trainer.save_checkpoint()
        stalls.append(time.perf_counter() - start)
        pending = trainer._pending_save
        if pending is not None:  # the commit time of the background write
            pending._future.add_done_callback(
                lambda _, t=start: background.append(time.perf_counter() - t))
    trainer.wait_for_checkpoint()
    size = sum(p.stat().st_size for p in (workdir / mode / "checkpoints").rglob("*")
               if p.is_file()) / max(1, min(2, args.saves))
    params = sum(p.numel() for p in trainer.model.parameters())
    return {"mode": mode, "parameters": params, "checkpoint_bytes": int(size),
            "stall_s": stalls, "median_stall_s": statistics.median(stalls),
            "median_step_s": statistics.median(steps),
            "background_write_s": background}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loom-ckpt-bench-") as tmp:
        results = [run(mode, args, Path(tmp)) for mode in ("sync", "async")]
    for r in results:
        extra = (f", background write to commit {statistics.median(r['background_write_s']):.2f} s"
                 if r["background_write_s"] else "")
        print(f"{r['mode']:>5}: {r['parameters'] / 1e6:.1f}M parameters, checkpoint"
              f" {r['checkpoint_bytes'] / 1e9:.2f} GB; stall per save median"
              f" {r['median_stall_s']:.3f} s (each: {', '.join(f'{s:.3f}' for s in r['stall_s'])});"
              f" step {r['median_step_s']:.2f} s{extra}")
    out = ROOT / "bench" / "out" / "checkpoint_stall.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
