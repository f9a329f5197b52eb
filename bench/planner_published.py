"""Loom's planner against published large-scale training runs (docs/planner.md).

For every BF16 / mixed-precision run of ``bench/planner_published.toml`` (collected from the
papers and repositories named in each row) this prices the *published* layout with Loom's cost
model and simulator (``loom plan --layout``), puts the prediction beside the published number in
the same FLOP convention, and asks the planner for its own best layout of the same model, batch
and cluster (``loom plan --any``: what-if, including layouts this version of Loom refuses).

Mapping a published row to Loom's model: rows marked ``activation = "swiglu"`` (Llama) keep their
SwiGLU MLP; the others are GPT-style and get Loom's GELU MLP (``model.mlp = "gelu"``) of the
published ``ffn_dim`` (4h where unstated), as ``loom.models.presets`` does for GPT-3 (until 26 Nov
2026 both stood in a SwiGLU MLP of F = 8h/3, the same parameters and FLOPs). Unstated knobs
take the value stated in the row's notes or Megatron's default: micro batch 1, interleaving
with 2 chunks, no sequence parallelism before Korthikanti et al. 2022, full recomputation for
the 2021 Megatron rows (their FLOP formula includes it). Sequence parallelism (from 2022 on, or
on TorchTitan) and recomputation, where a row states neither, are the run's user's choice: the
row is priced with the fastest setting that fits in memory (``unstated_choices``), and judged
out of memory only when none does. Every published run ran, so some setting fitted; pricing the
both off had judged eight MegaScale baseline rows out of memory by 0.7 GiB. FP8 rows (since 29 Nov
2026) are priced with the blocks' linears in FP8 at the accelerator's FP8 peak (``loom plan
--fp8``; every recipe as tensorwise); MoE rows are priced with their experts, Megatron's
expert parallelism (inside its data parallelism) as Loom's ep; rows with features Loom's
model or layout lacks (MLA, alternating sliding windows with attention sinks, expert
parallelism folded over tensor ranks) and accelerators outside the catalog are listed as
skipped with the reason.

Each row is priced with its ``framework`` profile (``loom.sim.frameworks``; the row's
``[run.overlap]`` overrides its overlap defaults, its ``rank_order`` the profile's placement of
the parallelisms, and its ``[run.topology]`` describes the network, ``loom plan
--nodes-per-rack`` and the like) unless ``--framework`` forces one for every
row, and the rows are reported in their two halves (``split``, issue 21): the planner may be
tuned on "tune" rows only, and "holdout" rows measure it (``split_report``: within 10% and 15%,
the median time ratio per family = framework/accelerator, and the out-of-memory verdict, which
is right when the published layout fits, since every published run ran).

    python bench/planner_published.py            # markdown tables on stdout
    python bench/planner_published.py --json out.json --no-search
    python bench/planner_published.py --framework loom --no-search   # Loom's profile everywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
import statistics
import sys
import time
import tomllib
from pathlib import Path

from loom.models.layers import TransformerArgs
from loom.plan.hardware import make_cluster
from loom.plan.search import plan, simulate_step
from loom.plan.space import Workload
from loom.layout import Layout
from loom.sim.cost_model import CostModel
from loom.sim.frameworks import Framework, framework

SPLITS = ("tune", "holdout")

HERE = Path(__file__).parent


def gpu_of(row: dict) -> tuple[str, str, str] | None:
    """(catalog accelerator, intra link, inter link) for a row, or None when not in the catalog."""
    name = row.get("gpu", "")
    if "A100" in name or "Ampere" in name:
        return "A100-80GB", "nvlink3", "hdr-ib"  # Selene: one 200 Gb/s HCA per GPU
    if "H100" in name and "500 W" in name:  # TorchTitan's Grand Teton parts: 400 Gb/s per GPU
        return "H100-SXM-500W", "nvlink4", "roce-400"
    if "H100" in name:
        inter = "roce-400" if "llama3-405b" in row["name"] else "ndr-ib"
        return "H100-SXM", "nvlink4", inter
    if "H200" in name:  # 8 per host on NVLink 4, 400 Gb/s per GPU (the rows' stated fabric)
        return "H200", "nvlink4", "ndr-ib"
    if "H800" in name:  # DeepSeek-V3 §3.1: NVLink in the node, 400 Gb/s InfiniBand per GPU
        return "H800", "nvlink4-h800", "ndr-ib"
    if "B200" in name:  # DGX B200: NVLink 5 in the node, 8 ConnectX-7 at 400 Gb/s per node
        return "B200", "nvlink5", "ndr-ib"
    if "V100" in name and "SXM3" in name:  # DGX-2H: NVSwitch, 8 EDR HCAs per 16 GPUs
        return "V100-SXM3-32GB", "nvswitch2", "edr-ib-x2"
    if "V100" in name:
        return "V100-SXM2-32GB", "nvlink2", "edr-ib"
    return None


def skip_reason(row: dict) -> str | None:
    if gpu_of(row) is None:
        return f"accelerator {row.get('gpu')} not in Loom's catalog"
    model, lay = row["model"], row["layout"]
    if "attention" in model:  # any attention but Loom's (GQA, one causal or sliding window)
        return f"attention Loom's model lacks ({model['attention']})"
    if lay.get("ep", 1) > 1 and lay["ep"] > lay["dp"]:
        # Megatron folds expert parallelism over tensor ranks too; Loom's ep is a data axis
        return ("expert parallelism across tensor-parallel ranks (ep > dp), which Loom's layout"
                " lacks")
    return None


def fp8_of(row: dict) -> bool:
    """Whether the row's linears ran in FP8 (its ``precision`` names fp8 or float8)."""
    precision = str(row.get("precision", "")).lower()
    return "fp8" in precision or "float8" in precision


