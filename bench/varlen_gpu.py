"""GPU check of ``data.packing = varlen`` microbatches: the document-attention kernels on rows
``[1, T]`` of many lengths, one process, the ``tiny`` model in fp32.

For the same varlen steps (synthetic log-normal document lengths, median 64 tokens, split
length 512, microbatches of 2048 predictions, 4 per step) it runs forward + backward with the
``flex`` kernel (FlexAttention, compiled, a ``BlockMask`` per microbatch: the CUDA default) and
with ``segments`` (SDPA per piece), and compares the loss and every gradient of the first step;
then it times every step of each kernel (a varlen microbatch has a new length almost every time,
which is what a kernel compiled for static shapes pays for), and a ``concat`` step of the same
tokens (4 microbatches of 4 x 512) through the plain model.

    python bench/varlen_gpu.py [--steps 12]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from loom.data.loader import GlobalBatchSampler  # noqa: E402
from loom.data.packing import offsets_from_eos  # noqa: E402
from loom.data.varlen import VarlenDocuments, VarlenLoader  # noqa: E402
from loom.models import build_model, document_attention, preset, reset_parameters  # noqa: E402

ORIGINAL = document_attention.DocumentMask.attention


def use_kernel(kernel: str) -> None:
    """Every ``DocumentMask.attention`` call of the model takes ``kernel`` (the layers call it
    with the default ``auto``)."""
    document_attention.DocumentMask.attention = functools.partialmethod(ORIGINAL, kernel=kernel)


def varlen_step(model, batch) -> float:
    model.zero_grad(set_to_none=True)
    tokens = sum(mb.targets.numel() for mb in batch.microbatches)
    total = 0.0
    for mb in batch.microbatches:
        logits = model(mb.inputs, positions=mb.positions, document_ids=mb.document_ids)
        loss = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="sum")
        (loss / tokens).backward()
        total += loss.item()
    return total / tokens


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    model = build_model(preset("tiny"), device=device)
    reset_parameters(model, seed=0)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(64), 1.0, 20_000), 2, 2048).astype(np.int64)
    eos = 300
    tokens = rng.integers(0, eos, int(lengths.sum())).astype(np.int64)
    tokens[np.cumsum(lengths) - 1] = eos
    data = VarlenDocuments(tokens, offsets_from_eos(tokens, eos), 512)
    loader = VarlenLoader(data, GlobalBatchSampler(len(data), 1, seed=1), 8192, 2048)
    steps = [loader.next_batch().to(device) for _ in range(args.steps)]
    print("microbatch lengths:", [[mb.inputs.shape[1] for mb in s.microbatches]
                                  for s in steps[:3]], flush=True)

    grads = {}
    for kernel in ("segments", "flex"):
        use_kernel(kernel)
        loss = varlen_step(model, steps[0])
        grads[kernel] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
    (ls, gs), (lf, gf) = grads["segments"], grads["flex"]
    worst = max(((gf[n] - gs[n]).abs().max() / gs[n].abs().max().clamp(min=1e-12)).item()
                for n in gs)
    print(f"first step: loss segments {ls:.6f} flex {lf:.6f} (rel {abs(lf - ls) / ls:.2e});"
          f" worst gradient max-abs difference / max-abs {worst:.2e}", flush=True)

    for kernel in ("segments", "flex"):
        use_kernel(kernel)
        times = [timed(lambda s=s: varlen_step(model, s)) for s in steps]
        print(f"{kernel:8s} step ms: {' '.join(f'{1e3 * t:.0f}' for t in times)}", flush=True)
    x = torch.randint(0, eos, (4, 4, 513), device=device)

    def concat_step() -> None:
        model.zero_grad(set_to_none=True)
        for rows in x:
            logits = model(rows[:, :-1])
            (F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()) / 4).backward()
    times = [timed(concat_step) for _ in range(args.steps)]
    print(f"concat   step ms: {' '.join(f'{1e3 * t:.0f}' for t in times)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
