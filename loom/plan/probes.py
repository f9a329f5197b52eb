"""Framework probes: what each parallel wrapper adds to a training step on this machine.

Part of ``loom plan --calibrate``. The cost model prices FLOPs, bytes and messages. What it does
not see is the per-op work of the framework around them: DTensor's dispatch under tensor
parallelism, FSDP2's hooks and copies, the ring-attention loop, the pipeline interpreter, an
optimizer over many small tensors. On an accelerator most of it hides behind asynchronous kernel
launches; on a CPU rank it is a large part of the step. Rather than guess it, the calibration
trains a small *probe* model (not the model being planned) with Loom's own ``Trainer``, under one
wrapper at a time and at two depths, and charges what the cost model does not explain to that
wrapper. The step time the cost model predicts is linear in a wrapper's seconds per layer pass x
(each of F, I and W) and its seconds per step y, so the two depths give both:

    measured(L) = predicted(L; x, y)    for L in PROBE_DEPTHS

"base" (Loom's trainer with plain data parallelism over every rank) is fitted first; every other
wrapper is fitted with base's values in place, so what it gets is its own addition. A wrapper
whose fitted x or y is negative (the cost model already over-prices it) is clamped to 0 and the
other value refitted.

Communication: each probe is a ``Trainer`` on the calibration's process group, so it issues
exactly the collectives that training with that layout would (counted nowhere: no ledger).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

from loom.sim.layout import Layout

# The probe model: a quarter of the tiny preset's width at half its sequence, so its FLOPs are
# small next to the framework work being measured.
PROBE_MODEL = {"model.dim": 128, "model.n_heads": 8, "model.n_kv_heads": 4, "model.ffn_dim": 384}
PROBE_SEQ = 128
PROBE_DEPTHS = (2, 4)
MICRO_BATCH = 2
PROBE_DATA = {"data.max_bytes": 400_000, "data.extensions": ".py", "data.tokenizer": "byte",
              "data.seq_len": PROBE_SEQ}


def probe_layouts(nproc: int) -> dict[str, Layout]:
    """One layout per wrapper, each over every one of the ``nproc`` ranks."""
    one = dict(micro_batch=MICRO_BATCH, microbatches=2)
    out = {"base": Layout(dp_replicate=nproc, **one)}
    if nproc < 2:
        return out
    out["tp"] = Layout(tp=nproc, sequence_parallel=True, **one)
    out["zero3"] = Layout(dp_shard=nproc, zero_stage=3, **one)
    out["zero12"] = Layout(dp_shard=nproc, zero_stage=2, **one)
    out["ring"] = Layout(cp=nproc, cp_mode="ring", **one)
    out["ulysses"] = Layout(cp=nproc, cp_mode="ulysses", **one)
    if nproc % 2 == 0:
        out["pp"] = Layout(pp=2, dp_replicate=nproc // 2, schedule="1f1b",
                           micro_batch=MICRO_BATCH, microbatches=4)
    return out


def probe_config(layout: Layout, depth: int) -> Any:
    """The resolved Loom config of one probe run, or None when Loom's rules refuse it (e.g. tp
    not dividing the probe's heads)."""
    from loom.config import ConfigError, load_config, resolve
    from loom.plan.search import to_overrides
    from loom.plan.space import Workload
    from loom.models.presets import PRESETS

    batch = layout.dp * layout.micro_batch * layout.microbatches
    work = Workload("tiny", PRESETS["tiny"], PROBE_SEQ, batch)
    values = {**to_overrides(layout, work), **PROBE_MODEL, **PROBE_DATA,
              "model.n_layers": depth, "train.dtype": "fp32", "train.eval_every": 0,
              "train.steps": 1000, "metrics.progress": False, "metrics.tensorboard": False,
              "metrics.plot": False, "metrics.jsonl": False}
    try:
        return resolve(load_config(None, values), layout.world)
    except ConfigError:
        return None


def run_probes(ctx: Any, nproc: int, data_dir: str, *, steps: int = 8,
               warmup: int = 3) -> dict[str, dict[int, float]]:
    """On every rank of the calibration group: median step seconds of each probe at each depth
    (the slowest rank's, each step started together after a barrier)."""
    import gc

    import torch
    import torch.distributed as dist

    from loom.train.trainer import Trainer

    out: dict[str, dict[int, float]] = {}
    for name, layout in probe_layouts(nproc).items():
        for depth in PROBE_DEPTHS:
            config = probe_config(layout, depth)
            if config is None:
                continue
            trainer = Trainer(config, data_dir, None, ctx)
            times = []
            for step in range(warmup + steps):
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step()
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if step >= warmup:
                    times.append(float(took))
            out.setdefault(name, {})[depth] = statistics.median(times)
            del trainer
            gc.collect()
    return out


def _predict(layout: Layout, depth: int, gpu: Any, link: Any, nproc: int) -> float:
    from loom.plan.hardware import Cluster
    from loom.plan.search import simulate_step
    from loom.sim.cost_model import CostModel
    from loom.train.trainer import model_args

    config = probe_config(layout, depth)
    args = model_args(config)
    batch = config.train.global_batch_size
    model = CostModel(args, PROBE_SEQ, batch, Cluster(gpu, nproc, nproc, link, link),
                      dtype_bytes=4)
    return simulate_step(model, model.evaluate(layout)).step_time


def fit_framework(probes: dict[str, dict[int, float]], gpu: Any, link: Any,
                  nproc: int) -> tuple[tuple[str, float, float], ...]:
    """(wrapper, seconds per layer pass, seconds per step) for every probed wrapper, solved from
    ``run_probes``' measurements against the cost model with ``gpu`` and ``link``."""
    layouts = probe_layouts(nproc)
    entries: list[tuple[str, float, float]] = []
    for name, layout in layouts.items():
        measured = probes.get(name, {})
        depths = [d for d in PROBE_DEPTHS if d in measured or str(d) in measured]
        if len(depths) < 2:
            continue
        meas = [measured[d] if d in measured else measured[str(d)] for d in depths]

        def predict(depth: int, x: float, y: float) -> float:
            trial = replace(gpu, framework=tuple(entries) + ((name, x, y),))
            return _predict(layout, depth, trial, link, nproc)

        delta = 1e-3
        base = [predict(d, 0.0, 0.0) for d in depths]
        ax = [(predict(d, delta, 0.0) - b) / delta for d, b in zip(depths, base)]
        ay = [(predict(d, 0.0, delta) - b) / delta for d, b in zip(depths, base)]
        rest = [m - b for m, b in zip(meas, base)]
        det = ax[0] * ay[1] - ax[1] * ay[0]
        x = (rest[0] * ay[1] - rest[1] * ay[0]) / det if det else 0.0
        y = (ax[0] * rest[1] - ax[1] * rest[0]) / det if det else 0.0
        if x < 0:  # the layers cost no more than priced: all of the residual is per step
            x = 0.0
            y = statistics.fmean(r / a for r, a in zip(rest, ay))
        if y < 0:
            y = 0.0
            x = max(0.0, sum(r * a for r, a in zip(rest, ax)) / sum(a * a for a in ax))
        entries.append((name, x, y))
    return tuple(entries)


__all__ = ["PROBE_MODEL", "PROBE_SEQ", "PROBE_DEPTHS", "probe_layouts", "probe_config",
           "run_probes", "fit_framework"]
