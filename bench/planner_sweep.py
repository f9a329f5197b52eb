"""Loom's planner on a published layout sweep that includes the runs that ran out of memory.

Hagemann et al. 2023 ("Efficient Parallelization Layouts for Large-Scale Distributed Model
Training", arXiv 2311.05610) trained Llama 13B, 30B and 65B on up to 256 A100-80GB GPUs with
every combination of tensor and pipeline degree, microbatch size, activation checkpointing,
attention kernel and (in a second set) sequence parallelism, and published every run's step
time, or "OOM Error", in spreadsheets (github.com/JohannesHa/COLM-submission-efficient-
parallelization-layouts, data/*.xlsx, CC BY-NC-SA 4.0). Loom does not copy them: this script
reads them from a folder you give it (a clone of that repository), prices every cell's layout
with the cost model, and reports per spreadsheet (one model size and sequence length):

* the out-of-memory verdict against the published outcome (right / cells, and both error kinds),
* Spearman's rank correlation between predicted and published step time over the cells that
  ran, per spreadsheet, and between predicted and published throughput per GPU over every
  spreadsheet of one model size (the issue's target: >= 0.9 within each model size; pooling
  sheets of different sequence lengths and GPU counts widens the range ranked, so the
  per-sheet figure is the stricter one),

    git clone https://github.com/JohannesHa/COLM-submission-efficient-parallelization-layouts sweep
    python bench/planner_sweep.py sweep/data [--framework scaling|megatron] [--zero 1] \
        [--json out.json]

The sweep ran on Aleph Alpha's training codebase ("AA-Scaling"; its spreadsheets' columns are
that codebase's config names: ``model_parallel_size``, ``pipe_parallel_size``,
``activation_checkpointing_type``, "Average TFlops Aleph Alpha"), released in 2024 as
github.com/Aleph-Alpha/scaling. ``--framework scaling`` (the default) prices it with the
profile read from that release (``loom.sim.frameworks``: bf16 gradients, the eager block's
copies, the gathered logits, the allocator's reserve); ``--framework megatron`` is the
Megatron-LM profile this script priced first. The report splits the spreadsheets in two
(``TUNE``): the Scaling profile's terms were chosen looking at the tune half's cells only.

Mapping a cell to Loom (assumptions, not stated in the spreadsheets): Llama's published shapes
(SwiGLU, vocabulary 32,000, no dropout); sequence 2,048, or 8,192 for the files named "8k";
the global batch (``--global-batch``, default 2,048 sequences at 2k and 512 at 8k) only sets
the microbatch count, which moves the pipeline bubble; the optimizer state sharded over data
parallelism (``--zero 1``: Scaling's ``zero`` and Megatron's distributed optimizer; ``--zero
0``: replicated); "every_layer" checkpointing is Loom's full recomputation; the "torch" and
"fused" kernels store the attention probabilities (no flash kernel); pipelines run 1F1B
(Scaling's schedule is DeepSpeed's, which holds as many); the spreadsheets' "Kernel not
available" and "Other Error" cells are left out. A cell is judged out of memory when its
bytes pass the device's memory less the profile's ``allocator_reserve``. A100-80GB nodes of 8
with one 200 Gb/s HDR link per GPU. Nothing is fitted.

Reading .xlsx needs no third-party package: a sheet is XML in a zip archive.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import zipfile
import xml.etree.ElementTree as ET
from pathlib import Path

from loom.layout import Layout
from loom.models.layers import TransformerArgs
from loom.plan.hardware import make_cluster
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import framework

SHEET = "{http://schemas.openxmlformats.org/spreadsheetml/2006/main}"
# The half the Scaling profile's terms were chosen on (decided before any cell's error was
# looked at): the three 2k-sequence spreadsheets without sequence parallelism. The other seven
# (both 8k ones and the five with sequence parallelism) are held out.
TUNE = frozenset({"llama_13B_bfloat16_64_GPUs_all_runs.xlsx",
                  "llama_30B_bfloat16_256_GPUs_all_runs.xlsx",
                  "llama_65B_bfloat16_128_GPUs_all_runs.xlsx"})
# Llama (Touvron et al. 2023, Table 2) dims: hidden, layers, heads, SwiGLU width
LLAMA = {"13B": (5120, 40, 40, 13824), "30B": (6656, 60, 52, 17920), "65B": (8192, 80, 64, 22016)}
# the spreadsheets' kernels as the cost model prices them (``Framework.attention_kernel``):
# "torch" is PyTorch's attention written out (scale, mask and softmax kernels), "fused"
# Megatron's fused scale-mask-softmax; only the "+ RMS kernel" cells have a fused RMSNorm
KERNELS = {"torch": "unfused", "fused": "fused", "flash_attention": "flash1",
           "flash_attentionv1.0.8": "flash1", "flash_attention2": "flash2",
           "flash_attention2 + RMS kernel": "flash2"}


def read_sheet(path: Path) -> list[dict[str, str]]:
    """The first sheet of an .xlsx file as rows keyed by the header row (the sheet's second row:
    its first holds the file's title), strings as written."""
    with zipfile.ZipFile(path) as z:
        shared = []
        if "xl/sharedStrings.xml" in z.namelist():
            for item in ET.fromstring(z.read("xl/sharedStrings.xml")).iter(f"{SHEET}si"):
                shared.append("".join(t.text or "" for t in item.iter(f"{SHEET}t")))
        sheet = sorted(n for n in z.namelist() if re.fullmatch(r"xl/worksheets/sheet\d+\.xml", n))[0]
        root = ET.fromstring(z.read(sheet))
    table = []
    for row in root.iter(f"{SHEET}row"):
        cells = {}
        for cell in row.iter(f"{SHEET}c"):
            column = re.match(r"[A-Z]+", cell.get("r")).group()
            value = cell.find(f"{SHEET}v")
            inline = cell.find(f"{SHEET}is")
            if value is not None:
                cells[column] = shared[int(value.text)] if cell.get("t") == "s" else value.text
            elif inline is not None:
                cells[column] = "".join(t.text or "" for t in inline.iter(f"{SHEET}t"))
        table.append(cells)
    header = table[1]
    return [{header[c]: v for c, v in row.items() if c in header} for row in table[2:]]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def price(cell: dict[str, str], size: str, seq: int, batch: int, zero: int,
          stack_name: str = "megatron") -> dict:
    """One spreadsheet cell priced: predicted step and memory, and the published outcome."""
    h, layers, heads, ffn = LLAMA[size]
    model = TransformerArgs(dim=h, n_layers=layers, n_heads=heads, n_kv_heads=heads, ffn_dim=ffn,
                            vocab_size=32000, max_seq_len=seq, mlp="swiglu")
    world, tp = int(cell["World Size"]), int(cell["model_parallel_size"])
    pp, micro = int(cell["pipe_parallel_size"]), int(cell["micro_batch_size"])
    dp = world // (tp * pp)
    sharded = zero and dp > 1
    layout = Layout(pp=pp, tp=tp, dp_replicate=1 if sharded else dp, dp_shard=dp if sharded else 1,
                    zero_stage=zero if sharded else 0,
                    sequence_parallel=cell.get("sequence_parallel") == "1" and tp > 1,
                    schedule="1f1b" if pp > 1 else "none", micro_batch=micro,
                    microbatches=max(1, batch // (dp * micro)),
                    recompute="full" if cell["activation_checkpointing_type"] == "every_layer"
                    else "none")
    stack = dataclasses.replace(framework(stack_name), dropout=False,
                                attention_kernel=KERNELS[cell["kernel"]],
                                fused_norm="RMS kernel" in cell["kernel"])
    cluster = make_cluster("A100-80GB", world, 8, intra="nvlink3", inter="hdr-ib")
    cost = CostModel(model, seq, layout.dp * micro * layout.microbatches, cluster,
                     framework=stack).evaluate(layout)
    published = cell["Average Step Time"]
    return {"layout": layout.label(), "kernel": cell["kernel"],
            "predicted_step_s": cost.step_time, "memory_gib": cost.memory_total / 2**30,
            # the allocator's fragments (``Framework.allocator_reserve``) are not free to use
            "oom": cost.memory_total > (1 - stack.allocator_reserve) * cluster.gpu.memory_bytes,
            "published_oom": published == "OOM Error",
            "published_step_s": None if published == "OOM Error" else float(published)}


def score(path: Path, batch: dict[int, int], zero: int, stack_name: str = "megatron") -> dict:
    """Every usable cell of one spreadsheet priced, and the sheet's two scores."""
    size = re.search(r"llama_(\d+B)", path.name).group(1)
    seq = 8192 if "8k" in path.name else 2048
    cells = []
    for cell in read_sheet(path):
        outcome = cell.get("Average Step Time")
        if outcome != "OOM Error" and not re.fullmatch(r"[\d.]+", outcome or ""):
            continue  # "Kernel not available", "Other Error"
        cells.append(price(cell, size, seq, batch[seq], zero, stack_name))
    ran = [c for c in cells if not c["published_oom"]]
    gpus = int(re.search(r"_(\d+)_GPUs", path.name).group(1))
    return {"sheet": path.name, "model": size, "seq": seq, "cells": len(cells),
            "gpus": gpus, "tokens": batch[seq] * seq,
            "half": "tune" if path.name in TUNE else "holdout",
            "oom_right": sum(c["oom"] == c["published_oom"] for c in cells),
            "ran_judged_oom": sum(c["oom"] for c in ran),
            "oom_judged_to_fit": sum(not c["oom"] for c in cells if c["published_oom"]),
            "ran": len(ran),
            "spearman": spearman([c["predicted_step_s"] for c in ran],
                                 [c["published_step_s"] for c in ran]) if len(ran) > 2 else None,
            "rows": cells}


def throughput_per_gpu(sheet: dict, cell: dict, published: bool) -> float:
    """A cell's tokens per second per GPU, published or predicted: its global batch of tokens
    (``sheet["tokens"]``) over the step, over the sheet's GPUs."""
    step = cell["published_step_s"] if published else cell["predicted_step_s"]
    return sheet["tokens"] / step / sheet["gpus"]


def spearman_by_model(results: list[dict]) -> list[tuple[str, str, int, float]]:
    """(model, half, cells that ran, Spearman of predicted against published throughput per
    GPU) over every spreadsheet of each model size, for the tune half, the held-out half and
    both."""
    out = []
    for size in sorted({r["model"] for r in results}, key=lambda m: int(m[:-1])):
        for half in ("tune", "holdout", "all"):
            pairs = [(throughput_per_gpu(r, c, False), throughput_per_gpu(r, c, True))
                     for r in results if r["model"] == size and half in ("all", r["half"])
                     for c in r["rows"] if c["published_step_s"]]
            if len(pairs) > 2:
                out.append((size, half, len(pairs),
                            spearman([p for p, _ in pairs], [q for _, q in pairs])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, help="the repository's data/ folder (.xlsx files)")
    parser.add_argument("--zero", type=int, choices=(0, 1), default=1,
                        help="optimizer state sharded over data parallelism (1) or not (0)")
    parser.add_argument("--global-batch", default="2048,512", metavar="AT_2K,AT_8K",
                        help="global batch in sequences at 2k and at 8k tokens")
    parser.add_argument("--framework", choices=("megatron", "scaling"), default="scaling",
                        help="the profile priced (loom.sim.frameworks): Aleph Alpha's Scaling,"
                        " the stack the sweep ran (default), or Megatron-LM's")
    parser.add_argument("--json", type=Path, help="also write every priced cell here")
    args = parser.parse_args(argv)
    at2k, at8k = (int(b) for b in args.global_batch.split(","))
    sheets = sorted(args.data.rglob("llama_*.xlsx"))
    if not sheets:
        print(f"{args.data}: no llama_*.xlsx spreadsheets", file=sys.stderr)
        return 2
    results = [score(p, {2048: at2k, 8192: at8k}, args.zero, args.framework) for p in sheets]
    print("| spreadsheet | half | model | seq | cells | OOM verdict right | ran, judged OOM |"
          " OOM, judged to fit | Spearman (step, cells that ran) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rho = f"{r['spearman']:.2f} ({r['ran']})" if r["spearman"] is not None else "-"
        print(f"| {r['sheet']} | {r['half']} | {r['model']} | {r['seq']} | {r['cells']} |"
              f" {r['oom_right']} ({r['oom_right'] / r['cells']:.0%}) | {r['ran_judged_oom']} |"
              f" {r['oom_judged_to_fit']} | {rho} |")
    print()
    for half in ("tune", "holdout", "all"):
        part = [r for r in results if half in ("all", r["half"])]
        cells = sum(r["cells"] for r in part)
        right = sum(r["oom_right"] for r in part)
        print(f"{half}: OOM verdict right on {right} of {cells} cells ({right / cells:.1%}),"
              f" {sum(r['ran_judged_oom'] for r in part)} runs judged OOM,"
              f" {sum(r['oom_judged_to_fit'] for r in part)} OOM cells judged to fit")
    print(f"--framework {args.framework}, --zero {args.zero}, --global-batch {args.global_batch}")
    print("\n| model | half | cells that ran |"
          " Spearman (tokens/s per GPU, every sheet of the size) |")
    print("|---|---|---|---|")
    for size, half, ran, rho in spearman_by_model(results):
        print(f"| {size} | {half} | {ran} | {rho:.2f} |")
    ratios: dict[tuple[int, str], list[float]] = {}  # published / predicted step, by kernel
    for r in results:
        for c in r["rows"]:
            if c["published_step_s"]:
                ratios.setdefault((r["seq"], c["kernel"]), []).append(
                    c["published_step_s"] / c["predicted_step_s"])
    print("\n| seq | kernel | cells that ran | median published / predicted step |")
    print("|---|---|---|---|")
    for (seq, kernel), values in sorted(ratios.items()):
        print(f"| {seq} | {kernel} | {len(values)} | {statistics.median(values):.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
