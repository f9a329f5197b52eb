"""MFU, tokens/s and memory of a Llama-3-8B-shaped model on one GPU, against TorchTitan's published
figures and Loom's own memory estimator.

    python bench/gpu.py                      # every variant; bench/out/gpu.json and a table
    python bench/gpu.py --layers 2 --steps 6 # smaller and shorter (a quick look)

The model is Llama 3 8B's shape (dim 4096, 32 heads, 8 KV heads, FFN 14336, vocabulary 128,256,
RoPE theta 500,000) with fewer layers (``--layers``, default 4) so that it trains on one GPU
without sharding. Variants run ``train.dtype = bf16`` (bf16 parameters and gradients, fp32
master weights and Adam moments: 14 bytes per parameter, about 27 GB at 4 layers) unless named
otherwise: ``bf16-autocast`` is fp32 parameters, gradients and moments (16 bytes) under bf16
autocast, the mode the first recorded H200 numbers were measured in. The FP8 variants
(``train.fp8``, torchao's float8 training; compiled, as TorchTitan runs it) need a GPU with FP8
matmuls; with ``--device cpu`` (a smoke run) they are emulated. Each variant is one
``loom train --nproc 1`` on the standard-library corpus (byte tokens) at sequence length 8192,
global batch 2 sequences (TorchTitan's local batch per GPU) as 2 microbatches of 1. Reported per
variant: the median tokens/s and MFU over the steps after the first ``--warmup`` (Loom's own
accounting: 6 x parameters + attention FLOPs per token, against the catalog's dense BF16 peak),
the allocator's peak, ``estimate_memory``'s prediction of that peak, and the planner's predicted
step time (``CostModel`` on a one-GPU cluster of the catalog part the device names, the layout the
run's config trains under, eager or compiled as its ``train.compile``, searched at nothing:
``loom plan``'s pricing of exactly this run) over
the measured median step (issue 21: how the planner does on a machine it was never tuned on; the
fp32 variant has none, the planner prices bf16 matmuls).

TorchTitan's published reference (docs/performance.md of pytorch/torchtitan): Llama 3.1 8B on
8 H100s (500 W), FSDP, local batch 2, sequence 8192, selective activation checkpointing: 5,762
tokens/s per GPU eager (6,667 compiled), "33% to 39% MFU" (compiled or not). That model has 32
layers and 8 GPUs, this one 4 layers on one: MFU is the comparable figure; "tokens/s at 32
layers" rescales the measured rate by the FLOPs per token of the two depths (what this run's MFU
would give on the full model) and is a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom.config import layout_of, load_config, model_args, resolve  # noqa: E402
from loom.formulas.flops import model_flops_per_token  # noqa: E402
from loom.models.presets import PRESETS  # noqa: E402
from loom.plan.hardware import GPUS, make_cluster  # noqa: E402
from loom.plan.search import simulate_step  # noqa: E402
from loom.sim.cost_model import CostModel  # noqa: E402
from loom.sim.frameworks import LOOM  # noqa: E402
from loom.train.memory import GiB, estimate_memory  # noqa: E402

TORCHTITAN = {"tokens_per_s_per_gpu_eager": 5762, "tokens_per_s_per_gpu_compiled": 6667,
              "mfu_range": "33%-39%", "memory_gib": 82.4,
              "setup": "Llama 3.1 8B, 8 H100 (500 W), FSDP, local batch 2, seq 8192, selective AC"}
VARIANTS = {  # name: extra overrides of the bf16 base
    "bf16": {},
    "bf16-autocast": {"train.dtype": "bf16_autocast"},
    "bf16-selective-recompute": {"train.recompute": "selective"},
    "bf16-full-recompute": {"train.recompute": "full"},
    "fp32": {"train.dtype": "fp32"},  # MFU n/a: the catalog's peak is BF16's
    "bf16-compile": {"train.compile": True},
    "fp8-tensorwise": {"train.fp8": "tensorwise"},
    "fp8-rowwise": {"train.fp8": "rowwise"},
    "fp8-tensorwise-compile": {"train.compile": True, "train.fp8": "tensorwise"},
    "fp8-rowwise-compile": {"train.compile": True, "train.fp8": "rowwise"},
}


def overrides(preset: str, layers: int, seq_len: int, steps: int,
              device: str) -> dict[str, object]:
    vocab = PRESETS[preset].vocab_size
    return {"model.preset": preset, "model.n_layers": layers, "model.vocab_size": vocab,
            "data.seq_len": seq_len, "data.max_bytes": 4 * seq_len * (2 * steps + 8),
            "data.extensions": ".py", "train.steps": steps, "train.global_batch_size": 2,
            "train.micro_batch_size": 1, "train.dtype": "bf16", "train.device": device,
            "train.eval_every": 0, "optim.warmup_steps": 2, "metrics.progress": False,
            "train.skip_memory_check": True}


def catalog_part(device_name: str) -> str | None:
    """The planner's catalog part a CUDA device name is ("NVIDIA H100 80GB HBM3" -> H100-SXM)."""
    name = device_name.upper()
    for key, part in (("H200", "H200"), ("H100 PCIE", "H100-PCIe"), ("H100 NVL", "H100-NVL"),
                      ("H100", "H100-SXM"), ("A100-SXM4-40GB", "A100-40GB"), ("A100", "A100-80GB"),
                      ("B200", "B200")):
        if key in name:
            return part if part in GPUS else None
    return None


