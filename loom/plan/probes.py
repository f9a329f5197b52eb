"""Framework probes: what each parallel wrapper adds to a training step on this machine.

Part of ``loom plan --calibrate``: the probes' layouts, shapes and configs and the fit are here;
running them with the trainer is ``loom.calibration.probes``. The cost model prices FLOPs, bytes and messages. What it does
not see is the per-op work of the framework around them: DTensor's dispatch under tensor
parallelism, FSDP2's hooks and copies, the ring-attention loop, the pipeline interpreter, an
optimizer over many small tensors. On an accelerator most of it hides behind asynchronous kernel
launches; on a CPU rank it is a large part of the step. Rather than guess it, the calibration
trains a small *probe* model (not the model being planned) with Loom's own ``Trainer``, under one
wrapper at a time and at three shapes, and charges what the cost model does not explain to that
wrapper. The step time the cost model predicts is linear in a wrapper's seconds per layer pass x
(each of F, I and W), its seconds per token per layer pass z (copies and redistributions that
grow with the activations; not for ZeRO's wrappers, whose work grows with the parameters) and
its seconds per step y, so three shapes give all three:

    measured(L, b) = predicted(L, b; x, y, z)    for (L, b) in PROBE_SHAPES

(L layers, b sequences per microbatch). "base" (Loom's trainer with plain data parallelism over
every rank) is fitted first; every other wrapper is fitted with base's values in place, so what
it gets is its own addition. The fit is non-negative: a term that would come out negative (the
cost model already over-prices it) is dropped and the others refitted. What running the probes
communicates: ``loom.calibration.probes``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from loom.config import ConfigError, load_config, model_args, resolve, with_layout
from loom.layout import Layout
from loom.plan.hardware import Cluster
from loom.plan.search import simulate_step
from loom.sim.cost_model import CostModel

# The probe model: half the tiny preset's width at half its sequence, so its FLOPs are
# small next to the framework work being measured.
PROBE_MODEL = {"model.dim": 128, "model.n_heads": 8, "model.n_kv_heads": 4, "model.ffn_dim": 384}
PROBE_SEQ = 128
PROBE_SHAPES = ((2, 2), (4, 2), (2, 8))  # (layers, sequences per microbatch)
PROBE_DATA = {"data.max_bytes": 400_000, "data.extensions": ".py", "data.tokenizer": "byte",
              "data.seq_len": PROBE_SEQ}


# Wrappers whose own work grows with the parameters, not the tokens: ZeRO's buckets, slices and
# hooks, FSDP2's gathers and copies. They get no per-token term: a probe's noise at its largest
# activation shape would otherwise be charged per token (measured: a 1 us/token ZeRO-1/2 term
# that put ZeRO 24 ms behind plain DP at 1,024 tokens per microbatch, where it measured faster).
PARAMETER_SIZED = ("zero1", "zero2", "zero3")


def probe_layouts(nproc: int, micro_batch: int = 2) -> dict[str, Layout]:
    """One layout per wrapper, each over every one of the ``nproc`` ranks."""
    one = dict(micro_batch=micro_batch, microbatches=2)
    out = {"base": Layout(dp_replicate=nproc, **one)}
    if nproc < 2:
        return out
    out["tp"] = Layout(tp=nproc, sequence_parallel=True, **one)
    out["zero3"] = Layout(dp_shard=nproc, zero_stage=3, **one)
    # ZeRO-1 and ZeRO-2 are probed apart: ZeRO-2 packs every gradient in a hook during the
    # backward, ZeRO-1 reduces from the finished gradients after it
    out["zero1"] = Layout(dp_shard=nproc, zero_stage=1, **one)
    out["zero2"] = Layout(dp_shard=nproc, zero_stage=2, **one)
    out["ring"] = Layout(cp=nproc, cp_mode="ring", **one)
    out["ulysses"] = Layout(cp=nproc, cp_mode="ulysses", **one)
    if nproc % 2 == 0:
        out["pp"] = Layout(pp=2, dp_replicate=nproc // 2, schedule="1f1b",
                           micro_batch=micro_batch, microbatches=4)
    return out


def _key(depth: int, micro_batch: int) -> str:
    return f"{depth}x{micro_batch}"


def probe_config(layout: Layout, depth: int) -> Any:
    """The resolved Loom config of one probe run, or None when Loom's rules refuse it (e.g. tp
    not dividing the probe's heads)."""
    values = {"model.preset": "tiny", **PROBE_MODEL, **PROBE_DATA, "model.n_layers": depth,
              "train.eval_every": 0, "train.steps": 1000, "metrics.progress": False,
              "metrics.tensorboard": False, "metrics.plot": False, "metrics.jsonl": False}
    try:
        return resolve(with_layout(load_config(None, values), layout), layout.world)
    except ConfigError:
        return None