def fp8_all_gather_of(row: dict) -> bool:
    """Whether FSDP2 all-gathered the FP8 linears' weights in float8 (the row says so)."""
    return bool(row.get("fp8_all_gather")) and fp8_of(row)


def model_of(row: dict) -> TransformerArgs:
    m = row["model"]
    h = m["hidden"]
    swiglu = m.get("activation") == "swiglu"
    ffn = m.get("ffn_dim") or (round(8 * h / 3) if swiglu else 4 * h)
    experts = m.get("n_experts", 0)
    return TransformerArgs(dim=h, n_layers=m["layers"], n_heads=m["heads"],
                           n_kv_heads=m.get("kv_heads", m["heads"]), ffn_dim=ffn,
                           vocab_size=m["vocab"], max_seq_len=m["seq_len"],
                           mlp="swiglu" if swiglu else "gelu",
                           head_dim_override=m.get("head_dim", 0),
                           qk_norm=bool(m.get("qk_norm", False)),
                           n_experts=experts, top_k=m.get("top_k", 2) if experts else 2,
                           expert_ffn_dim=m.get("moe_ffn_dim", 0),
                           n_shared_experts=m.get("n_shared_experts", 0),
                           n_dense_layers=m.get("dense_layers", 0))


def published_year(row: dict) -> int | None:
    """The year of the row's publication: the first year named in ``source``, else the year
    of its arXiv identifier (``arXiv 2407.21783`` is 2024), else None (a repository page)."""
    source = row.get("source", "")
    year = re.search(r"\b(19[89]\d|20[0-3]\d)\b", source)
    if year:
        return int(year.group(1))
    arxiv = re.search(r"arXiv (\d{2})\d{2}\.\d{4,5}", source)
    if arxiv:
        return 2000 + int(arxiv.group(1))
    # NVIDIA's containers are tagged year.month: "NeMo 24.07", "'26.02 NeMo Container'"
    nemo = re.search(r"NeMo (\d{2})\.(?:0[1-9]|1[0-2])\b|\b(\d{2})\.(?:0[1-9]|1[0-2]) NeMo",
                     source)
    return 2000 + int(nemo.group(1) or nemo.group(2)) if nemo else None