def predicted_step_s(config, part: str | None) -> float | None:
    """The planner's step time for the run ``config`` describes on one ``part`` (None: no part,
    or an fp32 run, which the planner does not price)."""
    if part is None or config.train.dtype == "fp32":
        return None
    cluster = make_cluster(part, 1)
    stack = LOOM.compiled_as(bool(config.train.compile))  # eager or compiled blocks
    model = CostModel(model_args(config), config.data.seq_len, config.train.global_batch_size,
                      cluster, fp8=config.train.fp8, framework=stack)
    layout = layout_of(config)
    return simulate_step(model, model.evaluate(layout)).step_time


def run_variant(name: str, table: dict[str, object], workdir: Path, warmup: int,
                part: str | None = None) -> dict:
    run_dir = workdir / name
    args = [f"--{key}={value}" for key, value in table.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "loom", "train", "--nproc", "1",
                           f"--train.run_dir={run_dir}", *args], cwd=workdir, env=env, text=True,
                          capture_output=True, timeout=900)
    wall = time.monotonic() - started
    if done.returncode != 0:
        return {"variant": name, "error": done.stderr[-2000:], "wall_s": wall}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    every_step = [row for row in rows if "tokens_per_s" in row]
    steps = every_step[warmup:]
    config = resolve(load_config(None, table), 1)
    estimate = estimate_memory(config)
    peak = max(row["peak_mem_bytes"] for row in steps)
    step_time = statistics.median(row["step_time_s"] for row in steps)
    predicted = predicted_step_s(config, part)
    return {"variant": name, "steps_timed": len(steps), "wall_s": round(wall, 1),
            "tokens_per_s": statistics.median(row["tokens_per_s"] for row in steps),
            "mfu": statistics.median(row["mfu"] for row in steps) if steps[0].get("mfu") else None,
            "step_time_s": step_time, "planner_part": part, "predicted_step_s": predicted,
            "predicted_over_measured": None if predicted is None else predicted / step_time,
            "peak_mem_gib": peak / GiB, "estimated_peak_gib": estimate.total / GiB,
            "estimate_over_measured": estimate.total / peak,
            "final_loss": steps[-1]["loss"], "losses": [row["loss"] for row in every_step]}


