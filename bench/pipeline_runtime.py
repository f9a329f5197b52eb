"""Benchmark B: Loom's pipeline runtime vs ``torch.distributed.pipelining``, and the simulator
fed with costs profiled from the same run.

Four local ranks (gloo, CPU, one thread each) train a small ``Transformer`` split by
``loom.pipeline.partition_model``; both sides hold the same slices (``build_model(layer_ids=...,
with_embedding=..., with_head=...)``, seeded weights) and run the same schedule:

    Loom 1f1b                   <-> torch Schedule1F1B
    Loom interleaved_1f1b (v=2) <-> torch ScheduleInterleaved1F1B
    Loom zbv                    <-> torch ScheduleZBVZeroBubble

In one process group, timed steps rotate torch / Loom / Loom with the recorder
(``loom.pipeline.profile``), each preceded by a barrier; a step's time is from the earliest rank
leaving the barrier to the last rank finishing (one clock: ``perf_counter`` is system-wide).
Reported: median step times, the ratio Loom/torch (target <= 1.0), and the simulator's makespan
for the schedule with per-stage F/I/W/B means and the send latency measured in the recorded steps,
against the measured step (target: within 10%). Gradients of the first step are compared between
the two runtimes, so both compute the same thing.

    python bench/pipeline_runtime.py [--steps 20] [--warmup 3] [--m 4 8] [--families ...]

Writes ``bench/out/pipeline_runtime.json``, Gantt charts (predicted and measured) under
``docs/img/`` and Chrome traces (measured ranks, then simulated ranks) under ``bench/out/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from loom.models import TransformerArgs, build_model, reset_parameters  # noqa: E402
from loom.pipeline.partition import partition_model  # noqa: E402
from loom.pipeline.profile import PipelineRecorder  # noqa: E402
from loom.pipeline.runtime import PipelineRuntime  # noqa: E402
from loom.schedule.select import schedule_for  # noqa: E402
from loom.pipeline.stage import build_stages  # noqa: E402

P = 4
CORES = os.cpu_count() or 1  # the ranks share them: P > CORES oversubscribes
FAMILIES = {"1f1b": ("Schedule1F1B", 0), "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
            "zbv": ("ScheduleZBVZeroBubble", 0)}


@dataclass(frozen=True)
class Shape:
    dim: int = 256
    layers: int = 8
    seq: int = 128
    micro: int = 2
    vocab: int = 512
    seed: int = 0

    def args(self) -> TransformerArgs:
        return TransformerArgs(dim=self.dim, n_layers=self.layers, n_heads=8, n_kv_heads=4,
                               ffn_dim=3 * self.dim, vocab_size=self.vocab, max_seq_len=self.seq)


def batch(shape: Shape, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``[m * micro, seq]`` tokens and targets on every rank."""
    generator = torch.Generator().manual_seed(shape.seed)
    tokens = torch.randint(0, shape.vocab, (2, m * shape.micro, shape.seq), generator=generator)
    return tokens[0], tokens[1]


def loom_runtime(rank: int, family: str, chunks: int, m: int, shape: Shape):
    """This rank's stages and runtime (the whole world is the pipeline group)."""
    schedule = schedule_for(family, P, m, chunks)
    layers = partition_model(shape.args(), schedule.num_stages, shape.seq)
    stages = build_stages(shape.args(), schedule, layers, rank, "cpu", shape.seed)
    return schedule, layers, PipelineRuntime(schedule, stages, rank, range(P), None)


def loom_step(runtime: PipelineRuntime, shape: Shape, m: int, x: torch.Tensor, y: torch.Tensor):
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / m

    return lambda: runtime.step(list(x.chunk(m)), list(y.chunk(m)), loss_fn,
                                activation_shape=(shape.micro, shape.seq, shape.dim))