def _predict(layout: Layout, depth: int, gpu: Any, link: Any, nproc: int) -> float:
    config = probe_config(layout, depth)
    args = model_args(config)
    batch = config.train.global_batch_size
    model = CostModel(args, PROBE_SEQ, batch, Cluster(gpu, nproc, nproc, link, link),
                      dtype_bytes=4)
    return simulate_step(model, model.evaluate(layout)).step_time


def _nonnegative_solve(columns: list[list[float]], rest: list[float]) -> list[float]:
    """Least squares of ``rest`` on ``columns`` with every coefficient >= 0: solve, drop the most
    negative coefficient's column, repeat (an active set small enough to do by hand)."""
    import numpy as np

    active = list(range(len(columns)))
    while active:
        a = np.array([columns[k] for k in active]).T
        solution, *_ = np.linalg.lstsq(a, np.array(rest), rcond=None)
        if (solution >= 0).all():
            out = [0.0] * len(columns)
            for k, value in zip(active, solution):
                out[k] = float(value)
            return out
        active.pop(int(np.argmin(solution)))
    return [0.0] * len(columns)


def fit_framework(probes: dict[str, dict[str, float]], gpu: Any, link: Any,
                  nproc: int) -> tuple[tuple[str, float, float, float], ...]:
    """(wrapper, seconds per layer pass, seconds per step, seconds per token per layer pass) for
    every probed wrapper, solved from ``run_probes``' measurements against the cost model with
    ``gpu`` and ``link``."""
    entries: list[tuple[str, float, float, float]] = []
    for name in probe_layouts(nproc):
        measured = probes.get(name, {})
        shapes = [(d, b) for d, b in PROBE_SHAPES if _key(d, b) in measured]
        if len(shapes) < len(PROBE_SHAPES):
            continue

        def predict(depth: int, micro: int, work: tuple[float, float, float]) -> float:
            trial = replace(gpu, framework=tuple(entries) + ((name, *work),))
            return _predict(probe_layouts(nproc, micro)[name], depth, trial, link, nproc)

        base = [predict(d, b, (0.0, 0.0, 0.0)) for d, b in shapes]
        terms = (0, 1) if name in PARAMETER_SIZED else (0, 1, 2)
        columns = []
        for k in terms:  # the model is linear in each term
            delta = (1e-3, 1e-3, 1e-6)[k]
            unit = tuple(delta if j == k else 0.0 for j in range(3))
            columns.append([(predict(d, b, unit) - p) / delta for (d, b), p in zip(shapes, base)])
        rest = [measured[_key(d, b)] - p for (d, b), p in zip(shapes, base)]
        work = [0.0, 0.0, 0.0]
        for k, value in zip(terms, _nonnegative_solve(columns, rest)):
            work[k] = value
        entries.append((name, *work))
    return tuple(entries)


__all__ = ["PROBE_MODEL", "PROBE_SEQ", "PROBE_SHAPES", "probe_layouts", "probe_config",
           "fit_framework"]
