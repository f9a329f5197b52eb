"""Benchmark: activation memory per transformer layer (bytes saved for backward) for no TP, TP and
TP + SP, measured with saved-tensor hooks, against Korthikanti et al. 2022 adjusted to Loom's block.

Measurement: one forward of a ``Transformer`` under ``torch.autograd.graph.saved_tensors_hooks``;
each saved tensor is attributed to the innermost module running when it was saved (forward
pre/post hooks keep the stack) and counted once per storage (``wq``, ``wk`` and ``wv`` all save the
same input); parameters and buffers (RoPE tables) are not activations and are skipped. DTensors
are counted by their local shard. Layer 1 of 3 is reported (layer 0's input is the embedding's).

    python bench/activation_memory.py [--tp 2] [--seq 256] [--batch 2] [--dim 256]

Writes ``bench/out/activation_memory.json``; the derivation and results are in
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from loom.models import Transformer, TransformerArgs, reset_parameters  # noqa: E402

LAYER = "layers.1"


def measure(model: nn.Module, tokens: torch.Tensor, savers: list = ()) -> dict[str, int]:
    """Bytes saved for backward during one forward, by innermost module name, layer ``LAYER``."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    skip = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {local(b).untyped_storage().data_ptr() for b in model.buffers()}
    stack: list[str] = []
    seen: set[int] = set()
    by_module: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor):
        storage = local(t).untyped_storage()
        where = stack[-1] if stack else ""
        if where.startswith(LAYER) and storage.data_ptr() not in skip | seen:
            seen.add(storage.data_ptr())
            by_module[where[len(LAYER) + 1:] or "block"] += storage.nbytes()
        return t

    def enter(name: str):
        return lambda module, args: stack.append(name)  # returns None: inputs unchanged

    def leave(module, args, output) -> None:
        stack.pop()

    for saver in savers:  # what passes through the SP hooks untouched is counted here too
        saver.observe = pack
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    for h in handles:
        h.remove()
    return dict(by_module)


def loom_formula(*, s: int, b: int, h: int, a: int, k: int, f: int, t: int, sp: bool,
                 e: int = 4) -> dict[str, float]:
    """Loom's block (RMSNorm, GQA + RoPE, CPU SDPA, SwiGLU, no dropout), bytes per layer.

    Elements saved (x = s·b·h; e bytes per activation element; rstd and logsumexp are fp32):
      each RMSNorm: its input x and rstd s·b (``loom.models.norm``: the normalised x is
      recomputed in backward); its output is saved as the q/k/v (w1/w3) linear input;
      attention: RoPE saves only cos/sin (buffers: its inputs need no saving for a constant
        factor); SDPA (CPU flash kernel) saves q after RoPE, k and v after the GQA repeat (so
        x each, not x·k/a) and its output x, plus logsumexp a·s·b — no s² softmax, no dropout;
        wo's input is a view of the SDPA output (counted once);
      MLP: w1 and w3 outputs 2·s·b·f, the silu output s·b·f, their product (w2 input) s·b·f.
    TP divides everything inside the blocks by t (heads, f); without SP the norms' inputs/outputs
    are full on every rank. With SP the norm inputs are 1/t, and the column-parallel linears'
    all-gathered input is saved as this rank's slice and gathered again in backward
    (``loom.parallel.sequence_saved``, as Megatron-SP does), so everything is 1/t.
    """
    x = s * b * h
    norm_in = x / t if sp else x
    norms = 2 * (norm_in * e + s * b * 4 / (t if sp else 1))
    linear_inputs = 2 * x * e / (t if sp else 1)  # norm outputs: the q/k/v and w1/w3 input
    attention = (4 * x / t) * e + a * s * b * 4 / t
    mlp = 4 * s * b * f / t * e
    return {"norms": norms, "linear_inputs": linear_inputs, "attention": attention, "mlp": mlp,
            "total": norms + linear_inputs + attention + mlp}


def korthikanti(*, s: int, b: int, h: int, a: int, t: int, sp: bool) -> float:
    """Table 2 of Korthikanti et al. 2022 (GPT block, 16-bit, dropout, stored softmax)."""
    if sp:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    if t > 1:
        return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    return s * b * h * (34 + 5 * a * s / h)


