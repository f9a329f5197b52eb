"""PipeOffload: the device memory that offloading activations inside the schedule saves, and the
time it costs: simulated on deep pipelines, and measured on four CPU ranks.

**Simulated** (``loom.schedule.offload``): 1F1B and interleaved 1F1B (v = 2) at p = 8, 12, 16
with m = 4p. ``insert_offload`` places offloads and reloads under a per-rank device limit of 1/2
and 1/4 of the family's peak (at least 2 units: one F computing, one copy in flight);
``simulate_offload`` replays them with F = I = W = 1 per full rank (1/v per stage) and a host link
that moves one full rank's activations of one microbatch in ``r`` F-times, r = 0.5, 1, 2
(whether a unit crosses PCIe faster than one F computes depends on the model, the sequence
length and the link, hence the sweep). Reported: the simulated device peak (time
based, copies in flight included) against the schedule without offload, and the makespan
increase.

**Measured** (``--measure``): four local ranks (gloo, CPU, one thread each) run 1F1B at m = 8 with
and without offloads under limit 2 (rank 0 holds 4 units without): median step time, bytes
offloaded and reloaded per step, and the seconds the copies took. On CPU the "host" copy is a
separate tensor in the same memory: it saves nothing real, so this measures only what the copies
cost (and that they run); device memory savings need an accelerator.

    python bench/pipeline_offload.py [--measure] [--steps 5]

**Choice** (``best_with_offload``): at p = 8, m = 32 and limits 4 and 3, the family (offloaded
where it must be) with the shortest simulated makespan for host links r = 1/4, 1, 4, against the
best family that fits without offload.

Writes ``bench/out/pipeline_offload.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.schedule import families  # noqa: E402
from loom.schedule.cost import StageCosts  # noqa: E402
from loom.schedule.offload import count_transfers, insert_offload, simulate_offload  # noqa: E402
from loom.schedule.simulate import simulate  # noqa: E402

RATIOS = (Fraction(1, 2), Fraction(1), Fraction(2))


def simulated() -> list[dict]:
    rows = []
    for family, chunks in (("1f1b", 1), ("interleaved_1f1b", 2)):
        for p in (8, 12, 16):
            m = 4 * p
            schedule = families.get(family)(p, m, **({"chunks": chunks} if chunks > 1 else {}))
            per_stage = Fraction(1, chunks)
            plain = simulate(schedule, StageCosts.uniform(per_stage, per_stage, per_stage))
            peak = max(plain.peak_memory)
            for share in (Fraction(1, 2), Fraction(1, 4)):
                limit = max(2, float(peak * share))
                offloaded = insert_offload(schedule, limit)
                moved = sum(n for (_, op), n in count_transfers(offloaded).items()
                            if op.value == "O")
                for ratio in RATIOS:
                    costs = StageCosts.uniform(per_stage, per_stage, per_stage,
                                               host_bandwidth=1, host_unit_bytes=ratio)
                    sim = simulate_offload(offloaded, costs)
                    rows.append({
                        "family": family, "p": p, "m": m, "limit": limit,
                        "transfer_over_F": float(ratio), "offloads": moved,
                        "peak_without": float(peak),
                        "peak_with": float(max(sim.result.peak_memory)),
                        "saved": 1 - float(max(sim.result.peak_memory) / peak),
                        "makespan_without": float(plain.makespan),
                        "makespan_with": float(sim.result.makespan),
                        "time_cost": float(sim.result.makespan / plain.makespan) - 1,
                    })
    return rows


def choices() -> list[dict]:
    """``best_with_offload`` at p = 8, m = 32 under limits 4 and 3 for host links r = 1/4, 1, 4:
    the family it picks and its makespan, against the best family that fits without offload."""
    from loom.schedule.offload import best_with_offload
    from loom.schedule.validate import peak_memory

    rows = []
    p, m = 8, 32
    for limit in (4, 3):
        plain = []
        for name in families.names():
            schedule = families.get(name)(p, m)
            if max(peak_memory(schedule)) <= limit:
                v = Fraction(1, schedule.chunks_per_rank)
                plain.append((simulate(schedule, StageCosts.uniform(v, v, v)).makespan, name))
        without = min(plain, default=(None, "none fits"))
        for ratio in (Fraction(1, 4), Fraction(1), Fraction(4)):
            costs = StageCosts.uniform(1, 1, 1, host_bandwidth=1, host_unit_bytes=ratio)
            schedule, sim = best_with_offload(p, m, costs, limit)
            rows.append({"p": p, "m": m, "limit": limit, "transfer_over_F": float(ratio),
                         "picked": schedule.name, "makespan": float(sim.result.makespan),
                         "best_without": without[1],
                         "makespan_without": None if without[0] is None else float(without[0])})
    return rows


def _measure_rank(ctx, steps: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from loom.models import TransformerArgs
    from loom.pipeline.partition import partition_model
    from loom.pipeline.runtime import PipelineRuntime
    from loom.pipeline.stage import build_stages
    from loom.schedule.select import schedule_for

    torch.set_num_threads(1)
    p, m, seq, micro = 4, 8, 128, 2
    args = TransformerArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768,
                           vocab_size=512, max_seq_len=seq)
    plain = schedule_for("1f1b", p, m)
    runs = {"without": plain, "with": insert_offload(plain, 2)}
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(0, args.vocab_size, (micro, seq), generator=generator)
              for _ in range(m)]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten()) / m

    runtimes = {}
    for name, schedule in runs.items():
        layers = partition_model(args, schedule.num_stages, seq)
        stages = build_stages(args, schedule, layers, ctx.rank, "cpu", seed=5)
        runtimes[name] = PipelineRuntime(schedule, stages, ctx.rank, range(p), None)
    times: dict[str, list[float]] = {name: [] for name in runs}
    moved: dict[str, tuple[int, float]] = {}
    for step in range(steps + 1):  # alternate, the first round warms up
        for name, runtime in runtimes.items():
            dist.barrier()
            began = time.perf_counter()
            runtime.step(inputs, inputs, loss_fn, activation_shape=(micro, seq, args.dim))
            for stage in runtime.stages.values():
                for param in stage.parameters():
                    param.grad = None
            elapsed = torch.tensor([time.perf_counter() - began])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step:
                times[name].append(elapsed.item())
            moved[name] = (runtime.offload_bytes, runtime.offload_seconds)
    return [{"schedule": name, "rank": ctx.rank, "step_s": statistics.median(times[name]),
             "bytes_moved": moved[name][0], "copy_s": moved[name][1]} for name in runs]


def measured(steps: int) -> list[dict]:
    from loom.testing.harness import PoolRegistry

    registry = PoolRegistry(pg_timeout_s=300.0)
    try:
        return [row for rank_rows in registry.run(4, _measure_rank, steps) for row in rank_rows]
    finally:
        registry.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="also run the CPU measurement")
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args()
    began = time.perf_counter()
    result = {"simulated": simulated()}
    print(f"{'family':18} {'p':>3} {'m':>3} {'limit':>6} {'r':>4} {'offl':>5} {'peak':>6} "
          f"{'->':>6} {'saved':>6} {'time':>7}")
    for row in result["simulated"]:
        print(f"{row['family']:18} {row['p']:3} {row['m']:3} {row['limit']:6.2f} "
              f"{row['transfer_over_F']:4.1f} {row['offloads']:5} {row['peak_without']:6.2f} "
              f"{row['peak_with']:6.2f} {row['saved']:6.1%} {row['time_cost']:+7.2%}")
    result["choices"] = choices()
    for row in result["choices"]:
        print(f"limit {row['limit']} r {row['transfer_over_F']:4.2f}: {row['picked']:28} "
              f"{row['makespan']:7.2f}  vs {row['best_without']} {row['makespan_without']}")
    print(f"simulated in {time.perf_counter() - began:.1f} s")
    if options.measure:
        result["measured"] = measured(options.steps)
        for row in result["measured"]:
            print(f"{row['schedule']:8} rank {row['rank']}: step {row['step_s'] * 1e3:7.1f} ms, "
                  f"moved {row['bytes_moved'] / 2**20:7.2f} MiB in {row['copy_s'] * 1e3:6.1f} ms")
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "pipeline_offload.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