def unstated_choices(row: dict) -> dict[str, tuple]:
    """The knobs the row does not state and the values its stack could have run them with, in
    order of speed (fastest first). The run's user chose among them, so the planner may too.

    - ``sequence_parallel``: off or on where tensor parallelism is used and the row is from
      2022 on (Korthikanti et al. 2022 introduced it; earlier rows cannot have used it) or its
      stack is TorchTitan (whose tensor parallelism shards the norms' activations by default).
    - ``recompute``: none, selective or full (Megatron's and TorchTitan's three settings).
    - ``zero_stage``: 0 or 1 on a Megatron stack with data parallelism from 2023 on, where the
      row names no sharding: Megatron's distributed optimizer (``--use-distributed-optimizer``,
      ZeRO-1), which NeMo's and Megatron-Bridge's recipes turn on (NeMo's
      ``distributed_fused_adam``); Korthikanti et al. 2022 and earlier predate it.
    """
    lay, choices = row["layout"], {}
    year = published_year(row)
    sp_possible = lay.get("tp", 1) > 1 and (
        row.get("framework") == "torchtitan" or (year is not None and year >= 2022))
    if lay.get("sequence_parallel") is None and sp_possible:
        choices["sequence_parallel"] = (False, True)
    if lay.get("recompute") is None:
        choices["recompute"] = ("none", "selective", "full")
    sharding_stated = "zero_stage" in lay or "none" not in str(lay.get("fsdp", "none")).lower()
    if row.get("framework") == "megatron" and lay["dp"] > 1 and not sharding_stated \
            and year is not None and year >= 2023:
        choices["zero_stage"] = (0, 1)
    return choices


def layout_of(row: dict, **chosen) -> tuple[Layout, list[str]]:
    """The published layout as a Loom Layout, and the assumptions made for unstated knobs;
    ``chosen`` sets knobs of ``unstated_choices`` (default: the fastest value of each)."""
    lay, assumed = row["layout"], []
    pp, tp, cp = lay.get("pp", 1), lay.get("tp", 1), lay.get("cp", 1)
    dp = lay["dp"]
    batch = lay.get("global_batch_size") or lay.get("batch_per_dp", 1) * dp
    micro = lay.get("micro_batch_size")
    if micro is None and pp > 1 and row["source"].startswith("pytorch/torchtitan") \
            and batch % (dp * pp) == 0:
        # a run of torchtitan itself (not one priced with its profile, as Llama 3's) takes
        # its default: as many microbatches as pipeline ranks (torchtitan's
        # ``experimental.pipeline_parallel_microbatches`` unset is the pp degree)
        micro = batch // (dp * pp)
        assumed.append(f"{pp} microbatches of {micro} (torchtitan's default)")
    elif micro is None:
        micro = 1
        assumed.append("micro batch 1")
    sharded = "fsdp" in lay and "none" not in str(lay["fsdp"]).lower()
    free = unstated_choices(row)
    zero = lay.get("zero_stage", 0)
    if "zero_stage" in free:
        zero = chosen.get("zero_stage", free["zero_stage"][0])
        assumed.append("distributed optimizer" if zero else "no distributed optimizer")
    if sharded:
        zero = 2 if "not resharded" in str(lay["fsdp"]) else 3
    schedule, chunks = "none", 1
    if pp > 1:
        if "interleaved" in str(lay.get("schedule", "")) or "virtual_stages" in lay:
            schedule = "interleaved_1f1b"
            chunks = lay.get("virtual_stages") or 2
            if "virtual_stages" not in lay:
                assumed.append("2 chunks per rank")
        else:
            schedule = "1f1b"
            if "schedule" not in lay:
                assumed.append("1F1B")
    recompute = lay.get("recompute")
    if recompute is None:
        recompute = chosen.get("recompute", free["recompute"][0])
        assumed.append("no recomputation" if recompute == "none" else f"{recompute} recomputation")
    sp = lay.get("sequence_parallel")
    if sp is None:
        sp = chosen.get("sequence_parallel", False) if "sequence_parallel" in free else False
        if "sequence_parallel" in free:
            assumed.append("sequence parallel" if sp else "no sequence parallelism")
    # Megatron's data parallelism holds its expert parallelism (the experts' groups are
    # carved out of it); Loom's ep is a data axis of its own beside dp_replicate x dp_shard
    ep = lay.get("ep", 1)
    rest = dp // ep
    layout = Layout(pp=pp, dp_replicate=1 if (sharded or zero) else rest,
                    dp_shard=rest if (sharded or zero) else 1, ep=ep, cp=cp, tp=tp,
                    zero_stage=zero,
                    cp_mode=lay.get("cp_mode", "ring"),
                    sequence_parallel=bool(sp) and tp > 1, schedule=schedule, chunks=chunks,
                    micro_batch=micro, microbatches=batch // (dp * micro), recompute=recompute,
                    recompute_every=lay.get("recompute_every", 2))
    return layout, assumed