def tp_measure(ctx, args: TransformerArgs, batch: int, sp: bool, seed: int) -> dict[str, int]:
    """On every rank of a pool: the layer's saved bytes under TP (and SP) over all ranks."""
    from loom.parallel.sequence_saved import keep_saved_inputs_sharded
    from loom.parallel.tensor import apply_tensor_parallel
    from loom.topology import RankGrid, build_mesh

    torch.manual_seed(seed)
    model = Transformer(args)
    reset_parameters(model, seed)
    mesh = build_mesh(RankGrid({"tp": ctx.world_size}), "cpu").root["tp"]
    apply_tensor_parallel(model, mesh, sequence_parallel=sp, vocab_parallel=False)
    # As ``parallelize`` does under SP: the linears' gathered inputs are saved as this rank's
    # slice by hooks of their own, which the measuring hooks (outer) do not see: add what they hold.
    savers = keep_saved_inputs_sharded(model.layers.values(), mesh) if sp else []
    tokens = torch.randint(0, args.vocab_size, (batch, args.max_seq_len),
                           generator=torch.Generator().manual_seed(seed))
    by_module = measure(model, tokens, savers)
    layer = int(LAYER.split(".")[1])
    for part, saver in zip(("attention", "feed_forward"), savers[2 * layer:2 * layer + 2]):
        by_module[part + " (sharded inputs)"] = saver.held_bytes
    return by_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "activation_memory.json"))
    opts = parser.parse_args()
    args = TransformerArgs(dim=opts.dim, n_layers=3, n_heads=opts.heads, n_kv_heads=opts.kv_heads,
                           ffn_dim=3 * opts.dim, vocab_size=512, max_seq_len=opts.seq)
    shape = dict(s=opts.seq, b=opts.batch, h=opts.dim, a=opts.heads, k=opts.kv_heads,
                 f=args.ffn_dim)
    model = Transformer(args)
    reset_parameters(model, 0)
    tokens = torch.randint(0, args.vocab_size, (opts.batch, opts.seq))
    runs = [("none", 1, False, measure(model, tokens))]

    from loom.testing.harness import PoolRegistry

    registry = PoolRegistry()
    try:
        for t in opts.tp:
            for sp in (False, True):
                per_rank = registry.run(t, tp_measure, args, opts.batch, sp, 0)
                assert all(r == per_rank[0] for r in per_rank), per_rank  # symmetric layout
                runs.append(("tp+sp" if sp else "tp", t, sp, per_rank[0]))
    finally:
        registry.close()

    rows = []
    sbh = opts.seq * opts.batch * opts.dim
    print(f"shape {shape}; per layer, per rank; x = s*b*h = {sbh} elements")
    print(f"{'layout':8} {'t':>2} {'measured':>12} {'Loom formula':>13} {'ratio':>6}"
          f" {'Korthikanti (16-bit GPT)':>25}")
    for name, t, sp, by_module in runs:
        measured = sum(by_module.values())
        formula = loom_formula(**shape, t=t, sp=sp)
        paper = korthikanti(s=opts.seq, b=opts.batch, h=opts.dim, a=opts.heads, t=t, sp=sp)
        rows.append({"layout": name, "t": t, "measured_bytes": measured,
                     "formula_bytes": formula["total"], "ratio": measured / formula["total"],
                     "formula_parts": formula, "korthikanti_bytes": paper,
                     "by_module": by_module})
        print(f"{name:8} {t:>2} {measured:>12,} {formula['total']:>13,.0f}"
              f" {measured / formula['total']:>6.3f} {paper:>25,.0f}")
    # issue 20: bf16 activations against fp32's at the same layout (no TP). ``bf16`` is
    # train.dtype = bf16 (the model's parameters in bf16), ``bf16_autocast`` fp32 parameters
    # under autocast (the linears' outputs bf16, norms and the residual stream fp32)
    fp32 = sum(runs[0][3].values())
    bf16_model = Transformer(args)
    reset_parameters(bf16_model, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = sum(measure(model, tokens).values())
    bf16 = sum(measure(bf16_model.to(torch.bfloat16), tokens).values())
    formula = loom_formula(**shape, t=1, sp=False, e=2)["total"]
    dtypes = {"fp32": fp32, "bf16_autocast": autocast, "bf16": bf16, "bf16_formula": formula}
    print(f"per layer, no TP: fp32 {fp32:,}; bf16_autocast {autocast:,} ({autocast / fp32:.3f}x);"
          f" bf16 {bf16:,} ({bf16 / fp32:.3f}x; Loom formula at e = 2: {formula:,.0f})")
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({"shape": shape, "rows": rows, "dtypes": dtypes},
                                         indent=1))


if __name__ == "__main__":
    main()