# Run 4's measured median step seconds (H100 80GB HBM3, docs/benchmarks.md "Run 4"): what
# ``--reestimate-run4`` divides the planner's prediction by, with no GPU needed
RUN4_STEP_S = (("bf16", 8192, 0.359), ("bf16-compile", 8192, 0.313),
               ("fp8-tensorwise-compile", 8192, 0.289), ("bf16", 2048, 0.124))


def reestimate_run4() -> None:
    """Print the planner's predicted step for run 4's rows against their measured steps (the
    tables of docs/planner.md "Against the H100 (run 4)" come from this)."""
    for name, seq_len, measured in RUN4_STEP_S:
        table = {**overrides("llama3-8b", 4, seq_len, 10, "cuda"), **VARIANTS[name]}
        predicted = predicted_step_s(resolve(load_config(None, table), 1), "H100-SXM")
        print(f"{name:<24} seq {seq_len:>5}  measured {measured:.3f} s  predicted"
              f" {predicted:.3f} s  predicted/measured {predicted / measured:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reestimate-run4", action="store_true",
                        help="print the planner's prediction of run 4's steps and exit (no GPU)")
    parser.add_argument("--preset", default="llama3-8b", help="model shape (tiny: a CPU smoke run)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of medians")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "gpu.json"))
    args = parser.parse_args()
    if args.reestimate_run4:
        return reestimate_run4()
    import torch  # the GPU's name only; the runs are subprocesses

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    table = overrides(args.preset, args.layers, args.seq_len, args.steps, args.device)
    shape = model_args(resolve(load_config(None, table), 1))
    full = model_args(resolve(load_config(None, {**table, "model.n_layers": 32}), 1))
    depth_ratio = (model_flops_per_token(shape, args.seq_len)
                   / model_flops_per_token(full, args.seq_len))
    results = []
    with tempfile.TemporaryDirectory(prefix="loom-gpu-bench-") as tmp:
        for name in args.variants.split(","):
            variant = {**table, **VARIANTS[name]}
            if "train.fp8" in variant and args.device == "cpu":
                variant["train.fp8_emulate"] = True  # a smoke run: no FP8 matmuls on a CPU
            result = run_variant(name, variant, Path(tmp), args.warmup, catalog_part(device))
            if "tokens_per_s" in result:
                result["tokens_per_s_at_32_layers"] = result["tokens_per_s"] * depth_ratio
            results.append(result)
            print(json.dumps(result), flush=True)
    report = {"device": device, "torch": torch.__version__, "preset": args.preset,
              "layers": args.layers,
              "seq_len": args.seq_len, "torchtitan": TORCHTITAN, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n{device}, torch {torch.__version__}, {args.preset} shape with {args.layers} layers,"
          f" seq {args.seq_len}, batch 2 x 1")
    print(f"{'variant':<26} {'tok/s':>8} {'MFU':>6} {'tok/s@32L':>10} {'peak GiB':>9}"
          f" {'est GiB':>8} {'est/peak':>8} {'step s':>7} {'plan s':>7} {'plan/step':>9}"
          f" {'loss':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<26} failed: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        plan = "n/a" if r["predicted_step_s"] is None else f"{r['predicted_step_s']:.3f}"
        ratio = "n/a" if r["predicted_step_s"] is None else f"{r['predicted_over_measured']:.2f}"
        print(f"{r['variant']:<26} {r['tokens_per_s']:8.0f} {mfu:>6}"
              f" {r['tokens_per_s_at_32_layers']:10.0f} {r['peak_mem_gib']:9.1f}"
              f" {r['estimated_peak_gib']:8.1f} {r['estimate_over_measured']:8.2f}"
              f" {r['step_time_s']:7.3f} {plan:>7} {ratio:>9} {r['final_loss']:7.4f}")
    print(f"TorchTitan: {TORCHTITAN['setup']}: {TORCHTITAN['tokens_per_s_per_gpu_eager']} tok/s"
          f" per GPU eager, MFU {TORCHTITAN['mfu_range']}")


if __name__ == "__main__":
    main()
