"""Pipeline activation memory: measured saved-tensor bytes per rank vs the simulator's peak.

Four local ranks run Loom's runtime (same tiny model and split as ``bench/pipeline_runtime.py``)
under 1F1B, ZB-H2 and ZB-V at p=4, m=8 with ``PipelineRecorder(track_memory=True)``: the bytes
autograd saves for backward, counted once per storage, without parameters and buffers, live from
the moment they are saved until autograd frees them. The second step is reported (the first warms
up). The measured peak per rank is compared with ``loom.schedule.simulate``'s peak memory converted to
bytes two ways:

* **issue units**: the simulator's default accounting (a rank's v stages weigh 1/v each, held
  from the start of F to the end of the last backward piece) times *bytes per unit*, the saved
  bytes of one full rank for one microbatch: the sum of its stages' per-microbatch F bytes,
  median over ranks;
* **per-stage bytes**: ``StageCosts.activation[s]`` = the measured bytes one F of stage s saves,
  and ``weight_grad_fraction`` = the measured share of them still held after I (calibrated here:
  Zero Bubble's M_W / M_B), so the simulator's peak is directly in bytes.

    python bench/pipeline_memory.py

Writes ``bench/out/pipeline_memory.json`` and ``docs/img/pipeline_memory.png``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from pipeline_runtime import P, Shape, batch, loom_runtime, loom_step  # noqa: E402

FAMILIES = ("1f1b", "zb_h2", "zbv")
M = 8
STEP = 1  # the second step; the first warms up


def measure(ctx, family: str, shape: Shape):
    from loom.pipeline.profile import PipelineRecorder

    torch.set_num_threads(1)
    schedule, _, runtime = loom_runtime(ctx.rank, family, 0, M, shape)
    runtime.recorder = PipelineRecorder(
        ctx.rank, track_memory=True, modules=[s.module for s in runtime.stages.values()])
    step = loom_step(runtime, shape, M, *batch(shape, M))
    for _ in range(STEP + 1):
        step()
    return schedule, runtime.recorder.profile


def analyse(schedule, profiles) -> dict:
    from loom.pipeline.profile import calibrate, peak_saved_bytes
    from loom.schedule import simulate

    forward: dict[int, list[int]] = {}
    after_i: dict[int, list[float]] = {}
    for profile in profiles:
        for (stage, _), held in profile.forward_bytes.items():
            forward.setdefault(stage, []).append(held)
        for key, held in profile.after_input_grad.items():
            if key[0] != 0:  # stage 0's I is a no-op (token ids have no gradient)
                after_i.setdefault(key[0], []).append(held / profile.forward_bytes[key])
    per_stage = [statistics.fmean(forward[s]) for s in range(schedule.num_stages)]
    per_rank = [sum(per_stage[s] for s in schedule.stages_of(r)) for r in range(P)]
    bytes_per_unit = statistics.median(per_rank)
    fraction = statistics.fmean(f for v in after_i.values() for f in v) if after_i else 1.0
    timing = calibrate(schedule, profiles, [STEP])
    units = simulate(schedule, timing)
    in_bytes = simulate(schedule, calibrate(schedule, profiles, [STEP],
                                            activation=tuple(per_stage),
                                            weight_grad_fraction=fraction))
    measured = [peak_saved_bytes(p, STEP) for p in sorted(profiles, key=lambda p: p.rank)]
    return {
        "family": schedule.name, "p": P, "m": M,
        "measured_peak_bytes": measured,
        "bytes_per_unit": bytes_per_unit,
        "stage_forward_bytes": per_stage,
        "after_input_grad_fraction": fraction,
        "after_input_grad_fraction_by_stage": {s: statistics.fmean(v) for s, v in after_i.items()},
        "predicted_units": [float(u) for u in units.peak_memory],
        "predicted_units_bytes": [float(u) * bytes_per_unit for u in units.peak_memory],
        "predicted_stage_bytes": [float(b) for b in in_bytes.peak_memory],
        "error_units": [float(u) * bytes_per_unit / m - 1 for u, m in zip(units.peak_memory,
                                                                         measured)],
        "error_stage_bytes": [float(b) / m - 1 for b, m in zip(in_bytes.peak_memory, measured)],
    }


def draw(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.4), sharey=True)
    width = 0.27
    for axis, row in zip(axes, rows):
        ranks = range(P)
        mib = 2 ** 20
        axis.bar([r - width for r in ranks], [b / mib for b in row["measured_peak_bytes"]],
                 width, label="measured", color="#4387fd")
        axis.bar(list(ranks), [b / mib for b in row["predicted_stage_bytes"]], width,
                 label="simulated, per-stage bytes", color="#0da861")
        axis.bar([r + width for r in ranks], [b / mib for b in row["predicted_units_bytes"]],
                 width, label="simulated, issue units x bytes/unit", color="#ee8e00")
        axis.set_title(f"{row['family']}  p={row['p']} m={row['m']}", fontsize=10)
        axis.set_xticks(list(ranks), [f"rank {r}" for r in ranks], fontsize=8)
    axes[0].set_ylabel("peak saved activations (MiB)")
    axes[0].legend(fontsize=7, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    from loom.testing.harness import WorkerPool

    shape = Shape()
    pool = WorkerPool(P, pg_timeout_s=300.0)
    rows = []
    try:
        for family in FAMILIES:
            results = pool.run(measure, family, shape, task_timeout_s=1800.0)
            row = analyse(results[0][0], [profile for _, profile in results])
            rows.append(row)
            mib = 2 ** 20
            print(f"{family:6s} measured MiB {[round(b / mib, 2) for b in row['measured_peak_bytes']]}"
                  f"  per-stage sim {[round(b / mib, 2) for b in row['predicted_stage_bytes']]}"
                  f" err {[f'{e:+.1%}' for e in row['error_stage_bytes']]}"
                  f"  units {row['predicted_units']} x {row['bytes_per_unit'] / mib:.2f} MiB"
                  f" err {[f'{e:+.1%}' for e in row['error_units']]}"
                  f"  after-I fraction {row['after_input_grad_fraction']:.4f}", flush=True)
    finally:
        pool.close()
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "pipeline_memory.json", "w") as handle:
        json.dump({"shape": shape.__dict__, "rows": rows}, handle, indent=1)
    draw(rows, ROOT / "docs" / "img" / "pipeline_memory.png")


if __name__ == "__main__":
    main()
