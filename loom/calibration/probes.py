"""Running the framework probes (``loom plan --calibrate``): a small probe model trained by Loom's
own ``Trainer`` under one parallel wrapper at a time, timed step by step.

What a probe is and how its times are fitted is the planner's (``loom.plan.probes``: the probe
layouts, shapes and the fit); running them needs the trainer, so it lives here, above the
planner. Communication: each probe is a ``Trainer`` on the calibration's process group, so it
issues exactly the collectives that training with that layout would (counted nowhere: no
ledger), plus one barrier and one 1-element all-reduce (MAX) per timed step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from loom.plan.probes import PROBE_SHAPES, _key, probe_config, probe_layouts
from loom.train.trainer import Trainer


def run_probes(ctx: Any, nproc: int, data_dir: str, *, rounds: int = 6, steps: int = 2,
               warmup: int = 2) -> dict[str, dict[str, float]]:
    """On every rank of the calibration group: median step seconds of each probe at each shape
    (keys "LxB"; the slowest rank's, each step started together after a barrier). Every
    wrapper's shapes are built together and all are stepped in turn, ``steps`` each per round,
    so a slow spell of the machine falls on all of them alike instead of on one wrapper."""
    import gc

    import torch
    import torch.distributed as dist

    def timed_step(trainer: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    trainers: dict[tuple[str, str], Any] = {}
    for name in probe_layouts(nproc):
        for depth, micro in PROBE_SHAPES:
            config = probe_config(probe_layouts(nproc, micro)[name], depth)
            if config is not None:
                trainers[(name, _key(depth, micro))] = Trainer(config, data_dir, None, ctx)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in trainers}
    order = list(trainers)
    for round_ in range(rounds):
        # every wrapper and shape in turn, the order rotated per round: the fit compares each
        # wrapper with "base", so a slow spell must fall on both alike
        shift = round_ % len(order)
        for key in order[shift:] + order[:shift]:
            for _ in range(warmup if round_ == 0 else steps):
                took = timed_step(trainers[key])
                if round_:
                    times[key].append(took)
    out: dict[str, dict[str, float]] = {}
    for (name, key), values in times.items():
        out.setdefault(name, {})[key] = statistics.median(values)
    del trainers
    gc.collect()
    return out


__all__ = ["run_probes"]