def megatron_eq3(batch: int, seq: int, model: TransformerArgs) -> float:
    """Narayanan et al. 2021 eq. 3: FLOPs per iteration including the recompute forward."""
    h, l, v = model.dim, model.n_layers, model.vocab_size
    return 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))


def split_by_rule(rows: list[dict]) -> dict[str, str]:
    """The split the file's header states, recomputed: rows grouped by publication (``source``
    up to its first comma), groups numbered from 1 in file order, rows alternating within a
    group in file order from "tune" (odd groups) or "holdout" (even groups). Rows added after
    the tune half was frozen (``added_after_split = true``) are all "holdout" and take no part
    in the alternation, so adding them moves no earlier row."""
    groups: list[str] = []
    seen: dict[str, int] = {}
    out = {}
    for row in rows:
        if row.get("added_after_split"):
            out[row["name"]] = "holdout"
            continue
        group = row["source"].split(",")[0].strip()
        if group not in groups:
            groups.append(group)
        k = seen.get(group, 0)
        seen[group] = k + 1
        first = 0 if (groups.index(group) + 1) % 2 == 1 else 1
        out[row["name"]] = SPLITS[(first + k) % 2]
    return out


def framework_of(row: dict, forced: str | None = None) -> Framework:
    """The row's profile with its ``[run.overlap]`` overrides, its ``compiled`` and its stated
    ``rank_order``
    (``forced``: one profile for every row, without overrides)."""
    if forced:
        return framework(forced)
    stack = framework(row["framework"]).with_overlap(**row.get("overlap", {}))
    if "compiled" in row:  # the row's stack, where it is known to differ from the profile's
        stack = stack.compiled_as(bool(row["compiled"]))
    if "rank_order" in row:
        stack = dataclasses.replace(stack, rank_order=tuple(row["rank_order"]))
    return stack


def _published_layout_priced(row: dict, model: TransformerArgs, seq: int, cluster,
                             stack: Framework):
    """The published layout priced with the unstated knobs set as the run's user would have
    set them: the fastest setting that fits in memory, or, when none fits, the one that needs
    the least (the run ran, so it ran with some setting; the verdict is out of memory only
    when no setting the paper leaves open fits)."""
    free = unstated_choices(row)
    priced = []
    for values in itertools.product(*free.values()):
        layout, assumed = layout_of(row, **dict(zip(free, values)))
        batch = layout.dp * layout.micro_batch * layout.microbatches
        cost_model = CostModel(model, seq, batch, cluster, framework=stack, fp8=fp8_of(row),
                               fp8_all_gather=fp8_all_gather_of(row))
        priced.append((layout, assumed, simulate_step(cost_model, cost_model.evaluate(layout))))
    fits = [p for p in priced if p[2].memory_total <= cluster.gpu.memory_bytes]
    if fits:
        return min(fits, key=lambda p: p[2].step_time)
    return min(priced, key=lambda p: p[2].memory_total)


