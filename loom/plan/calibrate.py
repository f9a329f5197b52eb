"""The planner's side of calibration: what is measured, how it is fitted, the stored profile.

``loom plan --calibrate`` runs ``loom.calibration.measure`` (which uses the trainer, so it lives
above the planner) and hands its raw measurements to ``write_profile`` here, which fits them and
stores the profile; ``loom plan --gpu local`` only reads that profile (``load_profile``). What the
measurement takes:

* on rank 0 alone, while the others wait (so on a core of its own): matmul throughput at several
  shapes whose smallest dimension d runs from 16 to 512, fitted to the cost model's
  ``rate(d) = R · d / (d + knee)`` by least squares on ``1/rate = 1/R + (knee/R) · 1/d``; memory
  bandwidth, from copying a 64 MiB buffer (read + write); and the fixed cost of one
  transformer-block pass, from forward + backward of Loom's own block at a size where its FLOPs
  are negligible (a third of it is charged to each of F, I and W); and one AdamW step, per
  parameter (torch's multi-tensor AdamW makes several passes over each state, about twice the
  time of the 28 bytes per parameter a fused kernel moves);
* the cores the processes share (their CPU affinity): with more ranks than cores the cost model
  slows compute by ranks / cores when all ranks compute, and the pipeline simulation shares the
  cores among the ranks busy at each instant;
* on every rank at once, collective latency and bandwidth on gloo: all-reduces of 4 KiB to
  4 MiB, fitted to the ring's ``2(n-1)·alpha + 2(n-1)/n · M / beta``;
* on every rank at once, the framework work of each parallel wrapper (``probes.py``): a small
  probe model trained by Loom's trainer under each wrapper, all stepped in one rotation, and
  what the cost model does not explain of its step charged to that wrapper.

The fit: matmul rates to the cost model's ``rate(d) = R · d / (d + knee)`` by least squares on
``1/rate = 1/R + (knee/R) · 1/d``; all-reduce times to the ring's
``2(n-1)·alpha + 2(n-1)/n · M / beta``; Loom's block times to one factor over the cost model's
layer time (``layer_scale``); the probes to each wrapper's framework work (``probes``).

The profile (JSON) becomes the catalog entries ``local-cpu`` (a ``Gpu`` with the measured R as
its peak and efficiency 1) and ``local`` (a ``Link``), which ``loom plan --gpu local`` uses.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from loom.errors import InputFileError, read_input_json
from loom.layout import Layout
from loom.models.args import TransformerArgs
from loom.plan.hardware import Cluster, Gpu, HardwareError, Link
from loom.plan.probes import fit_framework
from loom.sim.cost_model import CostModel

DEFAULT_PROFILE = Path.home() / ".cache" / "loom" / "local.json"
SMALLEST_DIMS = (16, 32, 64, 128, 256, 512)
ALLREDUCE_BYTES = (4096, 65536, 262144, 1048576, 4194304)


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


# Loom blocks timed alone (dim, ffn, heads, kv heads, seq, micro-batch): the cost model's layer
# time is fitted to them with one factor (``fit``); the first is the tiny block whose FLOPs are
# negligible (the fixed cost per layer pass).
BLOCKS = ((8, 16, 2, 1, 4, 1), (128, 384, 8, 4, 128, 2), (256, 768, 8, 4, 256, 2),
          (512, 1536, 8, 4, 256, 2))


OPTIMIZER_PARAMS = 2 ** 21  # the AdamW probe: 8 MiB of fp32 parameters, past the caches


def fit(raw: dict, nproc: int, *, cores_shared: float = 0.0) -> tuple[Gpu, Link]:
    """The profile's ``Gpu`` and ``Link`` from ``measure``'s output: compute from the rank that
    measured it alone, collectives as medians over ranks, then the wrappers' framework work
    (when probed) against the cost model with those."""
    ranks = list(raw.values())
    alone = next(r for r in ranks if "matmul" in r)
    dims = [int(d) for d in alone["matmul"]]
    rates = [alone["matmul"][str(d)] if str(d) in alone["matmul"] else alone["matmul"][d]
             for d in dims]
    intercept, slope = _fit_line([1 / d for d in dims], [1 / r for r in rates])
    peak = 1 / intercept if intercept > 0 else max(rates)
    knee = max(slope * peak, 1e-3)
    bandwidth = alone["memory_bandwidth"]
    block = alone["block_pass"]
    sizes = [int(s) for s in ranks[0]["allreduce"]]
    times = [statistics.median(r["allreduce"][str(s)] if str(s) in r["allreduce"]
                               else r["allreduce"][s] for r in ranks) for s in sizes]
    a, b = _fit_line([float(s) for s in sizes], times)
    n = max(nproc, 2)
    latency = max(a / (2 * (n - 1)), 1e-7)
    beta = 2 * (n - 1) / n / b if b > 0 else 1e12
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(nproc, 1)
    gpu = Gpu("local-cpu", peak_flops=peak, memory_bytes=memory, hbm_bandwidth=bandwidth,
              matmul_efficiency=1.0, matmul_knee=knee, intra="local", inter="local",
              gpus_per_node=nproc, op_overhead=block / 3, cores=cores_shared,
              optimizer_per_param=alone.get("optimizer_per_param", 0.0))
    link = Link("local", bandwidth=beta, latency=latency, efficiency=1.0)
    scale = layer_scale(gpu, link, alone.get("blocks", [])[1:])
    gpu = replace(gpu, peak_flops=gpu.peak_flops / scale, hbm_bandwidth=gpu.hbm_bandwidth / scale)
    if "probes" in ranks[0]:
        gpu = replace(gpu, framework=fit_framework(ranks[0]["probes"], gpu, link, nproc))
    return gpu, link


def layer_scale(gpu: Gpu, link: Link, blocks: list) -> float:
    """The factor by which Loom's blocks, measured alone, take longer than the cost model's
    layer time from the matmul curve and the bandwidth (the geometric mean of measured minus the
    fixed per-pass cost over the priced FLOP and byte time, so every size weighs the same in
    relative terms; a plain least-squares fit would follow the largest block; 1 without
    measurements). It stands for what the curve misses on this machine: the attention kernel,
    norms and activations are slower than their matmul FLOPs and bytes suggest."""
    priced, measured = [], []
    plain = replace(gpu, op_overhead=0.0, cores=0.0, framework=())
    for dim, ffn, heads, kv, seq, micro, seconds in blocks:
        args = TransformerArgs(dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                               vocab_size=8, max_seq_len=seq)
        model = CostModel(args, seq, micro, Cluster(plain, 1, 1, link, link), dtype_bytes=4)
        f, i, w, _ = model._layer_times(Layout(micro_batch=micro), False)
        priced.append(f + i + w)
        measured.append(seconds - 3 * gpu.op_overhead)
    ratios = [m / p for p, m in zip(priced, measured) if p > 0 and m > 0]
    if not ratios:
        return 1.0
    return math.exp(statistics.fmean(math.log(r) for r in ratios))


def write_profile(raw: dict, nproc: int, path: str | Path | None = None, *,
                  cores_shared: float = 0.0) -> Path:
    """Fit ``raw`` (``loom.calibration.measure.measure``'s output) and store the profile, with
    the raw measurements beside the fit; a temporary file and an atomic rename, so a failed run
    leaves the old profile. Returns its path."""
    gpu, link = fit(raw, nproc, cores_shared=cores_shared)
    target = Path(path) if path else DEFAULT_PROFILE
    target.parent.mkdir(parents=True, exist_ok=True)
    profile = {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "nproc": nproc, "gpu": _as_dict(gpu), "link": _as_dict(link), "raw": raw}
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(target)
    return target


def describe(gpu: Gpu, link: Link) -> str:
    """A few lines a person can check: rates, cores, the link and each wrapper's work."""
    lines = [f"matmul {gpu.peak_flops * gpu.matmul_efficiency / 1e9:.1f} GFLOP/s per rank alone"
             f" (knee {gpu.matmul_knee:.1f}), memory {gpu.hbm_bandwidth / 1e9:.1f} GB/s,"
             f" {gpu.op_overhead * 1e6:.0f} us per layer pass",
             f"{gpu.gpus_per_node} ranks on " + (f"{gpu.cores:g} shared cores" if gpu.cores
                                                 else "a core each"),
             f"gloo: latency {link.latency * 1e6:.0f} us, {link.bandwidth / 1e9:.2f} GB/s"]
    for name, per_pass, per_step, *per_token in gpu.framework:
        lines.append(f"framework work of {name}: {per_pass * 1e3:.2f} ms per layer pass"
                     f" + {sum(per_token) * 1e9:.0f} ns per token, {per_step * 1e3:.1f} ms per"
                     " step")
    return "\n".join(lines)


def _as_dict(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def load_profile(path: str | Path | None = None) -> tuple[Gpu, Link]:
    """The calibrated ``Gpu`` and ``Link`` (``loom plan --gpu local``)."""
    target = Path(path) if path else DEFAULT_PROFILE
    if not target.is_file():
        raise HardwareError(f"--gpu local: no calibration profile at {target}; run"
                            " `loom plan --calibrate --nproc N` first")
    try:
        data = read_input_json(target)
    except InputFileError as err:
        raise HardwareError(f"--profile {target}: {err.rule}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(key), dict)
                                             for key in ("gpu", "link")):
        raise HardwareError(f"--profile {target}: must be a calibration profile (an object"
                            " with \"gpu\" and \"link\" objects, as `loom plan --calibrate`"
                            " writes)")
    try:
        return Gpu(**data["gpu"]), Link(**data["link"])
    except (TypeError, ValueError) as err:  # unknown or missing keys, bad values
        raise HardwareError(f"--profile {target}: {err}") from None


__all__ = ["fit", "layer_scale", "write_profile", "describe", "load_profile", "DEFAULT_PROFILE",
           "SMALLEST_DIMS", "ALLREDUCE_BYTES", "BLOCKS", "OPTIMIZER_PARAMS"]
