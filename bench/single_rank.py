"""Benchmark: Loom's one-process training step vs a plain PyTorch loop on the same model and batch.

Both sides train the same ``tiny`` model (same seed, so the same weights) on the same batch shape
with AdamW and global-norm clipping. Loom's side is ``Trainer.train_step`` (data loader, microbatch
loop, clipping, LR schedule, loss reduction); the plain side is the textbook loop written inline.
Measured in one process, in alternating blocks (A B A B ...) so machine noise hits both alike;
the median over adjacent block pairs of the tokens/s ratio is reported (target >= 0.97).

    python bench/single_rank.py [--steps-per-block 4] [--blocks 20] [--threads 2]

Writes ``bench/out/single_rank.json`` and ``docs/img/single_rank.png``.
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

import torch  # noqa: E402

from loom.config import load_config, resolve  # noqa: E402
from loom.data.loader import prepare_data  # noqa: E402
from loom.models import build_model, reset_parameters  # noqa: E402
from loom.parallel.compile import apply_compile  # noqa: E402
from loom.train.optim import clip_grad_norm  # noqa: E402
from loom.config import model_args  # noqa: E402
from loom.train.trainer import Trainer, cross_entropy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def plain_loop(config, batch, compiled: bool = False):
    """The reference: model, AdamW, forward/backward/clip/step, nothing else; ``compiled``:
    each block compiled (``apply_compile``, the same call Loom's ``parallelize`` makes)."""
    model = build_model(model_args(config), device="meta")
    model.to_empty(device="cpu")
    reset_parameters(model, config.train.seed)
    if compiled:
        apply_compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=config.optim.lr, foreach=True,
                            betas=(config.optim.beta1, config.optim.beta2),
                            weight_decay=config.optim.weight_decay)
    inputs, targets = batch

    def step():
        opt.zero_grad(set_to_none=True)
        loss = cross_entropy(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        opt.step()
        return float(loss.detach())

    return step


def time_block(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-per-block", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    total = args.blocks * args.steps_per_block + 10
    config = resolve(load_config(None, {
        "model.preset": "tiny", "train.steps": total, "train.global_batch_size": args.batch,
        "train.micro_batch_size": args.batch, "data.seq_len": args.seq_len,
        "data.max_bytes": 3_000_000, "train.threads": args.threads}), 1)
    with tempfile.TemporaryDirectory() as tmp:
        prepare_data(config.data, tmp)
        trainer = Trainer(config, tmp)
        batch = trainer.loader.next_batch()
        plain = plain_loop(config, batch)
        loom_step = trainer.train_step
        for step in (plain, loom_step):  # warm-up: allocator, kernels, optimizer state
            time_block(step, 3)
        times = {"plain": [], "loom": []}
        for _ in range(args.blocks):
            times["plain"].append(time_block(plain, args.steps_per_block))
            times["loom"].append(time_block(loom_step, args.steps_per_block))
    tokens = args.batch * args.seq_len
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    # Adjacent blocks share the machine's state, so the ratio of each pair is the least noisy
    # comparison; the median over pairs is the headline.
    pair_ratios = [p / l for p, l in zip(times["plain"], times["loom"])]
    ratio = statistics.median(pair_ratios)
    result = {"tokens_per_step": tokens, "threads": args.threads, "block_step_times_s": times,
              "median_tokens_per_s": tps, "pair_ratios": pair_ratios,
              "ratio_loom_over_plain": ratio, "command": "python " + " ".join(sys.argv)}
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "single_rank.json").write_text(json.dumps(result, indent=2))
    _plot(times, tokens, ROOT / "docs" / "img" / "single_rank.png")
    print(f"plain PyTorch: {tps['plain']:,.0f} tokens/s   Loom: {tps['loom']:,.0f} tokens/s   "
          f"ratio Loom/plain (median of {len(pair_ratios)} adjacent pairs) = {ratio:.3f}")
    return 0


def _plot(times, tokens, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for name, color in (("plain", "#888888"), ("loom", "#3b6fb6")):
        ax.plot(range(1, len(times[name]) + 1), [tokens / t for t in times[name]], "o-",
                color=color, label=name)
    ax.set_xlabel("block (alternating plain / loom)")
    ax.set_ylabel("tokens/s")
    ax.set_title("One-process training step: Loom vs plain PyTorch (tiny model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