def compare(row: dict, *, search: bool = True, forced: str | None = None) -> dict:
    model = model_of(row)
    seq = row["model"]["seq_len"]
    gpu, intra, inter = gpu_of(row)
    cluster = make_cluster(gpu, row["gpus"], row.get("gpus_per_node", 8), intra=intra, inter=inter,
                           network=row.get("topology"))
    stack = framework_of(row, forced)
    layout, assumed, cost = _published_layout_priced(row, model, seq, cluster, stack)
    batch = layout.dp * layout.micro_batch * layout.microbatches
    step = cost.step_time
    rep = row["reported"]
    out = {"name": row["name"], "source": row["source"], "gpus": row["gpus"], "gpu": gpu,
           "layout": layout.label(), "assumed": assumed, "predicted_step_s": step,
           "memory_gib": cost.memory_total / 2**30, "bubble": cost.bubble,
           "split": row.get("split", "?"), "framework": stack.name,
           "family": f"{row.get('framework', 'loom')}/{gpu}",
           "oom": cost.memory_total > cluster.gpu.memory_bytes}
    convention = str(row.get("flops_convention", ""))
    # the published outcome: every row ran, except a sweep's cells published as out of memory
    out["published_oom"] = rep.get("outcome") == "oom"
    out["oom_right"] = out["oom"] == out["published_oom"]
    if out["published_oom"]:  # no throughput: scored by the out-of-memory verdict alone
        out.update(metric="outcome", published=None, predicted=None, ratio=None)
        return out
    # tokens/s first where published: it counts the same thing on both sides, where an MFU is
    # the stack's own FLOP count (torchtitan's includes the embedding: 5% more than Loom's)
    if "tokens_per_s_per_gpu" in rep:
        out["metric"] = "tokens/s/GPU"
        out["published"] = rep["tokens_per_s_per_gpu"]
        out["predicted"] = batch * seq / step / row["gpus"]
    elif "tflops_per_gpu" in rep and "megatron-eq3" in convention:
        out["metric"] = "TFLOP/s/GPU (Megatron eq. 3)"
        out["published"] = rep["tflops_per_gpu"]
        out["predicted"] = megatron_eq3(batch, seq, model) / step / row["gpus"] / 1e12
    elif "iteration_time_s" in rep:
        out["metric"] = "iteration time (s)"
        out["published"] = rep["iteration_time_s"]
        out["predicted"] = step
    else:
        out["metric"] = "MFU"
        out["published"] = rep["mfu"]
        out["predicted"] = cost.model_flops / step / (row["gpus"] * cluster.gpu.peak_flops)
    # time-like metrics: predicted / published > 1 means Loom predicts slower than published
    slower = out["predicted"] / out["published"]
    out["ratio"] = slower if out["metric"].startswith("iteration") else 1 / slower
    if not search:
        return out
    started = time.perf_counter()
    best = plan(Workload(row["name"], model, seq, batch), cluster, top=1, runnable_only=False,
                cost_model=CostModel(model, seq, batch, cluster, framework=stack,
                                     fp8=fp8_of(row), fp8_all_gather=fp8_all_gather_of(row)))
    out["plan_seconds"] = time.perf_counter() - started
    if best.ranked:
        top = best.ranked[0]
        out["planner_best"] = top.layout.label()
        out["planner_best_step_s"] = top.step_time
        out["planner_speedup_vs_published_layout"] = step / top.step_time
    return out


def split_report(results: list[dict]) -> dict[str, dict]:
    """Per half: rows, within 10% and 15% (time ratio Loom/published), the median ratio per
    family, how many published layouts that ran the model wrongly judges out of memory, and
    how often its out-of-memory verdict matches the published outcome over every row (those
    that ran and the cells published as out of memory); the 10th and 90th percentiles of the
    ratio (``statistics.quantiles``, inclusive: the tune half's are
    ``loom.sim.uncertainty.TUNE_RATIO_LOW`` / ``HIGH``) and how many rows lie between the tune
    half's two."""
    out = {}
    tune = [r["ratio"] for r in results if r["split"] == "tune" and r["ratio"] is not None]
    band = deciles(tune)
    for half in SPLITS:
        everything = [r for r in results if r["split"] == half]
        rows = [r for r in everything if r["ratio"] is not None]
        families: dict[str, list[float]] = {}
        for r in rows:
            families.setdefault(r["family"], []).append(r["ratio"])
        out[half] = {
            "rows": len(rows),
            "within_10pct": sum(abs(r["ratio"] - 1) <= 0.10 for r in rows),
            "within_15pct": sum(abs(r["ratio"] - 1) <= 0.15 for r in rows),
            "median_ratio": statistics.median(r["ratio"] for r in rows) if rows else None,
            "median_ratio_by_family": {f: statistics.median(v) for f, v in sorted(families.items())},
            "judged_oom": [r["name"] for r in rows if r["oom"]],
            "oom_verdicts": len(everything),
            "oom_verdicts_right": sum(r["oom_right"] for r in everything),
            "published_oom_missed": [r["name"] for r in everything
                                     if r["published_oom"] and not r["oom"]],
            "ratio_p10_p90": deciles([r["ratio"] for r in rows]),
            "inside_tune_p10_p90": sum(band[0] <= r["ratio"] <= band[1] for r in rows)
            if band else None,
        }
    return out


