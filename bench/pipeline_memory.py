"""Pipeline activation memory: measured saved-tensor bytes per rank vs the simulator's peak.

Four local ranks run Loom's runtime (same tiny model and split as ``bench/pipeline_runtime.py``)
under 1F1B, interleaved 1F1B, ZB-H1, ZB-H2 and ZB-V at p=4, m=8 with
``PipelineRecorder(track_memory=True)``: the bytes autograd saves for backward, counted once per
storage, without parameters and buffers, live from the moment they are saved until autograd frees
them, plus what a stage keeps from an I to its W (``PipelineStage.held_for_weight``). The second
step is reported (the first warms up). Each split-backward schedule runs twice (``--split``):
with the stage's freeing I/W split (``free``: I frees all W does not read) and with torch's
retaining one (``retain``: ``free_graph_after_input_grad`` off, the whole graph held until W),
the before and after of issue 20 item 2. The measured peak per rank is compared with
``loom.schedule.simulate``'s peak memory converted to bytes four ways:

* **formula** (the prediction): ``StageCosts.activation[s]`` = the measured bytes one F of stage
  s saves, and ``weight_grad_fraction`` = ``block_weight_grad_bytes / block_activation_bytes``
  (``loom.formulas.memory``: what W needs of a block, its linears' inputs and output gradients,
  over what F saved), so nothing of the I/W split's outcome is fed back;
* **default** accounting: the same bytes with ``weight_grad_fraction = 1`` (everything held until
  W: what a retaining split amounts to);
* **issue units**: the simulator's default accounting (a rank's v stages weigh 1/v each, held
  from the start of F to the end of the last backward piece) times *bytes per unit*, the saved
  bytes of one full rank for one microbatch: the sum of its stages' per-microbatch F bytes,
  median over ranks;
* **calibrated per-stage bytes**: ``StageCosts.activation[s]`` as above and
  ``weight_grad_fraction`` = the measured share of them still held after I (calibrated here:
  Zero Bubble's M_W / M_B), so the simulator's peak is directly in bytes.

    python bench/pipeline_memory.py [--families 1f1b zbv ...] [--split both|free|retain]

Writes ``bench/out/pipeline_memory.json`` and ``docs/img/pipeline_memory.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from pipeline_runtime import P, Shape, batch, loom_runtime, loom_step  # noqa: E402

FAMILIES = ("1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zbv")
M = 8
STEP = 1  # the second step; the first warms up


def measure(ctx, family: str, shape: Shape, free: bool):
    from loom.pipeline.profile import PipelineRecorder

    torch.set_num_threads(1)
    schedule, _, runtime = loom_runtime(ctx.rank, family, 0, M, shape)
    for stage in runtime.stages.values():
        stage.free_graph_after_input_grad = free
    runtime.recorder = PipelineRecorder(
        ctx.rank, track_memory=True, modules=[s.module for s in runtime.stages.values()])
    step = loom_step(runtime, shape, M, *batch(shape, M))
    for _ in range(STEP + 1):
        step()
    return schedule, runtime.recorder.profile


def formula_fraction(shape: Shape) -> float:
    """What W needs of a block over what its F saved (``loom.formulas.memory``)."""
    from loom.formulas.memory import block_activation_bytes, block_weight_grad_bytes

    args = shape.args()
    sizes = dict(s=shape.seq, b=shape.micro, h=args.dim, f=args.ffn_dim, a=args.n_heads,
                 kv=args.n_kv_heads)
    return block_weight_grad_bytes(**sizes) / block_activation_bytes(**sizes)


def analyse(schedule, profiles, shape: Shape, free: bool) -> dict:
    from loom.pipeline.profile import calibrate, peak_saved_bytes
    from loom.schedule import simulate

    forward: dict[int, list[int]] = {}
    after_i: dict[int, list[float]] = {}
    for profile in profiles:
        for (stage, _), held in profile.forward_bytes.items():
            forward.setdefault(stage, []).append(held)
        for key, held in profile.after_input_grad.items():
            if free or key[0] != 0:  # retaining: stage 0's I is a no-op (token ids)
                after_i.setdefault(key[0], []).append(held / profile.forward_bytes[key])
    per_stage = [statistics.fmean(forward[s]) for s in range(schedule.num_stages)]
    per_rank = [sum(per_stage[s] for s in schedule.stages_of(r)) for r in range(P)]
    bytes_per_unit = statistics.median(per_rank)
    fraction = statistics.fmean(f for v in after_i.values() for f in v) if after_i else 1.0
    # The retaining split holds its saved intermediate gradients on top of the whole graph, so
    # its share can pass 1, which the simulator's accounting (freed at I, or held) cannot say.
    calibrated = min(fraction, 1.0)
    timing = calibrate(schedule, profiles, [STEP])
    units = simulate(schedule, timing)
    in_bytes = simulate(schedule, calibrate(schedule, profiles, [STEP],
                                            activation=tuple(per_stage),
                                            weight_grad_fraction=calibrated))
    model_fraction = formula_fraction(shape)
    formula, default = (
        simulate(schedule, calibrate(schedule, profiles, [STEP], activation=tuple(per_stage),
                                     weight_grad_fraction=f)).peak_memory
        for f in (model_fraction, 1))
    measured = [peak_saved_bytes(p, STEP) for p in sorted(profiles, key=lambda p: p.rank)]
    return {
        "family": schedule.name, "p": P, "m": M, "split": "free" if free else "retain",
        "measured_peak_bytes": measured,
        "formula_fraction": model_fraction,
        "predicted_formula_bytes": [float(b) for b in formula],
        "error_formula": [float(b) / m - 1 for b, m in zip(formula, measured)],
        "predicted_default_bytes": [float(b) for b in default],
        "error_default": [float(b) / m - 1 for b, m in zip(default, measured)],
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

    families = list(dict.fromkeys(row["family"] for row in rows))
    figure, axes = plt.subplots(1, len(families), figsize=(4.2 * len(families), 3.4),
                                sharey=True, squeeze=False)
    width, mib = 0.2, 2 ** 20
    for axis, family in zip(axes[0], families):
        by_split = {row["split"]: row for row in rows if row["family"] == family}
        ranks = range(P)
        any_row = next(iter(by_split.values()))
        bars = [("measured, retaining I/W", by_split.get("retain"), "measured_peak_bytes",
                 "#9aa0a6"),
                ("measured, freeing I/W", by_split.get("free"), "measured_peak_bytes", "#4387fd"),
                ("simulated, W holds all (f = 1)", any_row, "predicted_default_bytes", "#ee8e00"),
                ("simulated, W holds the formula's share", any_row, "predicted_formula_bytes",
                 "#0da861")]
        for n, (label, row, key, colour) in enumerate(bars):
            if row is not None:
                axis.bar([r + (n - 1.5) * width for r in ranks], [b / mib for b in row[key]],
                         width, label=label, color=colour)
        axis.set_title(f"{family}  p={P} m={M}", fontsize=10)
        axis.set_xticks(list(ranks), [f"rank {r}" for r in ranks], fontsize=8)
    axes[0][0].set_ylabel("peak saved activations (MiB)")
    # the legend of a split-backward family (B-only ones have no retaining run; "freeing" is
    # their only run, with full backwards)
    axes[0][-1].legend(fontsize=6, loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    from loom.schedule.ir import Op
    from loom.schedule.select import schedule_for
    from loom.testing.harness import WorkerPool

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--split", choices=("both", "free", "retain"), default="both")
    options = parser.parse_args()
    shape = Shape()
    pool = WorkerPool(P, pg_timeout_s=300.0)
    rows = []
    mib = 2 ** 20
    try:
        for family in options.families:
            splits = any(a.op is Op.I for row in schedule_for(family, P, M).actions for a in row)
            modes = {"both": (False, True), "free": (True,), "retain": (False,)}[options.split]
            for free in modes if splits else (True,):  # B-only schedules: one run
                results = pool.run(measure, family, shape, free, task_timeout_s=1800.0)
                row = analyse(results[0][0], [profile for _, profile in results], shape, free)
                rows.append(row)
                print(f"{family:16s} {row['split']:6s} measured MiB"
                      f" {[round(b / mib, 2) for b in row['measured_peak_bytes']]}"
                      f"  sim(formula f={row['formula_fraction']:.3f})"
                      f" {[round(b / mib, 2) for b in row['predicted_formula_bytes']]}"
                      f" err {[f'{e:+.1%}' for e in row['error_formula']]}"
                      f"  sim(f=1) err {[f'{e:+.1%}' for e in row['error_default']]}"
                      f"  sim(calibrated) err {[f'{e:+.1%}' for e in row['error_stage_bytes']]}"
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
