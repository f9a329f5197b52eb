"""What the planner prints and writes: the ranked table, one layout's breakdown, TOML and launch.

Everything here formats numbers the cost model and the search already computed; nothing is
estimated here. ``write_chosen`` writes the chosen layout as a Loom config (the same TOML ``loom
train --config`` reads, validated by Loom's own rules before it is written) and the torchrun
command that launches it on the cluster's nodes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loom.config import Config, to_toml
from loom.plan.hardware import GiB
from loom.plan.search import Plan, to_config
from loom.sim.cost_model import StepCost
from loom.sim.uncertainty import band, overlapping


def _spread(plan: Plan) -> tuple[bool, tuple[float, float]]:
    """``band``'s widenings for the plan's accelerator: a measured CPU profile (its ranks share
    cores) by the calibration's spread, a power-capped part by its uncertain clock."""
    return bool(plan.cluster.gpu.cores), plan.cluster.gpu.step_spread


def row(plan: Plan, cost: StepCost) -> dict[str, Any]:
    """One ranked layout as plain data (the ``--json`` output and the table's source)."""
    lay = cost.layout
    return {
        "layout": lay.label(),
        "degrees": {axis: getattr(lay, axis) for axis in
                    ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")},
        "zero_stage": lay.zero_stage, "cp_mode": lay.cp_mode if lay.cp > 1 else None,
        "sequence_parallel": lay.sequence_parallel,
        "schedule": lay.schedule if lay.pp > 1 else None, "chunks": lay.chunks,
        "micro_batch": lay.micro_batch, "microbatches": lay.microbatches,
        "recompute": lay.recompute,
        "step_time_s": cost.step_time,
        "step_band_s": list(band(cost.step_time, *_spread(plan))),
        "tokens_per_s_per_gpu": plan.tokens_per_second_per_gpu(cost),
        "mfu": plan.mfu(cost),
        "memory_gib": cost.memory_total / GiB,
        "bubble": cost.bubble,
        "simulated": cost.simulated,
    }


def table(plan: Plan) -> str:
    work, cluster = plan.workload, plan.cluster
    lines = [f"{work.name}: seq {work.seq_len}, {work.global_batch} sequences"
             f" ({work.tokens_per_step:,} tokens) per step on {cluster.describe()}",
             f"searched {plan.considered:,} layouts in {plan.seconds:.1f} s: {plan.fitting:,}"
             f" examined fit in {plan.memory_budget / GiB:.1f} GiB, the rest ruled out by"
             " their memory or compute floor", ""]
    header = f"{'#':>2}  {'layout':<58} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6}" \
             f" {'mem GiB':>8} {'bubble':>7}"
    lines += [header, "-" * len(header)]
    estimated = False
    for rank, cost in enumerate(plan.ranked, 1):
        r = row(plan, cost)
        mark = "~" if cost.layout.pp > 1 and not cost.simulated else " "
        estimated |= mark == "~"
        lines.append(f"{rank:>2}  {r['layout']:<58} {r['step_time_s']:>8.3f}{mark}"
                     f"{r['tokens_per_s_per_gpu']:>10,.0f} {r['mfu']:>6.1%}"
                     f" {r['memory_gib']:>8.1f} {r['bubble']:>7.1%}")
    if estimated:
        lines.append("~ the schedule's closed-form estimate: the simulation budget ran out first")
    if plan.ranked:
        low, high = band(plan.ranked[0].step_time, *_spread(plan))
        tied = overlapping([c.step_time for c in plan.ranked], *_spread(plan))
        lines.append(f"uncertainty band of #1: {low:.3f}-{high:.3f} s (loom.sim.uncertainty);"
                     + (f" #1-#{tied} overlap within it, so the model does not resolve their"
                        " order" if tied > 1 else " no other listed layout reaches it"))
    if not plan.ranked:
        lines.append("   no layout fits in memory and is runnable by this version of Loom")
    if plan.best_refused is not None:
        b = row(plan, plan.best_refused)
        how = "" if plan.best_refused.simulated or plan.best_refused.layout.pp == 1 \
            else ", closed-form estimate"
        lines += ["", f"faster but refused by this version of Loom: {b['layout']}"
                      f" ({b['step_time_s']:.3f} s{how}, MFU {b['mfu']:.1%})"]
    if plan.refused:
        lines.append("refused layouts by rule (loom/config_rules/):")
        for rule, count in plan.refused.most_common(5):
            lines.append(f"  {count:>6,}  {rule[:150]}")
    return "\n".join(lines)


def breakdown(plan: Plan, cost: StepCost) -> str:
    """``--explain``: where the step's time and one GPU's memory go."""
    lay = cost.layout
    step = cost.step_time
    low, high = band(step, *_spread(plan))
    lines = [f"layout {lay.label()}  (world {lay.world})",
             f"step {step:.4f} s (band {low:.4f}-{high:.4f} s) = pipelined forward/backward"
             f" {cost.pipeline:.4f}"
             f" + exposed data-parallel {cost.dp_exposed:.4f} + optimizer {cost.optimizer:.4f}",
             f"  busiest rank's compute (with exposed tp/cp/ep comm): {cost.compute:.4f} s;"
             f" bubble {cost.bubble:.1%}"
             + (" (simulated schedule)" if cost.simulated and lay.pp > 1 else ""),
             "  communication per step on one rank (s, before overlap where overlapped):"]
    for axis, seconds in cost.comm.items():
        if seconds:
            lines.append(f"    {axis:<3} {seconds:.4f}")
    if cost.stage_costs is not None:
        f, i, w = cost.stage_costs.ops[len(cost.stage_costs.ops) // 2]
        lines.append(f"  a middle stage per microbatch: F {f * 1e3:.2f} ms, I {i * 1e3:.2f} ms,"
                     f" W {w * 1e3:.2f} ms; send {cost.stage_costs.send * 1e6:.1f} us")
    lines.append(f"throughput {plan.tokens_per_second_per_gpu(cost):,.0f} tokens/s/GPU,"
                 f" MFU {plan.mfu(cost):.1%} (model FLOPs), hardware FLOPs"
                 f" {cost.hardware_flops / step / lay.world / 1e12:.1f} TFLOP/s/GPU")
    lines.append(f"memory per GPU (worst pipeline rank) {cost.memory_total / GiB:.2f} GiB"
                 f" of {plan.memory_budget / GiB:.1f} GiB:")
    for name, value in cost.memory.items():
        lines.append(f"    {name:<12} {value / GiB:10.3f} GiB")
    return "\n".join(lines)


def launch_command(plan: Plan, config_path: str) -> str:
    nodes = max(1, plan.cluster.gpus // plan.cluster.gpus_per_node)
    per_node = min(plan.cluster.gpus, plan.cluster.gpus_per_node)
    if nodes == 1:
        return f"loom train --config {config_path} --nproc {per_node}"
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} --rdzv-backend c10d"
            f" --rdzv-endpoint $HEAD_NODE:29500 -m loom train --config {config_path}")


def still_to_set(config: Config) -> list[str]:
    """The values a planned config leaves at a local default that a real run must replace: the
    data, a tokenizer that fits the model's vocabulary, and the weights to start from."""
    out = []
    if not config.data.mix and config.data.source == "stdlib":
        out.append("data.source: the embedded stdlib corpus now; your dataset (a .jsonl, .parquet"
                   " or `loom data prepare` directory), or data.mix")
    vocab = config.model.vocab_size
    if config.data.tokenizer in ("byte", "bpe") and vocab > 4096:
        out.append(f"data.tokenizer: {config.data.tokenizer!r} now; the path of a tokenizer.json"
                   f" that fits model.vocab_size = {vocab} (e.g. the init_from directory)")
    if not config.model.init_from:
        out.append("model.init_from: empty trains from a random init; a Hugging Face or Loom"
                   " directory to continue pretraining or fine-tune (its shape must match"
                   " [model])")
    return out


def write_chosen(plan: Plan, cost: StepCost, path: str | Path) -> str:
    """Write ``cost``'s layout as a Loom TOML config at ``path``; return the launch command."""
    config = to_config(cost.layout, plan.workload)  # Loom's rules, once more
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    header = (f"# written by `loom plan`: {cost.layout.label()}\n"
              f"# predicted {cost.step_time:.4f} s/step, {plan.tokens_per_second_per_gpu(cost):,.0f}"
              f" tokens/s/GPU, MFU {plan.mfu(cost):.1%}, {cost.memory_total / GiB:.1f} GiB/GPU"
              f" on {plan.cluster.describe()}\n")
    todo = still_to_set(config)
    if todo:
        header += "# still to set before training:\n" + "".join(f"#   {line}\n" for line in todo)
    tmp.write_text(header + to_toml(config))
    tmp.replace(path)  # never a half-written config
    return launch_command(plan, str(path))


def to_json(plan: Plan) -> str:
    return json.dumps({
        "workload": {"model": plan.workload.name, "seq_len": plan.workload.seq_len,
                     "global_batch": plan.workload.global_batch},
        "cluster": plan.cluster.describe(), "considered": plan.considered,
        "fitting": plan.fitting, "seconds": plan.seconds,
        "ranked": [row(plan, cost) for cost in plan.ranked],
        "best_refused": row(plan, plan.best_refused) if plan.best_refused else None,
        "refused": dict(plan.refused),
    }, indent=2)


__all__ = ["table", "breakdown", "row", "write_chosen", "launch_command", "to_json", "still_to_set"]


def sites_table(lay: Any, sites: Any, inner: StepCost, modes: list, chosen: Any) -> str:
    """``loom plan --sites``: each dp_mode's step of ``lay`` over the sites (outer_cost)."""
    lines = [f"{lay.label()} with its {lay.dp_replicate} replicas over {sites.count} sites"
             f" ({sites.name or 'custom link'}: {sites.bandwidth * 8 / 1e9:g} Gbit/s per site,"
             f" {sites.latency * 1e3:g} ms); one replica's step {inner.step_time:.3f} s",
             f"{'mode':<8} {'H':>5} {'step s':>10} {'exposed s':>10} {'MB/step/GPU':>12}"
             f" {'memory GiB':>11}"]
    for cost in modes:
        mark = "  <- recommended" if cost is chosen else ""
        lines.append(f"{cost.mode:<8} {cost.outer_steps:>5} {cost.step_time:>10.3f}"
                     f" {cost.exposed:>10.3f} {cost.bytes_per_step / 1e6:>12.1f}"
                     f" {cost.memory / 2**30:>10.1f}{'' if cost.fits else '!'}{mark}")
    within = chosen.step_time <= 1.1 * inner.step_time
    rule = ("sync is within 10% of one replica's step" if chosen.mode == "sync" and within else
            "the smallest H within 10% of one replica's step" if within else
            "no mode is within 10% of one replica's step: the fastest")
    if not all(cost.fits for cost in modes):
        rule += (" of those that fit (!: over the accelerator's memory with the outer loop's"
                 " fp32 snapshot and momentum)" if any(cost.fits for cost in modes) else
                 "; none fits in memory (!)")
    lines.append(f"recommended: {rule}; outer modes trade convergence per token for"
                 " communication, which is not priced here")
    return "\n".join(lines)


def sites_json(lay: Any, sites: Any, inner: StepCost, modes: list, chosen: Any) -> dict:
    return {"layout": lay.label(), "sites": sites.count, "link": sites.name,
            "replica_step_s": inner.step_time,
            "modes": [{"mode": c.mode, "outer_steps": c.outer_steps, "step_time_s": c.step_time,
                       "exposed_s": c.exposed, "bytes_per_step": c.bytes_per_step,
                       "memory_bytes": c.memory, "fits": c.fits,
                       "recommended": c is chosen} for c in modes]}