def deciles(ratios: list[float]) -> tuple[float, float] | None:
    """(10th, 90th) percentile of ``ratios`` (inclusive method), or None for fewer than two."""
    if len(ratios) < 2:
        return None
    cuts = statistics.quantiles(ratios, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def format_split_report(report: dict[str, dict]) -> str:
    lines = ["| half | rows | within ±10% | within ±15% | median ratio | median ratio by family |"
             " layouts that ran, judged OOM | OOM verdict right |", "|---|---|---|---|---|---|---|---|"]
    for half, r in report.items():
        fam = "; ".join(f"{f} {m:.2f}" for f, m in r["median_ratio_by_family"].items())
        med = f"{r['median_ratio']:.2f}" if r["median_ratio"] is not None else "-"
        missed = r["published_oom_missed"]
        lines.append(f"| {half} | {r['rows']} | {r['within_10pct']} | {r['within_15pct']} |"
                     f" {med} | {fam} | {len(r['judged_oom'])}"
                     + (f" ({', '.join(r['judged_oom'])})" if r["judged_oom"] else "")
                     + f" | {r['oom_verdicts_right']} of {r['oom_verdicts']}"
                     + (f" (published OOM judged to fit: {', '.join(missed)})" if missed else "")
                     + " |")
    return "\n".join(lines)


def load_rows() -> list[dict]:
    return tomllib.loads((HERE / "planner_published.toml").read_text())["run"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument("--no-search", action="store_true",
                        help="price the published layouts only (no planner search per row)")
    parser.add_argument("--framework", help="price every row with this profile instead of"
                                            " its own (no overlap overrides)")
    args = parser.parse_args(argv)
    rows = load_rows()
    results, skipped = [], []
    for row in rows:
        reason = skip_reason(row)
        if reason:
            skipped.append((row["name"], reason))
            continue
        results.append(compare(row, search=not args.no_search, forced=args.framework))
        print(f"priced {row['name']}", file=sys.stderr)
    print("| run | split | profile | GPUs | published layout (as priced) | metric | published |"
          " Loom | time ratio Loom/published | memory GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["ratio"] is None:
            print(f"| {r['name']} | {r['split']} | {r['framework']} | {r['gpus']} {r['gpu']} |"
                  f" {r['layout']} | outcome | out of memory |"
                  f" {'out of memory' if r['oom'] else 'fits'} | - | {r['memory_gib']:.1f} |")
            continue
        print(f"| {r['name']} | {r['split']} | {r['framework']} | {r['gpus']} {r['gpu']} |"
              f" {r['layout']}"
              + (f" (assumed: {', '.join(r['assumed'])})" if r["assumed"] else "")
              + f" | {r['metric']} | {r['published']:g} | {r['predicted']:.3g} |"
              f" {r['ratio']:.2f} | {r['memory_gib']:.1f}{' OOM' if r['oom'] else ''} |")
    print()
    report = split_report(results)
    print(format_split_report(report))
    print()
    print("| run | planner's best layout | predicted step (s) | vs published layout | "
          "search time (s) |")
    print("|---|---|---|---|---|")
    for r in results:
        if "planner_best" in r:
            print(f"| {r['name']} | {r['planner_best']} | {r['planner_best_step_s']:.2f} |"
                  f" {r['planner_speedup_vs_published_layout']:.2f}x | {r['plan_seconds']:.1f} |")
    print()
    for name, reason in skipped:
        print(f"- skipped {name}: {reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": results, "skipped": skipped,
                                               "split_report": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