def torch_pipeline(rank: int, schedule, layers, family: str, m: int, shape: Shape):
    """torch's ``PipelineStage``s over the same slices and torch's schedule class."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    n = schedule.num_stages
    stages = []
    for index in schedule.stages_of(rank):
        module = build_model(shape.args(), device="meta", layer_ids=layers[index],
                             with_embedding=index == 0, with_head=index == n - 1)
        module.to_empty(device="cpu")
        reset_parameters(module, shape.seed)
        stages.append(PipelineStage(module, index, n, torch.device("cpu")))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())  # torch scales by 1/m

    cls = getattr(torch_schedules, FAMILIES[family][0])
    single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
    return stages, cls(stages[0] if single else stages, m, loss_fn=loss_fn)


def torch_step(pipe, stages, n: int, x: torch.Tensor, y: torch.Tensor):
    held = {stage.stage_index for stage in stages}

    def step() -> None:
        args = (x,) if 0 in held else ()
        kwargs = {"target": y, "losses": []} if n - 1 in held else {}
        pipe.step(*args, **kwargs)

    return step


def _zero(modules) -> None:
    for module in modules:
        for p in module.parameters():
            p.grad = None


def _timed(step, modules) -> float:
    """Barrier, step; from the earliest rank's start to the latest rank's end (seconds)."""
    _zero(modules)
    dist.barrier()
    start = time.perf_counter()
    step()
    bounds = torch.tensor([-start, time.perf_counter()], dtype=torch.float64)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    return float(bounds.sum())


def run_case(ctx, family: str, m: int, steps: int, warmup: int, shape: Shape) -> dict:
    """On every rank: alternate torch / Loom / Loom+recorder steps; rank profiles and times."""
    torch.set_num_threads(1)
    chunks = FAMILIES[family][1]
    schedule, layers, runtime = loom_runtime(ctx.rank, family, chunks, m, shape)
    torch_stages, pipe = torch_pipeline(ctx.rank, schedule, layers, family, m, shape)
    x, y = batch(shape, m)
    loom_modules = [s.module for s in runtime.stages.values()]
    torch_modules = [s.submod for s in torch_stages]
    recorder = PipelineRecorder(ctx.rank)
    plain, recorded = loom_step(runtime, shape, m, x, y), loom_step(runtime, shape, m, x, y)

    def with_recorder() -> None:
        runtime.recorder = recorder
        try:
            recorded()
        finally:
            runtime.recorder = None

    sides = {"torch": (torch_step(pipe, torch_stages, schedule.num_stages, x, y), torch_modules),
             "loom": (plain, loom_modules), "loom_recorded": (with_recorder, loom_modules)}
    # Same numbers first: one step each from zero gradients, compared parameter by parameter.
    _timed(sides["torch"][0], torch_modules)
    _timed(plain, loom_modules)
    diff = max(float((a.grad - b.grad).abs().max()) for ma, mb in zip(loom_modules, torch_modules)
               for a, b in zip(ma.parameters(), mb.parameters()))
    scale = max(float(a.grad.abs().max()) for mo in loom_modules for a in mo.parameters())
    times: dict[str, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for i in range(warmup + steps):
        for name in order[i % 3:] + order[:i % 3]:  # rotate who goes first
            elapsed = _timed(*sides[name])
            if i >= warmup:
                times[name].append(elapsed)
    return {"times": times, "profile": recorder.profile, "grad_diff": diff, "grad_max": scale,
            "schedule": schedule, "layers": [list(r) for r in layers]}


def analyse(family: str, m: int, results: list[dict], warmup: int, out: Path,
            draw: bool) -> dict:
    """Calibrate the simulator from the recorded steps and compare with the measured times."""
    from loom.pipeline.profile import (calibrate, chrome_trace, measured_result,
                                       uncontended_work)
    from loom.schedule import simulate
    from loom.schedule.simulate import replay_shared
    from loom.schedule.render import render_gantt

    schedule = results[0]["schedule"]
    profiles = [r["profile"] for r in results]
    steps = list(range(warmup, len(profiles[0].steps)))
    costs = calibrate(schedule, profiles, steps)
    predicted = simulate(schedule, costs)
    # The same costs without the core sharing of this machine (CORES cores for 4 ranks), and a
    # replay that shares them again: what the simulator lacks here (see docs/benchmarks.md).
    work: dict[tuple[int, str], list[float]] = {}
    for s in steps:
        for action, seconds in uncontended_work(profiles, s, CORES).items():
            work.setdefault((action.stage, action.op.value), []).append(seconds)
    per_action = {a: statistics.fmean(work[a.stage, a.op.value])
                  for row in schedule.actions for a in row}
    shared = replay_shared(schedule, per_action, float(costs.latency), CORES)
    times = results[0]["times"]
    medians = {name: statistics.median(values) for name, values in times.items()}
    makespans = [float(measured_result(schedule, profiles, s).makespan) for s in steps]
    # The step with the median makespan is the one drawn and traced.
    typical = steps[sorted(range(len(steps)), key=lambda k: makespans[k])[len(steps) // 2]]
    measured = measured_result(schedule, profiles, typical)
    tag = f"{family}_p{P}_m{m}"
    if draw:
        render_gantt(schedule, predicted, ROOT / "docs" / "img" / f"pipeline_{tag}_predicted.png")
        render_gantt(schedule, measured, ROOT / "docs" / "img" / f"pipeline_{tag}_measured.png")
    with open(out / f"pipeline_trace_{tag}.json", "w") as handle:
        json.dump(chrome_trace(schedule, profiles, typical, predicted), handle)
    row = {
        "family": family, "p": P, "m": m, "stages": schedule.num_stages,
        "torch_s": medians["torch"], "loom_s": medians["loom"],
        "loom_recorded_s": medians["loom_recorded"],
        "ratio": medians["loom"] / medians["torch"],
        # Per step, Loom/torch of the same rotation round, then the median: noise-robust.
        "ratio_paired": statistics.median(a / b for a, b in zip(times["loom"], times["torch"])),
        "measured_makespan_s": statistics.median(makespans),
        "predicted_s": float(predicted.makespan),
        "prediction_error": float(predicted.makespan) / medians["loom_recorded"] - 1,
        "prediction_error_makespan": float(predicted.makespan) / statistics.median(makespans) - 1,
        "shared_predicted_s": shared,
        "shared_error": shared / medians["loom_recorded"] - 1,
        "latency_s": float(costs.latency),
        "costs": costs.to_dict(), "grad_diff": results[0]["grad_diff"],
        "grad_max": results[0]["grad_max"], "times": times,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--draw-m", type=int, default=8, help="draw Gantt charts for this m")
    options = parser.parse_args()
    from loom.testing.harness import WorkerPool

    shape = Shape()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    pool = WorkerPool(P, pg_timeout_s=300.0)
    rows = []
    try:
        for family in options.families:
            for m in options.m:
                started = time.perf_counter()
                results = pool.run(run_case, family, m, options.steps, options.warmup, shape,
                                   task_timeout_s=3600.0)
                row = analyse(family, m, results, options.warmup, out, m == options.draw_m)
                rows.append(row)
                print(f"{family:17s} m={m}: torch {row['torch_s'] * 1e3:7.1f} ms  loom "
                      f"{row['loom_s'] * 1e3:7.1f} ms  (recorded {row['loom_recorded_s'] * 1e3:7.1f})"
                      f"  ratio {row['ratio']:.3f} (paired {row['ratio_paired']:.3f})  predicted "
                      f"{row['predicted_s'] * 1e3:7.1f} ms  error {row['prediction_error']:+.1%} "
                      f"(vs makespan {row['prediction_error_makespan']:+.1%})  shared-core replay "
                      f"{row['shared_predicted_s'] * 1e3:7.1f} ms {row['shared_error']:+.1%}  grad diff "
                      f"{row['grad_diff']:.1e}/{row['grad_max']:.1e}  "
                      f"[{time.perf_counter() - started:.0f} s]", flush=True)
    finally:
        pool.close()
    with open(out / "pipeline_runtime.json", "w") as handle:
        json.dump({"shape": asdict(shape), "p": P, "steps": options.steps,
                   "warmup": options.warmup, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
